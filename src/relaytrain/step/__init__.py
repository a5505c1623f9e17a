"""What a training step computes with, below every strategy: optimizers, flat storage, precision, eval tallies, throughput."""
