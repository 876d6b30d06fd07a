"""The simulator's ledger (I/O edge).

A :class:`gpupool.testing.SimulatedHost` keeps its whole state in one small
JSON file, the *ledger*, in a private temporary directory. Every process that
shares the host (the test process, the pool's parent, every child) reads and
changes the ledger through :class:`Ledger`, finds it through the
``GPUPOOL_SIMULATOR`` environment variable, and reads it as a driver through
:class:`~gpupool._sensors.simulated_sensor.SimulatedSensor`::

    test process                 child (spawned)              child (spawned)
    SimulatedHost.__enter__      hold("6GiB")                 hold("6GiB")
      |  writes ledger.json        |                            |
      |  sets GPUPOOL_SIMULATOR    v                            v
      +---------------------> ledger.json  <--- flock, read, write ---+
                                   ^
    SimulatedSensor.read_memory ---+   (the pool, the CLI, the probe)

One operation is one read-modify-write under an exclusive ``flock`` on the
ledger (plus a thread lock, since ``flock`` does not exclude two threads
sharing one descriptor), written in place so that a process killed at any
instant leaves a valid ledger behind (see :meth:`LedgerFile.write
<gpupool._sensors.simulated_file.LedgerFile.write>`). A reading that changes
nothing (the card read, a window already where it would be set) first
compares the file's bytes with those this process read last, without the
``flock`` (:meth:`LedgerReading.unchanged
<gpupool._sensors.simulated_reading.LedgerReading.unchanged>`), and where they
differ takes the ``flock`` shared, so readers in several processes never wait
for one another; one that finds something to write reads again under the
exclusive lock (:meth:`Ledger._settled`). An operation costs a few to tens of
microseconds.

A :class:`Ledger` keeps its state in two rooms, each the only writer of its
fields::

    Ledger            the operations; the process its rooms belong to, the layout
      LedgerFile      simulated_file.py: the descriptor, what file it is, the locks
      LedgerReading   simulated_reading.py: the bytes read last, their parse, the
                      processes they name and which of those have exited

As the driver frees a dead process's memory, every operation first drops the
entries of processes that have exited (zombies included: the driver frees a
process's memory when it exits, not when it is reaped), and of processes whose
PID was reused (the start time recorded at first touch no longer matches).
"""

from __future__ import annotations

import enum
import json
import os
import sys
from typing import TYPE_CHECKING, TypeVar

from gpupool._sensors.ancestry import read_ancestors
from gpupool._sensors.booking_rows import read_start_token
from gpupool._sensors.own_pid import own_pid
from gpupool._sensors.simulated_file import MAX_LEDGER_BYTES, LedgerFile, LedgerGoneError
from gpupool._sensors.simulated_reading import LEDGER_VERSION, LedgerReading
from gpupool._sensors.simulated_state import (
    DeviceState,
    LedgerState,
    OutOfMemoryRecord,
    ProcessState,
    TreeWindow,
    device_of,
    device_used_bytes,
    note_peaks,
    process_bytes,
    refuse,
    tree_bytes,
)

if TYPE_CHECKING:
    from collections.abc import Callable


__all__ = [
    "BOOKINGS_DIRECTORY",
    "CO_TENANT_PID_BASE",
    "DEVICE_NAME",
    "LEDGER_VERSION",
    "MAX_LEDGER_BYTES",
    "DeviceState",
    "Ledger",
    "LedgerGoneError",
    "LedgerState",
    "OutOfMemoryRecord",
    "ProcessState",
    "device_used_bytes",
    "forget_ledger",
    "ledger_at",
    "simulated_uuid",
]

#: Co-tenants get fake PIDs from here up. Linux never hands out a PID at or
#: above ``PID_MAX_LIMIT`` (2**22), so a fake PID can never name a real process.
CO_TENANT_PID_BASE = 2**22

#: The product name every simulated device reports.
DEVICE_NAME = "Simulated GPU"

#: The simulated host's booking table lives in this directory beside its ledger.
BOOKINGS_DIRECTORY = "bookings"

_T = TypeVar("_T")


def simulated_uuid(index: int) -> str:
    """The deterministic UUID of simulated device ``index`` (``GPU-51a1a7ed-...-00000000000N``)."""
    return f"GPU-51a1a7ed-0000-4000-8000-{index:012d}"


def _encode(state: LedgerState) -> bytes:
    return json.dumps(state, separators=(",", ":")).encode()


