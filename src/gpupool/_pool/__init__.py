"""The process layer: the dispatcher thread, the workers and how they start."""
