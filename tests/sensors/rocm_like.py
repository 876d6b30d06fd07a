"""A second vendor, defined in the test suite: a "ROCm-like" sensor over a simulated host.

It reads the simulator's ledger, but speaks a vendor of its own: its cards are
named ``HIP-<n>``, a process sees the cards ``HIP_VISIBLE_DEVICES`` lists (indexes
or those names), and a worker is pinned by ``HIP_VISIBLE_DEVICES=<name>``. Nothing
in ``src/`` names it: a pool takes it as ``sensor=``, which is its one registration.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence

from gpupool._core.census import HostCensus
from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading, Sensor
from gpupool._sensors.simulated_sensor import SimulatedSensor
from gpupool.testing import hold

VISIBLE_ENV = "HIP_VISIBLE_DEVICES"


def card_name(index: int) -> str:
    """This vendor's name of card ``index`` (what workers are pinned by)."""
    return f"HIP-{index:04d}"


class RocmLikeSensor(Sensor):
    """The simulator's cards, read through a vendor whose runtime is not CUDA's.

    Args:
        ledger_path: the simulated host's ledger (``SimulatedHost.ledger_path``).
    """

    name = "rocm-like"
    visible_devices_env = VISIBLE_ENV

    def __init__(self, ledger_path: str) -> None:
        self._ledger_path = ledger_path
        self._inner = SimulatedSensor(ledger_path)

    # -- the vendor's facts ----------------------------------------------------------------

    def parse_visible_devices(
        self, value: str | None, listed: Sequence[DeviceInfo]
    ) -> tuple[tuple[DeviceInfo, ...], str | None]:
        """Indexes or ``HIP-`` names, comma-separated; an unknown entry hides the rest."""
        if value is None:
            return tuple(listed), None
        chosen: list[DeviceInfo] = []
        for entry in filter(None, (part.strip() for part in value.split(","))):
            found = [d for d in listed if entry in (str(d.index), d.uuid)]
            if not found:
                return tuple(chosen), f"{VISIBLE_ENV} entry {entry!r} matches no device"
            chosen.extend(d for d in found if d not in chosen)
        return tuple(chosen), None if chosen else f"{VISIBLE_ENV}={value!r} hides every device"

    def worker_env(self, device: DeviceInfo | None) -> dict[str, str]:
        """``HIP_VISIBLE_DEVICES=<name>``: this vendor's pinning, and nothing of CUDA's."""
        return {} if device is None else {VISIBLE_ENV: device.uuid}

    def worker_factory(self) -> Callable[[], Sensor]:
        """This sensor again, on the same ledger, in a worker."""
        return functools.partial(RocmLikeSensor, self._ledger_path)

    @property
    def bookings_directory(self) -> str | None:
        """The simulated host's table: these are its cards."""
        return self._inner.bookings_directory

    # -- readings: the simulator's, under this vendor's names ------------------------------

    def read_devices(self) -> tuple[DeviceInfo, ...]:
        return tuple(
            DeviceInfo(index=d.index, uuid=card_name(d.index), name="Radeon-like")
            for d in self._inner.read_devices()
        )

    def read_memory(self, device: DeviceInfo) -> MemoryReading:
        return self._inner.read_memory(device)

    def read_processes(self, device: DeviceInfo) -> tuple[ProcessReading, ...] | None:
        return self._inner.read_processes(device)

    def read_process_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        return self._inner.read_process_peak_bytes(device, pid)

    def reset_process_peak(self, device: DeviceInfo, pid: int) -> None:
        self._inner.reset_process_peak(device, pid)

    def start_tree_window(self, device: DeviceInfo, pid: int) -> int | None:
        return self._inner.start_tree_window(device, pid)

    def read_tree_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        return self._inner.read_tree_peak_bytes(device, pid)

    def read_host(self) -> HostCensus:
        return self._inner.read_host()


def pinned_task(i: int, size: str, ledger_path: str) -> tuple[int, dict[str, str | None]]:
    """Hold ``size`` on the card this worker is pinned to by this vendor's variable; say what
    pinned it (the variables a CUDA pinning would set too)."""
    pinned = os.environ[VISIBLE_ENV]
    (device,) = [d for d in RocmLikeSensor(ledger_path).read_devices() if d.uuid == pinned]
    with hold(size, device=device.index):
        time.sleep(0.05)
    seen = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    return i, {name: os.environ.get(name) for name in seen}
