"""The simulated host keeps a process tree's exact high-water: a child's bytes are its parent's."""

from __future__ import annotations

import os
import subprocess
import sys

from gpupool._core.units import GiB, MiB
from gpupool._sensors.base import DeviceInfo
from gpupool.testing import SimulatedDevice, SimulatedHost, hold

#: Hold argv[1] on the simulated card (found through the inherited environment), then exit.
_CHILD = "import sys\nfrom gpupool.testing import hold\nwith hold(sys.argv[1]):\n    pass\n"


def test_a_childs_allocation_raises_its_parents_tree_window():
    """A child that held 2 GiB and exited leaves 2 GiB + its context in the parent's window."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        sensor = host.sensor()
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        with hold("1GiB"):
            assert sensor.start_tree_window(info, os.getpid()) == GiB + 300 * MiB
        subprocess.run([sys.executable, "-c", _CHILD, "2GiB"], check=True)
        assert sensor.read_tree_peak_bytes(info, os.getpid()) == 2 * GiB + 600 * MiB
        # This process is in its parent's tree: that window opens at this context.
        assert sensor.start_tree_window(info, os.getppid()) == 300 * MiB
        assert sensor.read_tree_peak_bytes(info, 12345678) is None


def test_without_a_window_the_sensor_says_it_keeps_none():
    """A root whose window was never opened has no tree peak (``None``), not 0."""
    with SimulatedHost([SimulatedDevice("16GiB")]) as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        assert host.sensor().read_tree_peak_bytes(info, os.getpid()) is None
