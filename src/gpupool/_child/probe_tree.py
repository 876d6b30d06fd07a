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
* :func:`gpupool._child.tree_sensor.tree_sensor` wraps the worker's sensor so
  that the worker's per-process bytes are its tree's (a module of its own: a
  worker without a device never loads a sensor).

A descendant the task leaves running keeps its bytes after the task: the
report counts it (``outliving_descendants``, ``outliving_device_bytes``); the
pool kills a worker's whole tree when it retires the worker.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from gpupool._core.peak import MAX_REJECTIONS, TreeSummary
from gpupool._sensors.own_pid import own_pid
from gpupool._sensors.tree import (
    MAX_DESCENDANTS,
    read_children_of,
    read_children_rss_high_water,
    read_descendants,
    read_rss_high_water_of,
    reap_adopted,
    reap_unclaimed_zombies,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable
    from pathlib import Path

    from gpupool._child.tree_sensor import TreeSensor
    from gpupool._sensors.base import DeviceInfo

__all__ = ["TREE_SAMPLE_INTERVAL_S", "TreeSummary", "TreeWatch"]

#: How often the tree's membership and RSS are sampled: as often as the
#: device sampler (``SAMPLE_INTERVAL_S``), so a descendant the device sampler
#: reads is one the tree knows. Each sample reads a few small ``/proc`` files.
TREE_SAMPLE_INTERVAL_S = 0.010

#: The sampler parks (waits without waking every interval) once no window has opened
#: or closed for this long; the next window to open wakes it.
_PARK_AFTER_S = 0.25
#: How often a parked sampler looks whether its watch is still there.
_PARKED_CHECK_S = 1.0


#: What a window that saw no process under the worker, and no rejected reading, sums up to.
_NOTHING_SEEN = TreeSummary(
    descendants=0,
    outliving_pids=(),
    outliving_device_bytes=None,
    rss_peak_bytes=None,
    rejected=(),
)


def read_start_token(pid: int) -> str | None:
    """:func:`gpupool._sensors.booking_rows.read_start_token`, imported when a task first has
    a descendant to identify (a worker starts without the booking table's modules)."""
    from gpupool._sensors.booking_rows import read_start_token as read

    return read(pid)


class _Sampler:
    """When a watch's sampler thread samples, and the lock that the watch shares with it.

    One per watch and process: made with the watch, and again in a forked copy of the
    process, where the parent's thread does not run and its lock may have been held. It
    holds the thread's schedule only; what a sample finds is the watch's. A window arms it
    (:meth:`arm`), ending or reopening one disarms it (:meth:`disarm`). Armed, it samples
    every :data:`TREE_SAMPLE_INTERVAL_S` from the window's opening, so a window shorter than
    that is read only at its opening and its closing; while windows keep opening it wakes
    at most once an interval, and with no window for :data:`_PARK_AFTER_S` it parks until
    the next one opens. A sample taken for one window never counts in another: disarming
    waits for a sample in flight, and each window has its own generation.
    """

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        # Guards the watch's window as well as this schedule, so that a sample's check of
        # its generation and its additions to the window are one step. Taken directly
        # (``with sampler.lock``) where nothing waits: a Condition is entered through a
        # Python call.
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.armed = False  # a window is open: its samples are due
        self.generation = 0  # bumped at each opening and closing of a window
        self.due_s = 0.0  # when the open window's next sample is due (monotonic)
        self.parked = False  # the thread waits for a window to open
        self.sampling = False  # the thread reads the tree (outside the lock)
        self.tick: Callable[[frozenset[int]], None] | None = None
        self.thread: threading.Thread | None = None

    def disarm(self, *, closing: bool) -> None:
        """Start no sample from now; a sample in flight ends first. ``closing``: the window
        ends here, its generation and its tick with it (an opening's :meth:`arm` does that)."""
        with self.lock:
            self.armed = False
            while self.sampling:  # an end keeps its sample; an opening's generation drops it
                self.wake.wait()
            if closing:
                self.generation += 1
                self.tick = None

    def arm(self) -> None:
        """Arm for a new window, its first sample due an interval from now, and wake a parked
        thread. The caller holds :attr:`lock`: the watch sets the window's fresh accumulators
        in the same step."""
        self.generation += 1
        self.tick = None
        self.armed = True
        self.due_s = time.monotonic() + TREE_SAMPLE_INTERVAL_S
        if self.parked:
            self.parked = False
            self.wake.notify()

    def run_for(self, watch: TreeWatch) -> None:
        """Start the thread that samples for ``watch``, unless it runs: at the first window,
        or after the thread ended (it says so, as it ends: :meth:`thread_ended`)."""
        if self.thread is None:
            self.thread = thread = threading.Thread(
                target=_sample_while_watched,
                args=(weakref.ref(watch),),
                name="gpupool-tree",
                daemon=True,
            )
            thread.start()

    def thread_ended(self) -> None:
        """The thread ends: the next window starts another (if this one is still the one)."""
        if self.thread is threading.current_thread():
            self.thread = None

    def set_tick(self, tick: Callable[[frozenset[int]], None]) -> None:
        """Run ``tick`` after each sample of the open window; until it ends."""
        with self.lock:
            if self.armed:
                self.tick = tick

    def turn(self, watch: TreeWatch, quiet: list[float]) -> None:
        """One turn of the thread: wait for an open window's due sample, have ``watch`` take it.

        ``quiet`` is the thread's own ``[generation seen, since when]``: how long no
        window has opened or closed, to know when to park.
        """
        with self.lock:
            now_s = time.monotonic()
            if self.generation != quiet[0]:
                quiet[0], quiet[1] = self.generation, now_s
            if not self.armed:
                if now_s - quiet[1] < _PARK_AFTER_S:
                    self.wake.wait(TREE_SAMPLE_INTERVAL_S)
                else:
                    self.parked = True  # the next opening wakes it
                    self.wake.wait(_PARKED_CHECK_S)
                    self.parked = False
                return
            if self.due_s > now_s:
                self.wake.wait(self.due_s - now_s)
                return
            generation, tick = self.generation, self.tick
            self.sampling = True
        try:
            watch._sample(generation, tick)
        finally:
            with self.lock:
                self.sampling = False
                self.due_s = time.monotonic() + TREE_SAMPLE_INTERVAL_S
                self.wake.notify_all()  # an opening or an end that waits for this sample


class TreeWatch:
    """Follows the process tree under ``root_pid`` through one task window at a time.

    The watch keeps what the open window saw; its :class:`_Sampler` keeps when the
    sampler thread (one per watch, started with the first window and kept) samples it,
    and the lock both share. After each sample it runs the window's *tick*, if one was
    set (:meth:`tick_with`: the probe's device sampling), with the tree it read.
    ``proc``: the ``/proc`` to read (a fake tree in tests).
    """

    def __init__(self, root_pid: int, *, proc: Path | str = "/proc") -> None:
        self.root_pid = root_pid
        self.sensor: TreeSensor | None = None
        self._proc = str(proc)
        self._at_start: set[tuple[int, str]] = set()
        self._seen: set[tuple[int, str]] = set()
        self._reasons: dict[str, None] = {}
        self._rss_peak_bytes = 0
        self._children_rss_at_start: int | None = None
        # Who ran at the window's end, read by end() for close() to sum up.
        self._ended: set[tuple[int, str]] | None = None
        # Descendants first seen below a child of the root: if their parent exits they are
        # re-parented to the root (a worker is a child subreaper), which reaps them once
        # they exit (no task waits for them).
        self._adoptable: set[int] = set()
        self._sampler = _Sampler()

    def _own_sampler(self) -> _Sampler:
        """The sampler of this process: a forked copy makes its own (see :class:`_Sampler`)."""
        sampler = self._sampler
        if sampler.owner_pid != own_pid():
            self._sampler = sampler = _Sampler()
        return sampler

    def _identities(self, pids: Iterable[int]) -> set[tuple[int, str]]:
        """``(pid, start token)`` of each process still running (a reused PID is another)."""
        found: set[tuple[int, str]] = set()
        for pid in pids:
            token = read_start_token(pid)
            if token is not None:
                found.add((pid, token))
        return found

    def _read(self, *, own: bool | None = None) -> tuple[tuple[int, ...], set[tuple[int, str]]]:
        """One reading of the tree: the live descendants now, with those seen before that are
        still running though re-parented away since (their parent exited: ``sh -c "cmd &"``,
        a launcher) and every process under those, and the identities of them all. ``own``:
        whether the root is this process, where the caller knows (``None``: asked)."""
        found = read_descendants(self.root_pid, self._proc, own=own)
        if not found and not self._seen:
            return found, set()  # the usual case: no process under the worker, before or now
        if found and own is not False and len(self._adoptable) < MAX_DESCENDANTS:
            direct = read_children_of(self.root_pid, self._proc)
            if direct is not None:
                self._adoptable.update(pid for pid in found if pid not in direct)
        identities = self._identities(found) if found else set()
        known = set(found)
        with self._sampler.lock:
            earlier = [(pid, token) for pid, token in self._seen if pid not in known]
        orphans = [(pid, token) for pid, token in earlier if read_start_token(pid) == token]
        if not orphans:
            return found, identities
        identities.update(orphans)
        known.update(pid for pid, _ in orphans)
        below: list[int] = []  # what the orphans started, before or after they left the tree
        for pid, _ in orphans:
            for descendant in read_descendants(pid, self._proc):
                if descendant not in known and len(known) < MAX_DESCENDANTS:
                    known.add(descendant)
                    below.append(descendant)
        identities |= self._identities(below)
        return (*found, *(pid for pid, _ in orphans), *below), identities

    def _rss_of(self, descendants: Collection[int]) -> int:
        """The sum of ``descendants``' RSS high-waters now."""
        if not descendants:
            return 0
        return sum(read_rss_high_water_of(pid, self._proc) or 0 for pid in descendants)

    def members(self) -> frozenset[int]:
        """The root and its live descendants now (noted as seen while a window is open)."""
        descendants, identities = self._read()
        if self._sampler.armed and identities:
            with self._sampler.lock:
                self._seen |= identities
        return frozenset((self.root_pid, *descendants))

    def seen(self) -> int:
        """How many processes were seen under the root in the open window so far."""
        with self._sampler.lock:
            return len(self._seen)

    def note_rejections(self, reasons: Iterable[str]) -> None:
        """Keep why a reading was rejected (each reason once, at most ``MAX_REJECTIONS``)."""
        with self._sampler.lock:
            for reason in reasons:
                if len(self._reasons) < MAX_REJECTIONS:
                    self._reasons.setdefault(reason, None)

    def open(self) -> frozenset[int]:
        """Open a window: note the descendants already running and their RSS, and arm the
        sampler. Returns the root and its live descendants now (one reading serves all)."""
        sampler = self._own_sampler()
        sampler.disarm(closing=False)
        descendants, at_start = self._read(own=self.root_pid == sampler.owner_pid)
        rss_bytes = self._rss_of(descendants)
        children_rss = read_children_rss_high_water()
        with sampler.lock:
            self._at_start = at_start
            self._seen = set(at_start)
            self._reasons = {}
            self._rss_peak_bytes = rss_bytes
            self._children_rss_at_start = children_rss
            self._ended = None
            sampler.arm()
        sampler.run_for(self)
        return frozenset((self.root_pid, *descendants))

    def tick_with(self, tick: Callable[[frozenset[int]], None]) -> None:
        """Run ``tick`` after each sample of the open window, with the tree it read (the root
        and its descendants), on the sampler thread; until the window ends."""
        self._sampler.set_tick(tick)

    def _sample(self, generation: int, tick: Callable[[frozenset[int]], None] | None) -> None:
        """One sample of window ``generation``: who is in the tree, their RSS; then its tick.
        Taken on the sampler thread (:meth:`_Sampler.turn`), outside the lock."""
        try:
            descendants, identities = self._read()
            rss_bytes = self._rss_of(descendants)
        except Exception:
            return  # a sample lost; the window's end reads the tree again
        with self._sampler.lock:
            if generation != self._sampler.generation:
                return
            self._seen |= identities
            self._rss_peak_bytes = max(self._rss_peak_bytes, rss_bytes)
        if tick is not None:
            try:
                tick(frozenset((self.root_pid, *descendants)))
            except Exception:
                pass  # a tick's reading that fails is a reading missed, never the sampler's end

    def end(self) -> frozenset[int]:
        """End the open window: disarm the sampler (a sample of the window in flight is
        kept), and take the window's last reading. Returns the root and its live
        descendants now; :meth:`close` then sums the window up."""
        sampler = self._own_sampler()
        sampler.disarm(closing=True)
        descendants, running = self._read(own=self.root_pid == sampler.owner_pid)
        if descendants:
            rss_bytes = self._rss_of(descendants)
            with sampler.lock:
                self._seen |= running
                self._rss_peak_bytes = max(self._rss_peak_bytes, rss_bytes)
        self._ended = running
        return frozenset((self.root_pid, *descendants))

    def close(self, device: DeviceInfo | None) -> TreeSummary:
        """Close the window (ending it first, see :meth:`end`, unless it was); what it saw,
        and what the task left running on ``device``."""
        if self._ended is None:
            self.end()
        running, self._ended = self._ended or set(), None
        with self._sampler.lock:
            outliving = tuple(sorted(pid for pid, _ in running - self._at_start)) if running else ()
            seen, rss_bytes, reasons = len(self._seen), self._rss_peak_bytes, tuple(self._reasons)
        owner_pid = self._sampler.owner_pid
        if self._adoptable and self.root_pid == owner_pid:
            self._reap_adopted()
        if self.root_pid == owner_pid == os.getpid():
            reap_unclaimed_zombies(_claimed_children)
        children = read_children_rss_high_water()
        before = self._children_rss_at_start
        if children is not None and before is not None and children > before:
            rss_bytes = max(rss_bytes, children)  # a child reaped before a sample saw it
        if not (seen or rss_bytes or reasons):
            return _NOTHING_SEEN  # the usual case: no process under the worker
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

    def _reap_adopted(self) -> None:
        """Reap the adopted orphans that have exited; forget those no longer running."""
        reap_adopted(self._adoptable)
        direct = read_children_of(self.root_pid, self._proc) or frozenset()
        self._adoptable = {
            pid for pid in self._adoptable if pid in direct or read_start_token(pid) is not None
        }


def _claimed_children() -> set[int]:
    """The PIDs of this process's children that a waiter here still owns: live
    ``subprocess.Popen`` objects not yet waited for (asyncio's processes hold one), and
    ``multiprocessing``'s children. Read only when an exited child was found."""
    claimed: set[int] = set()
    subprocess = sys.modules.get("subprocess")
    popen = getattr(subprocess, "Popen", None)
    if isinstance(popen, type):
        for obj in gc.get_objects():
            if isinstance(obj, popen) and getattr(obj, "returncode", 0) is None:
                pid = getattr(obj, "pid", None)
                if isinstance(pid, int):
                    claimed.add(pid)
    process = sys.modules.get("multiprocessing.process")
    for child in list(getattr(process, "_children", ()) or ()):
        pid = getattr(child, "_popen", None) and getattr(child._popen, "pid", None)
        if isinstance(pid, int):
            claimed.add(pid)
    return claimed


def _sample_while_watched(ref: weakref.ReferenceType[TreeWatch]) -> None:
    """The sampler thread: turns until its watch is gone (it holds the watch only weakly
    between turns, so a watch dropped by its owner ends its thread)."""
    quiet = [-1.0, time.monotonic()]
    try:
        while True:
            watch = ref()
            if watch is None:
                return
            watch._sampler.turn(watch, quiet)
            del watch
    finally:
        watch = ref()
        if watch is not None:
            watch._sampler.thread_ended()
