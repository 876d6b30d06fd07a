"""Child side: one task's process tree, measured as one (the worker and every process under it).

A task's device bytes may live in processes it starts: a compiler, a
``torchrun``, a ``multiprocessing`` pool inside the task. The probe therefore
measures the worker's *tree*:

* :class:`TreeWatch` follows who is in the tree while a task runs (each
  thread's ``/proc/<pid>/task/<tid>/children``, every 10 ms; a descendant
  once seen stays a member while it runs, even re-parented away), the
  descendants' host RSS high-water (their ``VmHWM`` summed per sample, and
  ``RUSAGE_CHILDREN`` for children reaped before a sample saw them), and which
  descendants the task left running when it ended;
* :func:`tree_sensor` wraps the worker's sensor so that the worker's
  per-process bytes are its tree's: the rows of every process in the tree,
  judged by :func:`~gpupool._core.readings.judge_tree_rows` (implausible rows
  are rejected, with the reason kept for the peak report), or, where the
  sensor keeps one (the simulator), the tree's exact high-water window.

A descendant the task leaves running keeps its bytes after the task: the
report counts it (``outliving_descendants``, ``outliving_device_bytes``); the
pool kills a worker's whole tree when it retires the worker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool._core.readings import MAX_REJECTIONS, judge_tree_rows
from gpupool._errors import SensorError
from gpupool._sensors.base import Sensor
from gpupool._sensors.tree import (
    read_children_rss_high_water,
    read_descendants,
    read_rss_high_water_of,
)

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

    from gpupool._core.census import HostCensus
    from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading

__all__ = ["TREE_SAMPLE_INTERVAL_S", "TreeSensor", "TreeSummary", "TreeWatch", "tree_sensor"]

#: How often the tree's membership and RSS are sampled: as often as the
#: device sampler (``SAMPLE_INTERVAL_S``), so a descendant the device sampler
#: reads is one the tree knows. Each sample reads a few small ``/proc`` files.
TREE_SAMPLE_INTERVAL_S = 0.010


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeSummary:
    """What one task window saw of the worker's tree.

    Attributes:
        descendants: processes seen under the worker during the window.
        outliving_pids: the descendants started during the window and still
            running at its end.
        outliving_device_bytes: what those held on the device then, from
            trusted rows, or ``None`` when none said.
        rss_peak_bytes: the descendants' host RSS high-water during the
            window, or ``None`` when none was seen.
        rejected: why readings of the tree were not measurements.
    """

    descendants: int
    outliving_pids: tuple[int, ...]
    outliving_device_bytes: int | None
    rss_peak_bytes: int | None
    rejected: tuple[str, ...]


def read_start_token(pid: int) -> str | None:
    """:func:`gpupool._sensors.booking_rows.read_start_token`, imported when a task first has
    a descendant to identify (a worker starts without the booking table's modules)."""
    from gpupool._sensors.booking_rows import read_start_token as read

    return read(pid)


class TreeWatch:
    """Follows the process tree under ``root_pid`` through one task window at a time.

    Args:
        root_pid: the worker's PID.
        proc: the ``/proc`` to read (a fake tree in tests).
    """

    def __init__(self, root_pid: int, *, proc: Path = Path("/proc")) -> None:
        self.root_pid = root_pid
        self.sensor: TreeSensor | None = None
        self._proc = proc
        self._lock = threading.Lock()
        self._open = False
        self._at_start: set[tuple[int, str]] = set()
        self._seen: set[tuple[int, str]] = set()
        self._reasons: dict[str, None] = {}
        self._rss_peak_bytes = 0
        self._children_rss_at_start: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _identities(self, pids: Iterable[int]) -> set[tuple[int, str]]:
        """``(pid, start token)`` of each process still running (a reused PID is another)."""
        found: set[tuple[int, str]] = set()
        for pid in pids:
            token = read_start_token(pid)
            if token is not None:
                found.add((pid, token))
        return found

    def _descendants(self) -> tuple[int, ...]:
        """The live descendants now, and those seen before that are still running though
        re-parented away since (their parent exited: ``sh -c "cmd &"``, a launcher)."""
        found = read_descendants(self.root_pid, self._proc)
        with self._lock:
            seen = [(pid, token) for pid, token in self._seen if pid not in found]
        orphans = [pid for pid, token in seen if read_start_token(pid) == token]
        return (*found, *orphans) if orphans else found

    def members(self) -> frozenset[int]:
        """The root and its live descendants now (noted as seen while a window is open)."""
        descendants = self._descendants()
        if self._open and descendants:
            identities = self._identities(descendants)
            with self._lock:
                self._seen |= identities
        return frozenset((self.root_pid, *descendants))

    def note_rejections(self, reasons: Iterable[str]) -> None:
        """Keep why a reading was rejected (each reason once, at most ``MAX_REJECTIONS``)."""
        with self._lock:
            for reason in reasons:
                if len(self._reasons) < MAX_REJECTIONS:
                    self._reasons.setdefault(reason, None)

    def open(self) -> None:
        """Open a window: note the descendants already running, and start sampling."""
        self._halt()
        at_start = self._identities(self._descendants())
        with self._lock:
            self._at_start = at_start
            self._seen = set(at_start)
            self._reasons = {}
            self._rss_peak_bytes = 0
        self._children_rss_at_start = read_children_rss_high_water()
        self._open = True
        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpupool-tree", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(TREE_SAMPLE_INTERVAL_S):
            self._sample()

    def _sample(self) -> None:
        """One sample: who is in the tree, and the sum of the descendants' RSS high-waters."""
        descendants = self._descendants()
        identities = self._identities(descendants)
        rss_bytes = sum(read_rss_high_water_of(pid, self._proc) or 0 for pid in descendants)
        with self._lock:
            self._seen |= identities
            self._rss_peak_bytes = max(self._rss_peak_bytes, rss_bytes)

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self, device: DeviceInfo | None) -> TreeSummary:
        """Close the window; what it saw, and what the task left running on ``device``."""
        self._halt()
        self._sample()
        self._open = False
        running = self._identities(self._descendants())
        with self._lock:
            outliving = tuple(sorted(pid for pid, _ in running - self._at_start))
            seen, rss_bytes, reasons = len(self._seen), self._rss_peak_bytes, tuple(self._reasons)
        children = read_children_rss_high_water()
        before = self._children_rss_at_start
        if children is not None and before is not None and children > before:
            rss_bytes = max(rss_bytes, children)  # a child reaped before a sample saw it
        outliving_bytes = None
        if outliving and self.sensor is not None and device is not None:
            try:
                outliving_bytes = self.sensor.read_members_bytes(device, outliving)
            except Exception:
                outliving_bytes = None
        return TreeSummary(
            descendants=seen,
            outliving_pids=outliving,
            outliving_device_bytes=outliving_bytes,
            rss_peak_bytes=rss_bytes or None,
            rejected=reasons,
        )


