"""Every private TensorFlow / Keras hook tfdist relies on, in one place.

Each hook says why it is needed, and ``tests/test_hooks.py`` fails loudly when a TF or
Keras upgrade removes what it touches. Modules elsewhere call these functions instead
of reaching into private names themselves.
"""

from __future__ import annotations

import itertools

# Group keys a strategy instance may use before the next instance's range starts.
COLLECTIVE_KEY_STRIDE = 10_000
_collective_key_bases = itertools.count(1)


def assign_collective_key_base(strategy_cls_or_obj) -> int:
    """Gives a strategy instance its own range of collective group keys.

    Why: stock MirroredStrategy instances all start their group keys at 1, so two of
    them in one process (two models in a notebook) collide: "Shape mismatch in the
    collective instance 100". TF reads the private ``_collective_key_base`` attribute of
    the container strategy in ``MirroredExtended.__init__``; an instance attribute set
    before ``super().__init__`` shadows the class default of 0.
    """
    base = next(_collective_key_bases) * COLLECTIVE_KEY_STRIDE
    strategy_cls_or_obj._collective_key_base = base
    return base


# ---- multi-worker (tfdist.strategies.multi_worker) --------------------------------------

# Task types the coordination service tracks in a MultiWorkerMirroredStrategy job.
COORDINATED_JOBS = ("chief", "worker")


def collective_all_reduce_extended_class():
    """TF's ``CollectiveAllReduceExtended``, the engine of MultiWorkerMirroredStrategy.

    Why: ``tf.distribute.MultiWorkerMirroredStrategy.__init__`` builds it directly, so a
    subclass that wants its own extended object (tfdist's overridable
    ``_create_extended``) must import the class from its private module.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy

    return collective_all_reduce_strategy.CollectiveAllReduceExtended


def configure_coordination_service(jobs, register_timeout_seconds, heartbeat_timeout_seconds):
    """Configures TF's coordination service before MultiWorkerMirroredStrategy starts it.

    Why: TF's strategy configures the service only when none is configured, without a
    registration barrier, so a worker that never starts makes every other worker block
    forever in the constructor. ``cluster_register_with_barrier`` (a proto field the
    public ``configure_coordination_service`` does not take) makes every task wait at
    most ``register_timeout_seconds`` for all others, then fail with
    ``DeadlineExceededError``. Must run before TF initializes its context.

    Args:
        jobs: ``{task_type: [address, ...]}`` of the whole cluster.
        register_timeout_seconds: How long tasks wait for each other at start-up.
        heartbeat_timeout_seconds: Silence after which a task is declared dead.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    leader = "/job:chief/replica:0/task:0" if jobs.get("chief") else \
        "/job:worker/replica:0/task:0"
    coordinated = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(jobs[job]))
                   for job in COORDINATED_JOBS if jobs.get(job)]
    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=leader, enable_health_check=True,
        cluster_register_timeout_in_ms=int(register_timeout_seconds * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000),
        coordinated_jobs=coordinated)
    config = ctx.coordination_service
    config.cluster_register_with_barrier = True
    return config
