"""Hooks into TensorFlow's distribute internals: the private TF pieces strategies use.

Collective key ranges per strategy instance, the extended class of
MultiWorkerMirroredStrategy, the coordination service's registration barrier, the
helpers a strategy with its own ``extended`` is built from, a dataset's batch size, an
``OpError``'s message, and functions kept out of line. Each hook says why;
``tests/test_hooks_tf.py`` fails loudly when a TF upgrade removes what it touches.
"""

from __future__ import annotations

import itertools
import sys

from tfdist.cluster import TRAINING_TASK_TYPES

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

def collective_all_reduce_extended_class():
    """TF's ``CollectiveAllReduceExtended``, the engine of MultiWorkerMirroredStrategy.

    Why: ``tf.distribute.MultiWorkerMirroredStrategy.__init__`` builds it directly, so a
    subclass that wants its own extended object (tfdist's overridable
    ``_create_extended``) must import the class from its private module.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy

    return collective_all_reduce_strategy.CollectiveAllReduceExtended


_checked_extended = None


def checked_collective_extended_class():
    """``CollectiveAllReduceExtended`` whose variable creation goes through
    ``tfdist_create_variable(create, name)``, which a subclass overrides.

    Why: TF creates (and broadcasts from the chief) each variable in the private
    ``_create_variable``; a worker whose model differs fails there with an opaque
    "Shape mismatch in the collective", and only an override can name the variable.
    """
    global _checked_extended
    if _checked_extended is None:
        base = collective_all_reduce_extended_class()

        class CheckedCollectiveExtended(base):
            def _create_variable(self, next_creator, **kwargs):
                return self.tfdist_create_variable(
                    lambda: base._create_variable(self, next_creator, **kwargs),
                    kwargs.get("name"))

            def tfdist_create_variable(self, create, name):
                """Creates the variable ``name`` by calling ``create()``."""
                return create()

        _checked_extended = CheckedCollectiveExtended
    return _checked_extended


def in_update() -> bool:
    """Whether this runs in ``extended.update`` for one replica (an optimizer's step on
    a replica's own variable: sharded or split variables are read as their slice there).

    Why: TF tells it only through the private ``get_update_replica_id``.
    """
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib.get_update_replica_id() is not None


def in_multi_worker_mode(extended) -> bool:
    """Whether a strategy's ``extended`` spans several workers.

    Why: TF has no public flag; its own strategies and Keras read the private
    ``_in_multi_worker_mode()``.
    """
    return extended._in_multi_worker_mode()


def replica_id_in_sync_group(extended, local_id: int):
    """The global replica id of this worker's local replica ``local_id`` (a tensor).

    Why: outside a replica context TF has no public way to ask which global replica a
    local device is; ``ValueContext`` needs it to build values per replica by hand.
    """
    return extended._get_replica_id_in_sync_group(local_id)


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
                   for job in TRAINING_TASK_TYPES if jobs.get(job)]
    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=leader, enable_health_check=True,
        cluster_register_timeout_in_ms=int(register_timeout_seconds * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000),
        coordinated_jobs=coordinated)
    config = ctx.coordination_service
    config.cluster_register_with_barrier = True
    return config


def tf_distribute_internals():
    """TF's private pieces a strategy with its own ``extended`` is built from.

    Why: `tfdist.HorovodStrategy` extends ``MirroredExtended`` (local replicas as in
    MirroredStrategy) and reroutes its reductions, gathers and input sharding; TF has
    no public base class for a strategy's ``extended``, nor public versions of these
    helpers. Returns a namespace with: ``MirroredExtended``, ``simple_broadcast``,
    ``reduce_non_distributed_value``, ``get_distributed_dataset``,
    ``get_distributed_datasets_from_function``, ``regroup``, ``is_mirrored``,
    ``CheckpointInitialValue``.
    """
    import types

    from tensorflow.python.distribute import cross_device_ops, distribute_utils, input_util
    from tensorflow.python.distribute import mirrored_strategy
    from tensorflow.python.trackable import base as trackable

    return types.SimpleNamespace(
        MirroredExtended=mirrored_strategy.MirroredExtended,
        simple_broadcast=cross_device_ops.simple_broadcast,
        reduce_non_distributed_value=cross_device_ops.reduce_non_distributed_value,
        get_distributed_dataset=input_util.get_distributed_dataset,
        get_distributed_datasets_from_function=input_util.get_distributed_datasets_from_function,
        regroup=distribute_utils.regroup,
        is_mirrored=distribute_utils.is_mirrored,
        CheckpointInitialValue=trackable.CheckpointInitialValue,
    )


def dataset_batch_size(dataset) -> int | None:
    """The batch size a `tf.data.Dataset` was batched with, or None if unknown.

    Why: a global batch that does not split evenly over the replicas fails in Keras'
    first step; TF knows the batch size of a dataset (partial batches aside) only
    through the private ``compute_batch_size``, which walks the dataset graph.
    """
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import distribute

    try:
        size = int(distribute.compute_batch_size(dataset).numpy())
    except (IndexError, ValueError, tf.errors.OpError):  # e.g. an unbatched dataset
        return None
    return size if size > 0 else None


def function_not_inlined(fn):
    """``tf.function(fn)`` that runs as one call, never inlined into its caller's graph.

    Why: inlined, a function's ops are scheduled one by one by the caller's executor,
    which stops scheduling when another of its ops fails; called, the body runs whole
    once it has started (the exactly-once update of `tfdist.keras.ps_steps`). TF keeps
    a function out of line only through the private ``_noinline`` attribute, which it
    allows in ``experimental_attributes``.
    """
    import tensorflow as tf

    return tf.function(fn, autograph=False, experimental_attributes={"_noinline": True})


def rewrite_op_error_message(error: BaseException, fix) -> None:
    """Sets a TensorFlow ``OpError``'s message to ``fix(message)``; other errors are left.

    Why: ``OpError`` prints its private ``_message``, not its ``args``, so an error must
    change it to name the user's path instead of a temporary one (`tfdist.files.name_user_path`).
    """
    tf = sys.modules.get("tensorflow")  # no OpError exists before TensorFlow is imported
    if tf is not None and isinstance(error, tf.errors.OpError):
        error._message = fix(error._message)


def call_time_value(closure, dtype):
    """A scalar that takes ``closure()``'s value each time the enclosing ``tf.function``
    is called (in eager mode: ``closure()`` itself).

    Why: TF caches a collective instance's shape by its instance key: a group collective
    whose key is fixed when the step is traced fails when a later call has other shapes
    (a partial last batch: "Shape mismatch in the collective instance"). TF's own
    collectives take a fresh key per call through the private
    ``FuncGraph.capture_call_time_value`` (``CollectiveReplicaLauncher._next_instance_key``);
    as there, a function traced inside another defers the value to the outermost one.
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):  # a cond or while body
        graph = graph.outer_graph
    if tf.executing_eagerly() or not getattr(graph, "building_function", False):
        return tf.constant(closure(), dtype)

    def deferred():
        return call_time_value(closure, dtype)  # again, in the caller's graph if any

    with graph.as_default():
        return graph.capture_call_time_value(deferred, tf.TensorSpec([], dtype))