class TreeSensor(Sensor):
    """The probe's view of the worker's sensor: the worker's bytes are its tree's.

    Asked for the root's per-process bytes, it reads the device's rows (and
    its used bytes, in one snapshot) and sums the rows of every process in the
    tree, where :func:`~gpupool._core.readings.judge_tree_rows` takes them as
    a measurement. Every other question goes to the wrapped sensor.
    """

    def __init__(self, inner: Sensor, watch: TreeWatch) -> None:
        self.inner = inner
        self.watch = watch
        self.name = inner.name
        watch.sensor = self

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

    def close(self) -> None:
        self.inner.close()

    def read_process_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """The tree's bytes for the root (judged rows), any other process's row otherwise."""
        if pid != self.watch.root_pid:
            return self.inner.read_process_bytes(device, pid)
        return self.read_members_bytes(device, self.watch.members())

    def read_root_bytes(self, device: DeviceInfo) -> tuple[int | None, int | None]:
        """The tree's bytes and the root's own row, from one reading of ``device``.

        Either is ``None`` where the reading is not a measurement; the root's
        own figure is also ``None`` where the root has no row. What the root
        holds outside its frameworks (its context) is measured from its own
        row, never from its descendants'.
        """
        return self._read_members(device, self.watch.members())

    def read_members_bytes(self, device: DeviceInfo, members: Collection[int]) -> int | None:
        """What ``members`` hold by one reading of ``device``, or ``None`` (reasons kept)."""
        return self._read_members(device, members)[0]

    def _read_members(
        self, device: DeviceInfo, members: Collection[int]
    ) -> tuple[int | None, int | None]:
        """``members``' bytes and the root's own row by one reading (reasons kept)."""
        memory: MemoryReading | None
        try:
            memory, rows = self.inner.read_snapshot(device)
        except SensorError:
            memory, rows = None, self.inner.read_processes(device)
        if rows is None:
            return None, None
        # On unified memory "used" is the host's, not a device total to bound rows by.
        used = memory.used_bytes if memory is not None and not memory.unified else None
        verdict = judge_tree_rows(
            [(row.pid, row.used_bytes) for row in rows], members, device_used_bytes=used
        )
        self.watch.note_rejections(verdict.reasons)
        if verdict.tree_bytes is None:
            return None, None
        own = [row.used_bytes for row in rows if row.pid == self.watch.root_pid]
        return verdict.tree_bytes, own[0] if own and self.watch.root_pid in members else None


class _ExactTreeSensor(TreeSensor):
    """A tree view of a sensor that keeps an exact tree high-water (the simulator's ledger)."""

    def start_peak_window(self, device: DeviceInfo, pid: int) -> int | None:
        if pid != self.watch.root_pid:
            return self.inner.start_peak_window(device, pid)
        return self.inner.start_tree_window(device, pid)

    def read_process_peak_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        if pid != self.watch.root_pid:
            return self.inner.read_process_peak_bytes(device, pid)
        return self.inner.read_tree_peak_bytes(device, pid)


def tree_sensor(inner: Sensor, watch: TreeWatch) -> TreeSensor:
    """``inner`` seen as ``watch``'s tree: exact where ``inner`` keeps tree windows, else sampled.

    The probe tells the two apart as it tells any sensor: by whether it
    overrides :meth:`~gpupool._sensors.base.Sensor.read_process_peak_bytes`.
    """
    exact = type(inner).read_tree_peak_bytes is not Sensor.read_tree_peak_bytes
    return (_ExactTreeSensor if exact else TreeSensor)(inner, watch)
