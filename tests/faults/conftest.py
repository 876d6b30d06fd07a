"""Fixtures for the fault-injection suite: a leak guard, and the process-lifetime warm-up."""

from __future__ import annotations

import faulty
import pytest
from leakguard import LeakGuard

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


@pytest.fixture(scope="session")
def _process_lifetime_resources() -> None:
    """Run one pool, so loky's and multiprocessing's resource trackers exist before counting."""
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
            assert ex.submit(faulty.square, 3).result(timeout=60) == 9


@pytest.fixture
def guard(_process_lifetime_resources: None) -> LeakGuard:
    """A leak guard armed now: before the test's host and pool exist."""
    return LeakGuard()
