"""How tensors move: communicators, byte accounting, compression, averaging, liveness."""
