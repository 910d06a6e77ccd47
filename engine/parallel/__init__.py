"""Tensor parallelism: one model across the GPUs (or CPU processes) of one engine."""
