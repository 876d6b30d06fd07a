"""Child side: the worker's sensor, seen as its process tree's (a worker with a device only).

:func:`tree_sensor` wraps the worker's sensor so that the worker's per-process
bytes are its tree's (:class:`~gpupool._child.probe_tree.TreeWatch` says who is
in it): the rows of every process in the tree, judged by
:func:`~gpupool._core.readings.judge_tree_rows` (implausible rows are rejected,
with the reason kept for the peak report), or, where the sensor keeps one (the
simulator), the tree's exact high-water window. Apart from the watch, so that a
worker without a device never imports a sensor's records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpupool._core.readings import judge_tree_rows
from gpupool._errors import SensorError
from gpupool._sensors.base import Sensor

if TYPE_CHECKING:
    from collections.abc import Collection

    from gpupool._child.probe_tree import TreeWatch
    from gpupool._core.census import HostCensus
    from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading

__all__ = ["TreeSensor", "tree_sensor"]


class TreeSensor(Sensor):
    """The probe's view of the worker's sensor: the worker's bytes are its tree's.

    Asked for the root's per-process bytes, it reads the device's rows (and
    its used bytes, in one snapshot) and sums the rows of every process in the
    tree, where :func:`~gpupool._core.readings.judge_tree_rows` takes them as
    a measurement. Every other question goes to the wrapped sensor.
    """

    #: Whether the tree's high-water is exact (read from the sensor's window), not sampled.
    exact = False

    def __init__(self, inner: Sensor, watch: TreeWatch) -> None:
        self.inner = inner
        self.watch = watch
        self.name = inner.name
        watch.sensor = self
        # The card's used bytes at the last reading judged (``None``: not read, or unified
        # memory, where "used" is the host's): the probe's cross-check of a partial view.
        self.used_bytes: int | None = None
        # Its free bytes and total at that reading (``None`` likewise): whether the card was
        # full during a task (the probe's evidence of an out-of-memory no text named).
        self.free_bytes: int | None = None
        self.total_bytes: int | None = None
        # The last judgement of a reading's rows (the very rows and memory objects, and the
        # tree): a sensor that gives the same objects for an unchanged card (the
        # simulator's) is not judged again for the same tree.
        self._judged: (
            tuple[
                tuple[ProcessReading, ...],
                MemoryReading | None,
                frozenset[int],
                tuple[str, ...],
                tuple[int | None, int | None],
            ]
            | None
        ) = None

    def read_devices(self) -> tuple[DeviceInfo, ...]:
        return self.inner.read_devices()

    def read_memory(self, device: DeviceInfo) -> MemoryReading:
        return self.inner.read_memory(device)

    def read_processes(self, device: DeviceInfo) -> tuple[ProcessReading, ...] | None:
        return self.inner.read_processes(device)

    def read_process_max_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        return self.inner.read_process_max_bytes(device, pid)

    def reset_process_peak(self, device: DeviceInfo, pid: int) -> None:
        self.inner.reset_process_peak(device, pid)

    def read_host(self) -> HostCensus:
        return self.inner.read_host()

    def read_refused_bytes(self, device: DeviceInfo, pid: int, since_s: float) -> int | None:
        return self.inner.read_refused_bytes(device, pid, since_s)

    def close(self) -> None:
        self.inner.close()

    def read_process_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """The tree's bytes for the root (judged rows), any other process's row otherwise."""
        if pid != self.watch.root_pid:
            return self.inner.read_process_bytes(device, pid)
        return self.read_members_bytes(device, self.watch.members())

    def read_root_bytes(
        self, device: DeviceInfo, members: Collection[int] | None = None
    ) -> tuple[int | None, int | None]:
        """The tree's bytes and the root's own row, from one reading of ``device``.

        Either is ``None`` where the reading is not a measurement; the root's
        own figure is also ``None`` where the root has no row. What the root
        holds outside its frameworks (its context) is measured from its own
        row, never from its descendants'. ``members``: the tree as the watch
        just read it (its opening's or its end's reading); read now if ``None``.
        """
        return self._read_members(device, self.watch.members() if members is None else members)

    def read_members_bytes(self, device: DeviceInfo, members: Collection[int]) -> int | None:
        """What ``members`` hold by one reading of ``device``, or ``None`` (reasons kept)."""
        return self._read_members(device, members)[0]

    def read_peak_and_root(
        self, device: DeviceInfo, members: Collection[int]
    ) -> tuple[int | None, int | None, int | None]:
        """The root's exact high-water (:meth:`read_process_peak_bytes`), then the tree's
        bytes and the root's own row (:meth:`read_root_bytes`); ``None`` for a figure
        that cannot be read."""
        try:
            peak = self.read_process_peak_bytes(device, self.watch.root_pid)
        except Exception:
            peak = None
        try:
            tree, own = self.read_root_bytes(device, members)
        except Exception:
            tree, own = None, None
        return peak, tree, own

    def _read_members(
        self, device: DeviceInfo, members: Collection[int]
    ) -> tuple[int | None, int | None]:
        """``members``' bytes and the root's own row by one reading (reasons kept)."""
        memory: MemoryReading | None
        try:
            memory, rows = self.inner.read_snapshot(device)
        except SensorError:
            memory, rows = None, self.inner.read_processes(device)
        return self._judge(memory, rows, members)

    def _judge(
        self,
        memory: MemoryReading | None,
        rows: tuple[ProcessReading, ...] | None,
        members: Collection[int],
    ) -> tuple[int | None, int | None]:
        """``members``' bytes and the root's own row in one reading's rows (reasons kept)."""
        card = memory is not None and not memory.unified
        self.used_bytes = memory.used_bytes if card and memory is not None else None
        self.free_bytes = memory.free_bytes if card and memory is not None else None
        self.total_bytes = memory.total_bytes if card and memory is not None else None
        if rows is None:
            return None, None
        judged = self._judged
        if (
            judged is not None
            and judged[0] is rows
            and judged[1] is memory
            and judged[2] == members
        ):
            reasons, answer = judged[3], judged[4]  # the same reading of the same tree
        else:
            reasons, answer = self._judge_anew(memory, rows, members)
            self._judged = (rows, memory, frozenset(members), reasons, answer)
        if reasons:
            self.watch.note_rejections(reasons)
        return answer

    def _judge_anew(
        self,
        memory: MemoryReading | None,
        rows: tuple[ProcessReading, ...],
        members: Collection[int],
    ) -> tuple[tuple[str, ...], tuple[int | None, int | None]]:
        """Why readings were rejected, and the tree's bytes and the root's own row."""
        # On unified memory "used" is the host's, not a device total to bound rows by.
        used = memory.used_bytes if memory is not None and not memory.unified else None
        verdict = judge_tree_rows(
            [(row.pid, row.used_bytes) for row in rows], members, device_used_bytes=used
        )
        reasons = tuple(verdict.reasons)
        if verdict.tree_bytes is None:
            return reasons, (None, None)
        own = [row.used_bytes for row in rows if row.pid == self.watch.root_pid]
        root_row = own[0] if own and self.watch.root_pid in members else None
        return reasons, (verdict.tree_bytes, root_row)


