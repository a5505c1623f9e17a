"""The meta device: simulated device memory and autocast for a run that does no arithmetic."""
