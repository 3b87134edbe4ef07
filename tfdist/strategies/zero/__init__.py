"""Sharded optimizer state (ZeRO-1/2): its buckets, sparse gradients and saved layout."""
