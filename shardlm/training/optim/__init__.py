"""The optimizers of train.optimizer on FSDP2's shards and the update each step takes: `optimizers` (names, checks,
groups, build, the header line, state bytes), `adamw` (AdamW on local shards), `muon`, `variants` (Adafactor, 8-bit
AdamW, schedule-free AdamW), `base` (the step protocol; a resume keeps this run's implementation) and `update`
(gradient norm, clipping, the sync-free step)."""
