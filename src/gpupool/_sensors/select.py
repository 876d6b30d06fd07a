"""Which sensor reads this process's world: the simulator if installed, else NVML (I/O edge)."""

from __future__ import annotations

import os

from gpupool._sensors.base import Sensor

__all__ = ["SIMULATOR_ENV", "default_sensor", "read_simulator_ledger"]

#: Set by :class:`gpupool.testing.SimulatedHost` to its ledger's path, for the
#: processes started inside its block (a pool's workers get it from the
#: simulator's sensor, :meth:`SimulatedSensor.worker_env`).
SIMULATOR_ENV = "GPUPOOL_SIMULATOR"


def read_simulator_ledger() -> str | None:
    """The ledger path of the simulated host this process is in, or ``None`` (the one reading
    of :data:`SIMULATOR_ENV`)."""
    return os.environ.get(SIMULATOR_ENV)


def default_sensor() -> Sensor:
    """The simulator's sensor inside a ``SimulatedHost`` block, NVML everywhere else."""
    ledger = read_simulator_ledger()
    if ledger:
        from gpupool._sensors.simulated_sensor import SimulatedSensor

        return SimulatedSensor(ledger)
    from gpupool._sensors.nvml import NvmlSensor

    return NvmlSensor()
