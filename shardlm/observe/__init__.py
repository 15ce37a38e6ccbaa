"""What a run reports: metrics files and console progress, trackers (W&B, MLflow), plots."""
