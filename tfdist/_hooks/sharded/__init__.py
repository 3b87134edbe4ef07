"""Hooks for Keras variables that a partitioner split into shards (parameter servers).

- ``parts``: a sharded variable's shards, its optimizer slots and a shard's gradient rows.
- ``gradients``: ``GradientTape.gradient`` joins the shards' gradients.
- ``embedding``: ``Embedding`` looks ids up on the ps that holds each row.
- ``initialization``: a shard's initial rows drawn alone, on its ps.
- ``optimizer_state``: slots sharded like their variable, updated shard by shard.
- ``row_blocks``: a large shard's update on blocks of rows (``UPDATE_BLOCK_BYTES``).
- ``saving``: Keras saving and ``tf.train.Checkpoint`` for sharded variables.

Tested in ``tests/test_hooks_sharded.py``. Import the module you need; nothing is
re-exported here.
"""
