"""Processes and sharding: the process group, FSDP2 parallelize, full-state gathers, XLA, torchrun."""
