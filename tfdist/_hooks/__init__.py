"""Every private TensorFlow / Keras access tfdist relies on, one job per module.

Each hook says why it is needed ("Why:"), and a test in ``tests/test_hooks*.py`` fails
loudly when a TF or Keras upgrade removes what it touches. Modules elsewhere call these
functions instead of reaching into private names themselves. Nothing is re-exported
here: import the module you need.

- ``tf``: TF distribute internals (collective key ranges, the multi-worker extended
  class and its variable creation, multi-worker mode, a local replica's global id,
  the coordination service, the helpers of a custom ``extended``, a dataset's
  batch size, functions kept out of line). Tests: ``test_hooks_tf.py``.
- ``extended``: a strategy's own ``extended`` and cross-device ops (the Horovod
  engine's) over TF's private extension points, mapped to public-named methods.
  Tests: ``test_hooks_extended.py``.
- ``keras``: the patches that install the Keras hand-off (`tfdist.keras.handoff`):
  the optimizer step, ``keras.Model``'s methods, the loss-scale check, atomic updates.
  Tests: ``test_hooks.py``.
- ``keras_optimizer``: private members of Keras' optimizer step that tfdist calls.
- ``keras_steps``: a train step's loss/metric outputs kept on this worker (no per-step
  reduce across workers). Tests: ``test_hooks_steps.py``.
- ``keras_trainer``: private members of ``keras.Model``'s trainer that tfdist calls.
- ``keras_callbacks``: Keras' ``ModelCheckpoint``/``BackupAndRestore`` private save
  and restore points as public methods. Tests: ``test_hooks_callbacks.py``.
- ``horovod_kv``: the values of Horovod's rendezvous handler.
  Tests: ``test_hooks_horovod_kv.py``.
- ``horovod_gloo``: a path in the address Horovod's Gloo HTTP store is given (its
  requests then come under a formation's path). Tests: ``test_hooks_horovod_gloo.py``.
- ``saves``: atomic saves refusing NaN weights; Keras' file callbacks writing elsewhere
  on non-chief workers. Tests: ``test_hooks_saves.py``.
- ``coordinator``: ``ClusterCoordinator`` per-worker iterators, closures pinned to a
  worker, deadlines. Tests: ``test_hooks_coordinator.py``.
- ``sharded``: variables a partitioner split into shards (gradients, embedding lookup,
  shard-sized initialization, optimizer state and row blocks, saving).
  Tests: ``test_hooks_sharded.py``.
- ``keras_distribution``: ``keras.distribution`` on the TF backend (its backend
  functions, ``set_distribution``, ``Distribution.distribute_dataset``, the TF variable's
  layout at creation) calling `tfdist.keras.distribution`; installed by ``import tfdist``.
  Tests: ``test_hooks_keras_distribution.py``.
- ``zero``: sharded optimizer state (plain per-replica variables under a strategy,
  Keras' weight-decay rule, TF's collective reduce-scatter). Tests: ``test_hooks_zero.py``.

These modules import nothing above them (only tfdist's bottom row: cluster, files, ...):
the Keras hand-off passes itself in. ``tests/test_layout.py`` checks that no module
outside this package touches TF/Keras internals (``python scripts/private_access.py``
counts what is left).
"""
