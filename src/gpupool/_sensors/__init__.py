"""The I/O edge: the only code that imports pynvml or psutil or reads /proc and /sys.

Everything that reads a device goes through :class:`~gpupool._sensors.base.Sensor`,
so the pool, the CLI and the probe run unchanged on NVML, unified memory or
the simulator.
"""
