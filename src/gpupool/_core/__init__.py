"""The pure core: numbers in, decisions out.

Nothing in this package reads a device, a file, the clock or the
environment; ``tests/test_layering.py`` enforces it. Everything that asks
the world for a number lives in :mod:`gpupool._sensors` or is passed in.
Its modules are imported by name (``from gpupool._core.policy import Policy``):
a worker imports the few it needs, not the planner's.
"""
