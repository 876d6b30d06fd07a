"""CHILD SIDE: what runs in a worker process around one task (its peak, its tree, its
frameworks), top-level and picklable; it never creates a CUDA context."""
