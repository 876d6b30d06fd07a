"""The command line (``gpupool ...``, ``python -m gpupool``): the only package that prints."""
