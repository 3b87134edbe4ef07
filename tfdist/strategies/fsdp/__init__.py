"""Fully sharded parameters (ZeRO-3 / FSDP)."""
