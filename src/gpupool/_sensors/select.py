"""Which sensor reads this process's world: the simulator if installed, else NVML (I/O edge)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gpupool._sensors import base
from gpupool._sensors.simulated_state import SIMULATOR_ENV

if TYPE_CHECKING:
    from gpupool._sensors.base import Sensor

__all__ = ["SIMULATOR_ENV", "default_sensor", "read_simulator_ledger"]


def read_simulator_ledger() -> str | None:
    """The ledger path of the simulated host this process is in, or ``None`` (the one reading
    of :data:`SIMULATOR_ENV`)."""
    return os.environ.get(SIMULATOR_ENV)


def default_sensor() -> Sensor:
    """The simulator's sensor inside a ``SimulatedHost`` block, NVML everywhere else."""
    ledger = read_simulator_ledger()
    if ledger:
        from gpupool._sensors.simulated_sensor import simulated_sensor

        return simulated_sensor(ledger)
    from gpupool._sensors.nvml import NvmlSensor

    return NvmlSensor()


base.DEFAULT_WORKER_FACTORY = default_sensor
