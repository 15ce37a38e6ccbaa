"""Checkpoints: the run folder's layout, the stateful parts, the Checkpointer, provenance checks."""

import warnings

# One process without a process group saves and loads through the same DCP path (training, and eval, export and
# generate reading a checkpoint); DCP warns about it each time, with nothing a user can act on.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torch 2.9's DCP writer
