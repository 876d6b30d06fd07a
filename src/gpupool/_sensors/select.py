"""Which sensor reads this process's world: the simulator if installed, else NVML (I/O edge)."""

from __future__ import annotations

import os

from gpupool._sensors.base import Sensor

__all__ = ["SIMULATOR_ENV", "default_sensor"]

#: Set by :class:`gpupool.testing.SimulatedHost` to its ledger's path; the
#: pool passes it on to children, so parent and children read one simulated host.
SIMULATOR_ENV = "GPUPOOL_SIMULATOR"


def default_sensor() -> Sensor:
    """The simulator's sensor inside a ``SimulatedHost`` block, NVML everywhere else."""
    ledger = os.environ.get(SIMULATOR_ENV)
    if ledger:
        from gpupool._sensors.simulated_sensor import SimulatedSensor

        return SimulatedSensor(ledger)
    from gpupool._sensors.nvml import NvmlSensor

    return NvmlSensor()
