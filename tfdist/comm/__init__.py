"""How tensors move: byte accounting, compression, and the Horovod engine."""
