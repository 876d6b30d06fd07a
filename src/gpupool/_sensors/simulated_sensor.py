"""The simulated host's sensor: its ledger read as a driver reads a card (I/O edge).

:class:`SimulatedSensor` is what :func:`~gpupool._sensors.select.default_sensor`
returns inside a :class:`gpupool.testing.SimulatedHost` block; it reads the
host's ledger (:class:`~gpupool._sensors.simulated.Ledger`) through this
process's one :class:`~gpupool._sensors.simulated.Ledger` for its path.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from gpupool._errors import DeviceUnreadableError, NoDriverError
from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading, Sensor
from gpupool._sensors.simulated import (
    BOOKINGS_DIRECTORY,
    DEVICE_NAME,
    ledger_at,
)
from gpupool._sensors.simulated_state import (
    SIMULATOR_ENV,
    DeviceState,
    LedgerState,
    Snapshot,
    device_of,
    is_mig,
    memory_of,
    rows_mode,
    rows_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpupool._core.census import HostCensus

__all__ = ["HiddenRowsSensor", "SimulatedSensor", "simulated_sensor"]


class SimulatedSensor(Sensor):
    """The sensor of a simulated host: reads its ledger as NVML would read a card.

    It is what :func:`~gpupool._sensors.select.default_sensor` returns inside a
    :class:`gpupool.testing.SimulatedHost` block (on the ledger ``GPUPOOL_SIMULATOR``
    names), in the parent and in every child.
    """

    name = "simulator"

    def __init__(self, ledger_path: str) -> None:
        self._ledger = ledger_at(ledger_path)
        # One device's memory and rows, and the shared reading (the very object) and device
        # index they were made from: read again from an unchanged ledger, they are reused.
        self._made: tuple[LedgerState | None, int, Snapshot] | None = None

    @property
    def ledger_path(self) -> str:
        """The ledger this sensor reads."""
        return self._ledger.path

    @property
    def bookings_directory(self) -> str:
        """The simulated host's booking table: beside its ledger, shared by its processes only."""
        return os.path.join(os.path.dirname(self._ledger.path), BOOKINGS_DIRECTORY)

    def worker_env(self, device: DeviceInfo | None) -> dict[str, str]:
        """CUDA's pinning, and the ledger for what a task runs (``gpupool.testing.hold``)."""
        return {**super().worker_env(device), SIMULATOR_ENV: self._ledger.path}

    def worker_factory(self) -> Callable[[], Sensor]:
        """A sensor on this ledger, whatever the worker's environment says."""
        return functools.partial(simulated_sensor, self._ledger.path)

    def _view(self) -> LedgerState:
        """The ledger's state, as a driver answers: not at all on a host without one."""
        state = self._ledger.view()
        if not state["driver"]:
            raise NoDriverError("the simulated host has no driver (SimulatedHost(driver=False))")
        return state

    def _state_of(self, device: DeviceInfo) -> DeviceState:
        return device_of(self._view(), device.index)

    def read_devices(self) -> tuple[DeviceInfo, ...]:
        """Every simulated device, named ``"Simulated GPU"``.

        Raises:
            NoDriverError: the host was made with ``driver=False``.
        """
        state = self._view()
        return tuple(
            DeviceInfo(
                index=index,
                uuid=dev["uuid"],
                name=DEVICE_NAME,
                mig=is_mig(dev),
                mig_index=0 if is_mig(dev) else None,
            )
            for index, dev in enumerate(state["devices"])
        )

    def read_memory(self, device: DeviceInfo) -> MemoryReading:
        """Total, free and used bytes from the ledger (as ``/proc/meminfo`` for unified devices).

        Raises:
            DeviceUnreadableError: the device was made with ``readable=False``.
            NoDriverError: the host was made with ``driver=False``.
        """
        return self._snapshot_of(self._view(), device)[0]

    def read_processes(self, device: DeviceInfo) -> tuple[ProcessReading, ...] | None:
        """Co-tenant rows (fake PIDs) and, unless the host is a container, real processes' rows.

        A co-tenant that has shrunk to 0 bytes has left the card and is not
        listed. ``None`` for an unreadable device.
        """
        state = self._view()
        if not device_of(state, device.index)["readable"]:
            return None
        return self._snapshot_of(state, device)[1]

    def read_snapshot(
        self, device: DeviceInfo
    ) -> tuple[MemoryReading, tuple[ProcessReading, ...] | None]:
        """Memory and rows from one ledger snapshot: both describe the same instant.

        While the ledger holds the same bytes (and no process it names has exited),
        the reading made from it last is given again, not made anew.
        """
        return self._snapshot_of(self._view(), device)

    def _snapshot_of(self, state: LedgerState, device: DeviceInfo) -> Snapshot:
        """``device``'s memory and rows in the shared reading ``state`` (made once per reading)."""
        made = self._made
        if made is not None and made[0] is state and made[1] == device.index:
            return made[2]
        dev = device_of(state, device.index)
        snapshot = (memory_of(device, dev), rows_of(state, dev))
        self._made = (state, device.index, snapshot)
        return snapshot

    def read_tree_snapshot(
        self, device: DeviceInfo, pid: int
    ) -> tuple[int | None, MemoryReading | None, tuple[ProcessReading, ...] | None]:
        """:meth:`read_tree_peak_bytes` and :meth:`read_snapshot`, from one ledger reading.

        The memory and rows are ``None`` for an unreadable device (the tree's
        high-water still answers, as :meth:`read_tree_peak_bytes` does).
        """
        state = self._view()
        window = device_of(state, device.index)["trees"].get(str(pid))
        peak = None if window is None else window["window"]
        try:
            memory, rows = self._snapshot_of(state, device)
        except DeviceUnreadableError:
            return peak, None, None
        return peak, memory, rows

    def read_process_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """``pid``'s exact device high-water since :meth:`reset_process_peak` (0: never touched).

        It answers in container mode too: it stands for the process's own
        report of itself (as ``torch.cuda`` statistics would), not a driver row.
        """
        proc = self._state_of(device)["procs"].get(str(pid))
        return 0 if proc is None else proc["window"]

    def reset_process_peak(self, device: DeviceInfo, pid: int) -> None:
        """Start a new high-water window for ``pid`` at its bytes now."""
        self._ledger.reset_window(device.index, pid)

    def start_peak_window(self, device: DeviceInfo, pid: int) -> int | None:
        """Start a new high-water window and return ``pid``'s bytes now, in one ledger step."""
        return self._ledger.reset_window(device.index, pid)

    def start_tree_window(self, device: DeviceInfo, pid: int) -> int | None:
        """Open ``pid``'s tree window and return what its tree holds now, in one ledger step."""
        return self._ledger.open_tree(device.index, pid)

    def read_tree_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """The most ``pid`` and its descendants held together since :meth:`start_tree_window`.

        Exact: the ledger raises the window at every allocation of a process
        of the tree, under its lock. Like :meth:`read_process_peak_bytes` it
        answers in container mode too (a self-report, not a driver row).
        ``None`` when no window of ``pid`` is open.
        """
        window = self._state_of(device)["trees"].get(str(pid))
        return None if window is None else window["window"]

    def read_refused_bytes(self, device: DeviceInfo, pid: int, since_s: float) -> int | None:
        """The largest allocation the simulated card refused to ``pid`` or a process under it
        (by its ancestors when it asked) since ``since_s``; 0 where none. It stands for what a
        real card shows of a refusal (its free bytes, read below a few hundred MiB while the
        refused process held the rest), which a sampled reading may miss."""
        largest = 0
        for record in self._view()["ooms"]:
            if record["device"] != device.index or record["time_s"] < since_s:
                continue
            if record["pid"] == pid or pid in record.get("ancestors", ()):
                largest = max(largest, record["requested_bytes"])
        return largest

    def read_host(self) -> HostCensus:
        """The host's CPUs and RAM as the ``SimulatedHost`` gives them, else the real host's."""
        from gpupool._core.census import HostCensus  # the parent's: a worker never loads it

        state = self._ledger.view()
        cpus, ram = state["cpus"], state["ram"]
        cpu_source = ram_source = "simulator"
        if cpus is None or ram is None:
            # Imported here: the cgroup walk is only needed when a term was left to the host.
            from gpupool._sensors.host import read_host_census

            real = read_host_census()
            if cpus is None:
                cpus, cpu_source = real.cpus, real.cpu_source
            if ram is None:
                ram, ram_source = real.available_ram_bytes, real.ram_source
        return HostCensus(
            cpus=cpus, available_ram_bytes=ram, cpu_source=cpu_source, ram_source=ram_source
        )


