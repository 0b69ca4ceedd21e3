"""Training runs: assembly, trainer, reference, profiler, checkpoints, export, launcher and signals."""
