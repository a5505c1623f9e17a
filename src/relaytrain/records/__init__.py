"""What a run leaves: checkpoints, metrics.csv and status.json, trackers, the display, the exported model."""