def _own_name() -> str:
    try:
        with open("/proc/self/comm", encoding="utf-8", errors="replace") as file:
            return file.read().strip()
    except OSError:
        return os.path.basename(sys.executable)


class _Again(enum.Enum):
    """What a step of :meth:`Ledger._settled` answers under the shared lock where it must write."""

    WRITE = "write"


class _Held:
    """``with ledger._locked() as size``: the ledger's locks held for one operation."""

    __slots__ = ("_ledger", "_shared")

    def __init__(self, ledger: Ledger, *, shared: bool) -> None:
        self._ledger = ledger
        self._shared = shared

    def __enter__(self) -> int:
        return self._ledger._acquire(shared=self._shared)

    def __exit__(self, *exc: object) -> None:
        self._ledger._file.release()


class Ledger:
    """Read and change one simulated host's ledger, one locked operation at a time.

    Get one with :func:`ledger_at`, which keeps one per path (``GPUPOOL_SIMULATOR``'s
    value) and process.

    Two rooms keep its state, each the only writer of its fields: the file and its
    locks (:class:`~gpupool._sensors.simulated_file.LedgerFile`), and the reading this
    process holds and its freshness
    (:class:`~gpupool._sensors.simulated_reading.LedgerReading`). The ledger itself
    keeps the process they belong to and the layout, and carries out the operations.
    """

    def __init__(self, path: str) -> None:
        self._pid = os.getpid()
        self._file = LedgerFile(path)
        self._reading = LedgerReading(self._file)
        self._layout: tuple[bool, tuple[str, ...]] | None = None
        self._held = _Held(self, shared=False)
        self._held_shared = _Held(self, shared=True)

    @property
    def path(self) -> str:
        """The ledger's path (``GPUPOOL_SIMULATOR``'s value)."""
        return self._file.path

    @staticmethod
    def create(path: str, state: LedgerState) -> Ledger:
        """Write a new ledger at ``path`` (which must not exist; its directory must)."""
        with open(path, "xb") as file:
            file.write(_encode(state))
        return Ledger(path)

    def remove(self) -> LedgerState:
        """Unlink the ledger (its host is leaving); returns its last state.

        A process that still holds the ledger open finds it gone on its next
        operation (:class:`LedgerGoneError`).
        """
        with self._locked() as size:
            state, _ = self._reading.current(size)
            os.unlink(self.path)
        self.close()
        return state

    def close(self) -> None:
        """Close the file descriptor and the pidfds (reopened on the next operation)."""
        with self._file.thread_lock:
            self._file.close()
            self._reading.close()

    # -- the locked read-modify-write ----------------------------------------------------

    def _locked(self, *, shared: bool = False) -> _Held:
        """Hold the thread lock and the file lock (``with``); gives the ledger's size in bytes.

        ``shared``: the file lock in shared mode, for a reading that changes nothing (other
        processes' readings go on meanwhile; a change waits for it, and it for a change).
        """
        return self._held_shared if shared else self._held

    def _acquire(self, *, shared: bool) -> int:
        """Leave a parent's locks behind (in a forked child), then take the thread lock and
        the file lock (:meth:`LedgerFile.acquire
        <gpupool._sensors.simulated_file.LedgerFile.acquire>`); the ledger's size in bytes."""
        self._leave_parent()
        return self._file.acquire(shared=shared)

    def _leave_parent(self) -> None:
        """In a forked child, start afresh: the inherited descriptor is the parent's open file,
        whose flock parent and child would both "hold", and the thread lock may have been
        held by another thread at the fork.

        Asked of the kernel (``os.getpid``), not :func:`own_pid`: a child forked below
        Python (C code, ``ctypes``) runs no fork hook, and would take its parent's lock
        as its own (one ``getpid`` per locked operation; the lock-free reading, which
        takes no lock, asks :func:`own_pid`)."""
        pid = os.getpid()
        if self._pid == pid:
            return
        self._pid = pid
        self._file.leave_parent()
        self._reading.leave_parent()  # this process's copies of the parent's pidfds

    def _settled(self, step: Callable[[LedgerState, int | None], _T | _Again]) -> _T:
        """``step`` on the state now (``size`` ``None``: it may not write, and answers
        :data:`_Again.WRITE` where it has to): on the reading this process already holds
        where the file still holds its bytes (:meth:`LedgerReading.unchanged
        <gpupool._sensors.simulated_reading.LedgerReading.unchanged>`), else under the
        shared lock; then, if it has to write or a dead process has to be dropped, under
        the exclusive lock.

        A reading that changes nothing waits for no other reading, in any process.
        """
        if self._pid != own_pid():
            self._leave_parent()
        with self._file.thread_lock:
            state = self._reading.unchanged()
            if state is not None:
                result = step(state, None)
                if result is not _Again.WRITE:
                    return result
        with self._locked(shared=True) as size:
            state = self._reading.view_shared(size)
            if state is not None:
                result = step(state, None)
                if result is not _Again.WRITE:
                    return result
        with self._locked() as size:
            result = step(self._reading.view(size), size)
            assert result is not _Again.WRITE, "a step under the exclusive lock writes itself"
            return result

    def _apply(self, change: Callable[[LedgerState], _T], *, writes: bool) -> _T:
        """Run ``change`` on the current state under the lock, after dropping dead processes.

        The state is written back when ``writes`` is true or when a dead
        process was dropped.
        """
        with self._locked() as size:
            state, pruned = self._reading.current(size)
            result = change(state)
            if writes or pruned:
                self._reading.write(state, size)
            return result

    # -- operations ------------------------------------------------------------------------

    def snapshot(self) -> LedgerState:
        """The whole state now, dead processes dropped (a copy: changing it changes nothing)."""

        def copy(state: LedgerState, size: int | None) -> LedgerState:
            raw = self._reading.raw
            assert raw is not None  # the bytes ``state`` was read from
            copied: LedgerState = json.loads(raw)
            return copied

        return self._settled(copy)

    def view(self) -> LedgerState:
        """The whole state now, dead processes dropped, shared by this process's readers:
        never change it (:meth:`snapshot` gives a copy). Unchanged, it is not parsed again."""
        return self._settled(lambda state, size: state)

    def layout(self) -> tuple[bool, tuple[str, ...]]:
        """Whether the host has a driver, and every device's UUID in index order.

        Both are fixed for a ledger's life, so the first answer is kept.
        """
        if self._layout is None:
            state = self.view()
            self._layout = (state["driver"], tuple(dev["uuid"] for dev in state["devices"]))
        return self._layout

    def allocate(self, device: int, pid: int, nbytes: int) -> OutOfMemoryRecord | None:
        """Charge ``nbytes`` to ``pid`` on ``device``; the refusal when the card cannot hold it.

        A process's first touch of a device also charges the host's context
        size, which fits or fails on its own, as ``cuInit`` does: a context
        that was created stays charged even when the allocation after it fails.
        A refused allocation charges nothing and is recorded.
        """
        key = str(pid)

        def change(state: LedgerState) -> OutOfMemoryRecord | None:
            dev = device_of(state, device)
            proc = dev["procs"].get(key)
            if proc is None:
                identity = _identity_of(pid)
                if identity is None:
                    raise ValueError(f"process {pid} does not exist; it cannot hold device bytes")
                context = state["context"]
                refusal = refuse(state, device, pid, context)
                if refusal is not None:
                    refusal["ancestors"] = list(read_ancestors(pid))
                    return refusal
                name = _own_name() if pid == os.getpid() else "python"
                proc = ProcessState(
                    start=identity,
                    name=name,
                    context=context,
                    held=0,
                    window=0,
                    ancestors=list(read_ancestors(pid)),
                )
                dev["procs"][key] = proc
                note_peaks(dev, key, proc)
            refusal = refuse(state, device, pid, nbytes)
            if refusal is not None:
                refusal["ancestors"] = proc["ancestors"]  # as at its first touch
                return refusal
            proc["held"] += nbytes
            note_peaks(dev, key, proc)
            return None

        return self._apply(change, writes=True)

    def release(self, device: int, pid: int, nbytes: int) -> None:
        """Give back ``nbytes`` that ``pid`` holds on ``device`` (its context stays)."""

        def change(state: LedgerState) -> None:
            proc = device_of(state, device)["procs"].get(str(pid))
            if proc is not None:
                proc["held"] = max(0, proc["held"] - nbytes)

        self._apply(change, writes=True)

    def grow_tenant(
        self, device: int, name: str, nbytes: int, *, listed: bool = True
    ) -> OutOfMemoryRecord | None:
        """Add ``nbytes`` to co-tenant ``name`` (created if new, in the rows unless not
        ``listed``); the refusal if it does not fit."""

        def change(state: LedgerState) -> OutOfMemoryRecord | None:
            dev = device_of(state, device)
            entry = dev["tenants"].get(name)
            if entry is None:
                entry = [state["next_fake_pid"], 0] + ([] if listed else [1])
                state["next_fake_pid"] += 1
                dev["tenants"][name] = entry
            refusal = refuse(state, device, entry[0], nbytes)
            if refusal is not None:
                return refusal
            entry[1] += nbytes
            dev["peak"] = max(dev["peak"], device_used_bytes(dev))
            return None

        return self._apply(change, writes=True)

    def shrink_tenant(self, device: int, name: str, nbytes: int) -> None:
        """Take ``nbytes`` from co-tenant ``name``.

        Raises:
            ValueError: no such co-tenant, or it holds fewer than ``nbytes``.
        """

        def change(state: LedgerState) -> None:
            entry = device_of(state, device)["tenants"].get(name)
            if entry is None:
                raise ValueError(f"simulated device {device} has no co-tenant named {name!r}")
            if nbytes > entry[1]:
                raise ValueError(
                    f"co-tenant {name!r} on simulated device {device} holds {entry[1]} bytes; "
                    f"it cannot shrink by {nbytes}"
                )
            entry[1] -= nbytes

        self._apply(change, writes=True)

    def reset_window(self, device: int, pid: int) -> int:
        """Start a new high-water window for ``pid`` on ``device`` at its bytes now; return them."""
        key = str(pid)

        def reset(view: LedgerState, size: int | None) -> int | _Again:
            proc = device_of(view, device)["procs"].get(key)
            if proc is None:
                return 0
            now = process_bytes(proc)
            if proc["window"] != now:  # else the ledger stays as it is
                if size is None:
                    return _Again.WRITE
                state = self._reading.load(size, private=True)
                device_of(state, device)["procs"][key]["window"] = now
                self._reading.write(state, size)
            return now

        return self._settled(reset)

    def open_tree(self, device: int, pid: int) -> int:
        """Open a tree window for ``pid`` on ``device`` at its tree's bytes now; return them."""
        identity = _identity_of(pid)
        if identity is None:
            raise ValueError(f"process {pid} does not exist; it has no process tree")
        key = str(pid)

        def open_window(view: LedgerState, size: int | None) -> int | _Again:
            dev = device_of(view, device)
            now = tree_bytes(dev, key)
            window = dev["trees"].get(key)
            if window is None or window["window"] != now or window["start"] != identity:
                if size is None:
                    return _Again.WRITE
                state = self._reading.load(size, private=True)
                device_of(state, device)["trees"][key] = TreeWindow(start=identity, window=now)
                self._reading.write(state, size)
            return now

        return self._settled(open_window)


