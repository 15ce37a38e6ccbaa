"""Training: build a run in the design's order, the Trainer loop, its schedule and reporting."""
