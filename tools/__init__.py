"""What never runs in a training job on real data: tiny checkpoints, the synthetic set, the run report."""
