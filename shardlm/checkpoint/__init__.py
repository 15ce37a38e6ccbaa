"""Checkpoints: the run folder's layout, the stateful parts, the Checkpointer, provenance checks."""
