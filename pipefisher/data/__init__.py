"""Data sources that yield micro-batches deterministically."""