class HiddenRowsSensor(SimulatedSensor):
    """A simulated card whose driver does not list this host's processes' bytes.

    As strict as such a card (a container, rows of 0, a MIG instance): no
    process reports its own exact high-water, so the probe samples rows, as it
    does with NVML there, and falls back on the frameworks' counters and the
    estimated context; a task's descendants go unread and its peak is flagged
    incomplete. Every other reading is :class:`SimulatedSensor`'s.
    """

    # The driver's view only: the base sensor's "cannot tell" for every exact window.
    read_process_peak_bytes = Sensor.read_process_peak_bytes
    reset_process_peak = Sensor.reset_process_peak
    start_peak_window = Sensor.start_peak_window
    start_tree_window = Sensor.start_tree_window
    read_tree_peak_bytes = Sensor.read_tree_peak_bytes


def simulated_sensor(ledger_path: str) -> SimulatedSensor:
    """The sensor of the simulated host at ``ledger_path``: :class:`HiddenRowsSensor` where its
    driver does not list this host's processes' bytes (``SimulatedHost(rows=...)``), else
    :class:`SimulatedSensor`."""
    sensor = SimulatedSensor(ledger_path)
    try:
        state = sensor._view()
    except NoDriverError:
        return sensor
    if rows_mode(state) == "listed" and not any(is_mig(dev) for dev in state["devices"]):
        return sensor
    return HiddenRowsSensor(ledger_path)
