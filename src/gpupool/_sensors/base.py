"""The one sensor interface that the pool, the CLI, the probe and the simulator share (I/O edge).

A sensor answers with a number, with ``None`` for a term documented as
optional (the driver does not give it), or raises one of gpupool's own
errors: :class:`~gpupool.NoDriverError` when there is no driver at all,
:class:`~gpupool.DeviceUnreadableError` when a driver is present but the
reading failed. Backend errors (``pynvml.NVMLError_*``) are mapped to these
once, inside each sensor, and never escape it.

A sensor also carries its vendor's facts, so nothing else names a vendor: the
variable that hides devices and its grammar, the variables that pin a worker to
a card, and a picklable factory of the worker's own sensor (the pool passes it
to each worker). The defaults are CUDA's (:mod:`gpupool._sensors.cuda`); another
vendor's sensor overrides them, and a pool takes it as ``sensor=``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gpupool._sensors import cuda
from gpupool._sensors.readings import DeviceInfo, MemoryReading, ProcessReading

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpupool._core.census import HostCensus

__all__ = ["DEFAULT_WORKER_FACTORY", "DeviceInfo", "MemoryReading", "ProcessReading", "Sensor"]

#: :meth:`Sensor.worker_factory`'s default, set by :mod:`gpupool._sensors.select`.
DEFAULT_WORKER_FACTORY: Callable[[], Sensor] | None = None


class Sensor:
    """Base class of every sensor: NVML, the simulator, or none.

    Subclasses implement :meth:`read_devices`, :meth:`read_memory` and
    :meth:`read_host`; the per-process methods default to "the driver does
    not say" (``None``).
    """

    #: Short name recorded as the source of every figure.
    name: str = "sensor"

    #: The variable through which this vendor's runtime hides devices from a process.
    visible_devices_env: str = cuda.VISIBLE_DEVICES_ENV

    def read_visible_devices(self) -> str | None:
        """This process's ``visible_devices_env`` (``None``: unset, every device is visible)."""
        return os.environ.get(self.visible_devices_env)

    def parse_visible_devices(
        self, value: str | None, listed: Sequence[DeviceInfo]
    ) -> tuple[tuple[DeviceInfo, ...], str | None]:
        """Narrow ``listed`` to what ``value`` of ``visible_devices_env`` lets a process see,
        with a note for the census (as ``gpupool._sensors.cuda.parse_visible_devices``, the
        default, with this process's ``CUDA_DEVICE_ORDER``, returns and raises)."""
        order = os.environ.get(cuda.DEVICE_ORDER_ENV)
        return cuda.parse_visible_devices(value, listed, device_order=order)

    def worker_env(self, device: DeviceInfo | None) -> dict[str, str]:
        """The variables a worker starts with, pinning it to ``device`` (``None``: a pool without
        cards); CUDA's are ``CUDA_VISIBLE_DEVICES=<uuid>``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``."""
        return {} if device is None else cuda.pin_env(device)

    def worker_factory(self) -> Callable[[], Sensor]:
        """What a worker calls once, at start, for its probe's sensor: picklable.

        The default, ``gpupool._sensors.select.default_sensor`` (NVML, or the simulator
        inside a ``SimulatedHost`` block), also serves a sensor wrapping one of those;
        another vendor's sensor returns its own class, or a partial of it. The default is
        registered by ``select`` as it is imported (every pool imports it), so that the
        base imports no sensor of its own: theirs import the base.
        """
        if DEFAULT_WORKER_FACTORY is None:
            raise RuntimeError("no default sensor is registered: import gpupool._sensors.select")
        return DEFAULT_WORKER_FACTORY

    @property
    def bookings_directory(self) -> str | None:
        """Where pools on this sensor's cards book them, or ``None`` for the host's table."""
        return None

    def read_devices(self) -> tuple[DeviceInfo, ...]:
        """Every device the driver lists (MIG instances as devices of their own).

        Raises:
            NoDriverError: no NVIDIA driver or library on this host.
            SensorError: a driver is present but the list could not be read.
        """
        raise NotImplementedError

    def read_memory(self, device: DeviceInfo) -> MemoryReading:
        """The device's total, free, used and reserved bytes now.

        Raises:
            DeviceUnreadableError: the reading failed.
        """
        raise NotImplementedError

    def read_processes(self, device: DeviceInfo) -> tuple[ProcessReading, ...] | None:
        """Per-process device bytes (compute and graphics, de-duplicated by PID).

        Returns ``None`` when the driver does not give them.
        """
        return None

    def read_snapshot(
        self, device: DeviceInfo
    ) -> tuple[MemoryReading, tuple[ProcessReading, ...] | None]:
        """The device's memory and its per-process rows, as close together as the driver allows.

        The live gate prices a card from both: read apart, a task that ends
        between the two readings counts twice. Sensors that can take both in
        one step (the simulator's ledger) override it; NVML answers each in
        microseconds, back to back.
        """
        memory = self.read_memory(device)
        return memory, self.read_processes(device)

    def read_process_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """One process's device bytes now, or ``None`` when its row cannot be found."""
        rows = self.read_processes(device)
        if rows is None:
            return None
        for row in rows:
            if row.pid == pid:
                return row.used_bytes
        return None

    def read_process_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """The process's exact device high-water since :meth:`reset_process_peak`.

        ``None`` where the sensor cannot tell (the probe then samples).
        """
        return None

    def read_process_max_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """The driver's own maximum of ``pid``'s device bytes over the process's life.

        ``None`` where the driver keeps none (the default). It cannot be reset,
        so the probe uses it for a task only when it rose during that task.
        """
        return None

    def reset_process_peak(self, device: DeviceInfo, pid: int) -> None:
        """Start a new high-water window for ``pid`` (a no-op where unsupported)."""
        return None

    def start_peak_window(self, device: DeviceInfo, pid: int) -> int | None:
        """:meth:`reset_process_peak`, then :meth:`read_process_bytes` (the window's baseline).

        Sensors that can do both in one step override it.
        """
        self.reset_process_peak(device, pid)
        return self.read_process_bytes(device, pid)

    def start_tree_window(self, device: DeviceInfo, pid: int) -> int | None:
        """Open an exact high-water window over ``pid`` and every process under it.

        Returns what the tree holds now; ``None`` where the sensor keeps no
        such window (the default: the probe then samples the tree's rows).
        """
        return None

    def read_tree_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """The most ``pid``'s tree held together since :meth:`start_tree_window`, or ``None``."""
        return None

    def read_refused_bytes(self, device: DeviceInfo, pid: int, since_s: float) -> int | None:
        """The largest allocation ``device`` refused to ``pid`` or a process under it since
        ``since_s`` (``time.time()``), 0 where it refused none; ``None`` where the driver keeps
        no such record (NVML: a card that was full shows only in its free bytes)."""
        return None

    def read_host(self) -> HostCensus:
        """Usable CPUs and available RAM."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the sensor holds (NVML's handle). Idempotent."""
        return None


Sensor.__module__ = "gpupool"  # public as gpupool.Sensor
