"""`tfdist.HorovodStrategy`: synchronous training under ``horovodrun``, Horovod as the engine.

A thin subclass of `tfdist.MultiWorkerMirroredStrategy` on the Horovod engine
(`tfdist.engines.horovod`): no cluster (``horovodrun`` connects the processes), and
this rank's devices. Rank, size, the chief, Keras' ``reduce`` fix and ``fit`` are the
multi-worker strategy's. Every batch all-reduce (gradients, a replica's ``all_reduce``)
goes through the strategy's communicator, which compresses and counts it once, as
Horovod's ``Compression`` does; ``strategy.reduce`` (losses, metrics) is exact and not
counted.
"""

from __future__ import annotations

import logging
import os

from tfdist import env
from tfdist.cluster import ClusterSpec
from tfdist.engines.registry import engine_class
from tfdist.engines.horovod import ops as comm
from tfdist.engines.horovod.extended import rank_devices
from tfdist.strategies.options.arguments import (DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_STARTUP_TIMEOUT,
                                         check_horovod)
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

logger = logging.getLogger("tfdist")


def _refuse_a_tf_config_job(environ) -> None:
    """Raises if TF_CONFIG names several training tasks: without horovodrun each would
    train alone, silently (e.g. under `tfdist.spark.run` or `tfdist.ray.run`)."""
    if not environ.get(env.TF_CONFIG):
        return
    spec = ClusterSpec.from_env(environ)
    if spec.num_workers > 1:
        raise ValueError(
            f"HorovodStrategy runs under horovodrun (HOROVOD_RANK is not set), but "
            f"TF_CONFIG names {spec.num_workers} training tasks: each would train alone. "
            "Use tfdist.MultiWorkerMirroredStrategy(engine='horovod') for a TF_CONFIG job "
            "(Horovod/Gloo without horovodrun), or start the job with horovodrun.")


class HorovodStrategy(MultiWorkerMirroredStrategy):
    """Synchronous data parallelism with Horovod's collective ops as the engine.

    Start one process per worker with ``horovodrun -np N -H host:N --gloo python
    train.py``. Started otherwise, the process is the only rank (as Horovod does). Inside
    each process the model is mirrored on ``devices`` as in `tfdist.MirroredStrategy`;
    gradients, losses and metrics are reduced across all replicas of all processes.
    Keras 3 ``fit``/``evaluate``/``predict`` work in its scope with the global batch
    size, as with `tf.distribute.MultiWorkerMirroredStrategy`: each process reads its
    own slice of every global batch.

    Variables created in the scope start from rank 0's initial values. Only Horovod's
    raw ops are used (not ``hvd.DistributedOptimizer`` nor ``horovod.keras``).

    It is `tfdist.MultiWorkerMirroredStrategy` with ``engine="horovod"`` and no TF
    cluster (no TF_CONFIG, no gRPC server).

    Args:
        devices: Local device names; default: this process's GPU (by Horovod local
            rank) if there are GPUs, else the local CPU(s).
        compression: None, ``"fp16"`` or ``"bf16"``: dtype of floating gradients (and
            of any replica-context ``all_reduce``) on the wire, as Horovod's
            ``Compression.fp16``. Metrics are never compressed.
        communication_options: A `tfdist.CommunicationOptions` (compression,
            accumulate_steps, timeout_seconds: Gloo's timeout, as under
            ``MultiWorkerMirroredStrategy(engine="horovod")``).
        accumulate_steps: Sum this many micro-batches locally before each all-reduce
            (Horovod's ``backward_passes_per_step``).

    Attributes:
        communicator: The `tfdist.comm.communicator.Accounted` communicator every
            batch all-reduce goes through (compression, byte counting).
        bytes_communicated: Bytes this process contributed to batch all-reduces
            (gradients, replica-context ``all_reduce``) so far, after compression.
        rank, size: This process's Horovod rank and the number of processes.
        num_workers, is_chief: ``size``, and whether this is rank 0.
    """

    def __init__(self, devices=None, compression=None, communication_options=None,
                 accumulate_steps=None):
        options = check_horovod(devices, compression, communication_options,
                                accumulate_steps)
        if "HOROVOD_RANK" not in os.environ:
            _refuse_a_tf_config_job(os.environ)
            logger.info("HorovodStrategy: not started by horovodrun (HOROVOD_RANK is not "
                        "set), so this process is the only rank (replicas: its devices).")
        self.commit_every_steps = 1
        self.startup_timeout = DEFAULT_STARTUP_TIMEOUT
        self.collective_timeout = None
        self.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT
        self.cluster = None  # horovodrun, not a TF cluster, connects the processes
        self.engine = "horovod"
        comm.init()  # this rank's GPU is chosen by Horovod's local rank
        setup = self._engine_setup(options, task_name=f"worker-{comm.rank()}",
                                   devices=tuple(rank_devices(devices)))
        self._start_engine(engine_class(self.engine)(setup), None, options)

    def _init_communication(self, options):
        """Every batch all-reduce, a replica's ``all_reduce`` too, goes through the
        communicator (over Horovod's ops): compressed and counted."""
        self._init_sync_gradients(options, cross_device_ops=self.extended.horovod_ops)
        self.extended.reduce_through(self.communicator)

    @property
    def cluster_resolver(self):
        """None: Horovod, not a TF cluster, connects the processes."""
        return None

    @property
    def compression(self):
        return self.communicator.compression

    def broadcast_variables(self, variables, root_rank: int = 0) -> None:
        """Sets ``variables`` (e.g. ``model.variables``) to ``root_rank``'s values.

        Use it after changing weights on one rank only, e.g. loading a checkpoint on
        rank 0. Every rank must call it with the same variables.
        """
        comm.broadcast_variables(variables, root_rank=root_rank)