_OWN_IDENTITY: tuple[int, str] | None = None


def _identity_of(pid: int) -> str | None:
    """``pid``'s start token (``None``: no such process); this process's own, read once."""
    own = _OWN_IDENTITY
    if own is not None and own[0] == pid == own_pid():
        return own[1]
    if pid != own_pid():
        return read_start_token(pid)
    return _own_identity()


def _own_identity() -> str:
    """This process's start token (read once per process: it never changes)."""
    global _OWN_IDENTITY
    pid = own_pid()
    if _OWN_IDENTITY is None or _OWN_IDENTITY[0] != pid:
        identity = read_start_token(pid)
        assert identity is not None  # this process is running
        _OWN_IDENTITY = (pid, identity)
    return _OWN_IDENTITY[1]


_LEDGERS: dict[str, Ledger] = {}


def _forget_ledgers() -> None:
    # A forked child must not share the parent's lock descriptor (flock locks
    # belong to the open file, so parent and child would both "hold" it) nor a
    # thread lock another thread held at the fork; its pidfds are this process's copies.
    for ledger in _LEDGERS.values():
        ledger._reading.close()
    _LEDGERS.clear()


os.register_at_fork(after_in_child=_forget_ledgers)


def forget_ledger(path: str) -> None:
    """Close and forget this process's :class:`Ledger` for ``path`` (when its host exits)."""
    ledger = _LEDGERS.pop(path, None)
    if ledger is not None:
        ledger.close()


def ledger_at(path: str) -> Ledger:
    """This process's :class:`Ledger` for ``path`` (one per path, kept for reuse)."""
    ledger = _LEDGERS.get(path)
    if ledger is None:
        ledger = _LEDGERS[path] = Ledger(path)
    return ledger
