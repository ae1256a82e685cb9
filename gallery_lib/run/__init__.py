"""The run: the training loop, the launcher, checkpoints, metrics, timing and logs."""