class _ExactTreeSensor(TreeSensor):
    """A tree view of a sensor that keeps an exact tree high-water (the simulator's ledger)."""

    exact = True

    def start_peak_window(self, device: DeviceInfo, pid: int) -> int | None:
        if pid != self.watch.root_pid:
            return self.inner.start_peak_window(device, pid)
        return self.inner.start_tree_window(device, pid)

    def read_process_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        if pid != self.watch.root_pid:
            return self.inner.read_process_peak_bytes(device, pid)
        return self.inner.read_tree_peak_bytes(device, pid)

    def read_peak_and_root(
        self, device: DeviceInfo, members: Collection[int]
    ) -> tuple[int | None, int | None, int | None]:
        """As :meth:`TreeSensor.read_peak_and_root`, from one reading of ``device`` where the
        sensor gives the tree's high-water and the rows together (``read_tree_snapshot``)."""
        both = getattr(self.inner, "read_tree_snapshot", None)
        if both is None:
            return super().read_peak_and_root(device, members)
        try:
            peak, memory, rows = both(device, self.watch.root_pid)
        except Exception:
            return None, None, None
        return (peak, *self._judge(memory, rows, members))


def tree_sensor(inner: Sensor, watch: TreeWatch) -> TreeSensor:
    """``inner`` seen as ``watch``'s tree: exact where ``inner`` keeps tree windows (it
    overrides :meth:`~gpupool._sensors.base.Sensor.read_tree_peak_bytes`), else sampled;
    the probe reads which from :attr:`TreeSensor.exact`."""
    exact = type(inner).read_tree_peak_bytes is not Sensor.read_tree_peak_bytes
    return (_ExactTreeSensor if exact else TreeSensor)(inner, watch)
