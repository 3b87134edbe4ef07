"""A strategy's own ``extended`` and cross-device ops over TF's private extension points.

Why: TF has no public base class for a strategy's ``extended``: the Horovod engine
(`tfdist.engines.horovod.extended`) extends ``MirroredExtended`` (local replicas as in
MirroredStrategy) and reroutes its replica ids, variable creation, reductions, gathers
and input sharding, which TF reaches only through private methods. The classes here map
each private method TF calls to a public-named one the subclass implements, and give
the private state it reads (the local devices, the container strategy, tf.keras' task
attributes) public names. ``tests/test_hooks_extended.py`` fails loudly when a TF
upgrade removes one of them.
"""

from __future__ import annotations

import functools


@functools.cache
def own_extended_class():
    """``MirroredExtended`` whose private extension points call public-named methods.

    A subclass implements ``replicas_in_sync()``, ``multi_worker_mode()``,
    ``replica_id_in_sync_group(local_id)``, ``local_replica_id(global_id)``,
    ``own_cross_device_ops()``, ``reduce_to_destinations(...)``,
    ``batch_reduce_to_destinations(...)``, ``gather_to_destinations(...)``,
    ``distribute_dataset(dataset, options)`` and ``input_context()``; it may override
    ``create_variable(next_creator, **kwargs)`` (default: TF's).
    """
    from tensorflow.python.distribute import distribute_utils, input_util, mirrored_strategy
    from tensorflow.python.distribute import multi_worker_util

    import tensorflow as tf

    class OwnExtended(mirrored_strategy.MirroredExtended):
        # ---- what the subclass reads ---------------------------------------------
        @property
        def local_devices(self) -> tuple:
            """This process's replica devices (TF's ``_devices``)."""
            return self._devices

        @property
        def container_strategy(self):
            """The strategy this extended belongs to."""
            return self._container_strategy()

        @property
        def is_chief_task(self) -> bool:
            return self._is_chief

        def set_chief(self, is_chief: bool) -> None:
            self._is_chief = is_chief

        def set_task_attributes(self, resolver, rank: int, size: int) -> None:
            """Sets what stock code reads of TF's multi-worker ``extended``.

            Why: TF's tutorials read ``strategy.cluster_resolver`` and tf.keras' write
            path rule reads the private ``_task_type``/``_task_id``; they are set as
            ``CollectiveAllReduceExtended`` sets them. Without a cluster in
            ``resolver``, this process is ``worker-<rank>`` of ``size`` and rank 0 is
            the chief.
            """
            self._cluster_resolver = resolver
            spec = resolver.cluster_spec() if resolver is not None else None
            if spec is None or not spec.as_dict():
                self._cluster_spec = None
                self._task_type = "worker" if size > 1 else None
                self._task_id = rank if size > 1 else None
                self._num_workers = size
                self._is_chief = rank == 0
                return
            self._cluster_spec = multi_worker_util.normalize_cluster_spec(spec)
            self._task_type, self._task_id = resolver.task_type, resolver.task_id
            self._num_workers = multi_worker_util.worker_count(self._cluster_spec,
                                                               self._task_type)
            self._is_chief = multi_worker_util.is_chief(self._cluster_spec, self._task_type,
                                                        self._task_id)

        def stock_create_variable(self, next_creator, **kwargs):
            return super()._create_variable(next_creator, **kwargs)

        def create_variable(self, next_creator, **kwargs):
            return self.stock_create_variable(next_creator, **kwargs)

        def stock_distribute_dataset(self, dataset, options):
            return input_util.get_distributed_dataset(
                dataset, self._input_workers_with_options(options), self._container_strategy(),
                num_replicas_in_sync=self.replicas_in_sync(),
                input_context=self.input_context(), options=options)

        # ---- TF's private extension points ----------------------------------------
        @property
        def _num_replicas_in_sync(self):
            return self.replicas_in_sync()

        def _in_multi_worker_mode(self):
            return self.multi_worker_mode()

        @property
        def experimental_between_graph(self):
            return True

        def _get_replica_id_in_sync_group(self, replica_id):
            return self.replica_id_in_sync_group(replica_id)

        def _get_local_replica_id(self, replica_id_in_sync_group):
            return self.local_replica_id(replica_id_in_sync_group)

        def _use_merge_call(self):
            # Always merge: reductions must go through the own cross-device ops.
            return True

        @property
        def should_checkpoint(self):
            return self._is_chief

        @property
        def should_save_summary(self):
            return self._is_chief

        def _create_variable(self, next_creator, **kwargs):
            return self.create_variable(next_creator, **kwargs)

        def _get_cross_device_ops(self, value):
            return self.own_cross_device_ops()

        def _reduce_to(self, reduce_op, value, destinations, options):
            return self.reduce_to_destinations(reduce_op, value, destinations, options)

        def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
            return self.batch_reduce_to_destinations(reduce_op, value_destination_pairs,
                                                     options)

        def _gather_to_implementation(self, value, destinations, axis, options):
            return self.gather_to_destinations(value, destinations, axis, options)

        def _experimental_distribute_dataset(self, dataset, options):
            return self.distribute_dataset(dataset, options)

        def _distribute_datasets_from_function(self, dataset_fn, options):
            return input_util.get_distributed_datasets_from_function(
                dataset_fn=dataset_fn,
                input_workers=self._input_workers_with_options(options),
                input_contexts=[self.input_context()], strategy=self._container_strategy(),
                options=options)

        def _experimental_distribute_values_from_function(self, value_fn):
            local = len(self._devices)
            first = self.replica_id_in_sync_group(0)
            values = [value_fn(tf.distribute.experimental.ValueContext(
                          first + i, self.replicas_in_sync())) for i in range(local)]
            return distribute_utils.regroup(values, always_wrap=True)

    return OwnExtended


@functools.cache
def own_cross_device_ops_class():
    """``tf.distribute.CrossDeviceOps`` that counts the processes holding values.

    Why: TF's base skips a reduction when ``_num_between_graph_workers`` is 1 and a
    process has one replica, though the other processes still hold values; and
    broadcasts read its private ``_canonicalize_devices``. A subclass implements
    ``processes()``.
    """
    import tensorflow as tf

    class OwnCrossDeviceOps(tf.distribute.CrossDeviceOps):
        @property
        def _num_between_graph_workers(self):
            return self.processes()

        @property
        def canonicalize_devices(self) -> bool:
            return self._canonicalize_devices

    return OwnCrossDeviceOps
