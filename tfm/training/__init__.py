"""The training system: experiment setup, the pure train step and its loop, evaluation,
checkpoints, optimizers, losses, metrics and FLOP counts."""
