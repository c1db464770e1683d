"""A training run: its lifecycle (Run), the micro-batch loop, checkpoints, flags, metrics logging, output directory,
DeepSpeed configs."""
