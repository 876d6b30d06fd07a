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
instant leaves a valid ledger behind (see :meth:`Ledger._write`). A reading
that changes nothing (the card read, a window already where it would be set)
first compares the file's bytes with those this process read last, without
the ``flock`` (:meth:`Ledger._unchanged`), and where they differ takes the
``flock`` shared, so readers in several processes never wait for one
another; one that finds something to write reads again under the exclusive
lock (:meth:`Ledger._settled`). An operation costs a few to tens of
microseconds.

As the driver frees a dead process's memory, every operation first drops the
entries of processes that have exited (zombies included: the driver frees a
process's memory when it exits, not when it is reaped), and of processes whose
PID was reused (the start time recorded at first touch no longer matches).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import stat
import sys
import threading
from typing import TYPE_CHECKING, TypeVar

from gpupool._errors import SensorError
from gpupool._sensors.ancestry import read_ancestors
from gpupool._sensors.booking_rows import read_start_token
from gpupool._sensors.own_pid import own_pid
from gpupool._sensors.simulated_alive import Liveness
from gpupool._sensors.simulated_check import ledger_problem
from gpupool._sensors.simulated_state import (
    SIMULATOR_ENV,
    DeviceState,
    LedgerState,
    OutOfMemoryRecord,
    ProcessState,
    TreeWindow,
    device_of,
    device_used_bytes,
    drop_dead,
    encode_next,
    named_processes,
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

#: Bumped when the ledger's layout changes; a ledger of another version is refused.
LEDGER_VERSION = 1

#: The largest ledger read. A real one is a few KiB (a few hundred bytes per
#: device, process and refusal); a file past this is not a ledger, and reading
#: it whole (a sparse 2 GB file, say) would cost its size in memory.
MAX_LEDGER_BYTES = 16 * 1024 * 1024
#: The simulated host's booking table lives in this directory beside its ledger.
BOOKINGS_DIRECTORY = "bookings"

_T = TypeVar("_T")


class LedgerGoneError(SensorError):
    """The ledger file does not exist: its ``SimulatedHost`` block has exited (or never ran)."""


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
        self._ledger._release()


class Ledger:
    """Read and change one simulated host's ledger, one locked operation at a time.

    Get one with :func:`ledger_at`, which keeps one per path (``GPUPOOL_SIMULATOR``'s
    value) and process.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        self._fd: int | None = None
        # What ``_fd`` is (``fstat``'s device and inode): a task that closes every
        # descriptor (``os.closerange``) may leave another file on its number.
        self._file: tuple[int, int] | None = None
        self._layout: tuple[bool, tuple[str, ...]] | None = None
        self._liveness = Liveness()
        # The ledger's bytes as this process last read (and validated) or wrote them, and
        # their parse once asked for: shared by every reader (never changed), reused for
        # as long as the file holds the same bytes.
        self._raw: bytes | None = None
        self._parsed: LedgerState | None = None
        # The processes a shared reading names (asked of the liveness as the same set).
        self._named: tuple[LedgerState | None, set[tuple[int, str]]] = (None, set())
        self._held = _Held(self, shared=False)
        self._held_shared = _Held(self, shared=True)
        # Processes a reading under the shared lock found dead, for the next exclusive
        # one to drop (a dead identity stays dead: its PID's next process has another token).
        self._dead_seen: set[tuple[int, str]] = set()
        self._held_by: tuple[int, threading.Lock] = (-1, self._thread_lock)

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
            state, _ = self._current(size)
            os.unlink(self.path)
        self.close()
        return state

    def close(self) -> None:
        """Close the file descriptor and the pidfds (reopened on the next operation)."""
        with self._thread_lock:
            if self._descriptor_is_ours():
                assert self._fd is not None
                os.close(self._fd)
            self._fd = None
            self._liveness.close()

    def _descriptor_is_ours(self) -> bool:
        """Whether ``_fd`` is open on the ledger this object opened (not closed behind its
        back, its number then taken by another file)."""
        if self._fd is None:
            return False
        try:
            status = os.fstat(self._fd)
        except OSError:
            return False
        return (status.st_dev, status.st_ino) == self._file

    # -- the locked read-modify-write ----------------------------------------------------

    def _locked(self, *, shared: bool = False) -> _Held:
        """Hold the thread lock and the file lock (``with``); gives the ledger's size in bytes.

        ``shared``: the file lock in shared mode, for a reading that changes nothing (other
        processes' readings go on meanwhile; a change waits for it, and it for a change).
        """
        return self._held_shared if shared else self._held

    def _acquire(self, *, shared: bool) -> int:
        """Take the thread lock and the file lock (shared or exclusive); the ledger's size in
        bytes.

        Paired with :meth:`_release` by :class:`_Held` (a plain object, not a generator:
        every reading of the card takes this path).
        """
        self._leave_parent()
        lock = self._thread_lock
        lock.acquire()
        try:
            fd = self._fd
            if fd is None or not self._descriptor_is_ours():
                fd = self._fd = self._open()  # the first time, or another file took its number
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                status = os.fstat(fd)
                if status.st_nlink == 0:  # unlinked by its host while we held it open
                    raise self._gone()
                if status.st_size > MAX_LEDGER_BYTES:
                    raise self._not_a_ledger(
                        f"it holds {status.st_size} bytes, more than any ledger "
                        f"({MAX_LEDGER_BYTES})"
                    )
            except BaseException:
                fcntl.flock(fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            lock.release()
            raise
        self._held_by = (fd, lock)
        return status.st_size

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
        self._thread_lock = threading.Lock()
        if self._descriptor_is_ours():
            assert self._fd is not None
            with contextlib.suppress(OSError):
                os.close(self._fd)  # this process's copy only: the parent's lock stands
        self._fd = None
        self._liveness.close()  # this process's copies of the parent's pidfds
        self._liveness = Liveness()

    def _release(self) -> None:
        """Give back the locks :meth:`_acquire` took."""
        fd, lock = self._held_by
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            lock.release()

    def _open(self) -> int:
        """Open the ledger; anything but a regular file is refused without reading it."""
        try:
            # O_NONBLOCK: a FIFO named here must not block the open.
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise self._gone() from None
        except OSError as exc:
            raise self._not_a_ledger(f"it cannot be opened ({exc.strerror or exc})") from exc
        try:
            status = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise self._not_a_ledger(f"it cannot be read ({exc.strerror or exc})") from exc
        if not stat.S_ISREG(status.st_mode):
            os.close(fd)
            raise self._not_a_ledger("it is not a regular file")
        self._file = (status.st_dev, status.st_ino)
        return fd

    def _not_a_ledger(self, why: str) -> SensorError:
        return SensorError(
            f"{SIMULATOR_ENV}={self.path!r} does not name a simulated host's ledger: {why}. "
            f"Unset {SIMULATOR_ENV} outside a gpupool.testing.SimulatedHost block, or "
            "point it at the ledger a SimulatedHost wrote."
        )

    def _gone(self) -> LedgerGoneError:
        return LedgerGoneError(
            f"{SIMULATOR_ENV}={self.path!r} names a file that does not exist (the simulated "
            f"host's ledger is gone). {SIMULATOR_ENV} is set by "
            "gpupool.testing.SimulatedHost to its ledger while its block runs (child processes "
            "inherit it): that block has exited, or the variable was set by hand or left over. "
            "Run simulated work inside `with gpupool.testing.SimulatedHost(...)`, or unset "
            f"{SIMULATOR_ENV} to read the real cards."
        )

    def _load(self, size: int, *, private: bool) -> LedgerState:
        """The state the file holds, its bytes validated once whoever wrote them.

        ``private``: a copy the caller may change; else the parse shared by this
        process's readers, kept while the file holds the same bytes (never change it).
        """
        assert self._fd is not None
        try:
            raw = os.pread(self._fd, size, 0)
        except OSError as exc:
            raise self._not_a_ledger(f"it cannot be read ({exc.strerror or exc})") from exc
        if raw != self._raw:
            parsed = self._parse(raw)
            self._raw, self._parsed = raw, None if private else parsed
            return parsed
        if not private and self._parsed is not None:
            return self._parsed
        state: LedgerState = json.loads(raw)  # validated before, or written by this process
        if not private:
            self._parsed = state
        return state

    def _parse(self, raw: bytes) -> LedgerState:
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise self._not_a_ledger(f"it is not JSON ({exc})") from None
        if not isinstance(value, dict) or "version" not in value:
            raise self._not_a_ledger("it is JSON but not a ledger (no version)")
        if value["version"] != LEDGER_VERSION:
            raise SensorError(
                f"the simulated host's ledger {self.path} has version {value['version']!r}; "
                f"this gpupool reads version {LEDGER_VERSION}"
            )
        problem = ledger_problem(value)
        if problem is not None:
            raise self._not_a_ledger(f"it is not a well-formed ledger ({problem})")
        state: LedgerState = value  # type: ignore[assignment]
        return state

    def _current(self, size: int) -> tuple[LedgerState, bool]:
        """A private copy of the state, dead processes dropped; whether any were."""
        state = self._load(size, private=True)
        return state, drop_dead(state, self._liveness.dead(named_processes(state)))

    def _view(self, size: int) -> LedgerState:
        """The shared state, dead processes dropped (and the ledger written if any were),
        under the exclusive lock.

        While the file holds the same bytes and no process it names has exited
        (one ``poll`` of their pidfds), this costs a read of the file and no parse.
        """
        state, dead = self._look(size)
        if self._dead_seen:
            dead |= self._dead_seen
            self._dead_seen = set()
        if not dead:
            return state
        private = self._load(size, private=True)
        if not drop_dead(private, dead):
            return state  # found dead under the shared lock, and dropped by another since
        self._write(private, size)
        self._parsed = private  # from now on shared, as the file holds it
        return private

    def _view_shared(self, size: int) -> LedgerState | None:
        """As :meth:`_view`, under the shared lock, where nothing may be written: ``None``
        when a dead process has to be dropped (kept for the exclusive reading that follows)."""
        state, dead = self._look(size)
        if not dead:
            return state
        self._dead_seen |= dead
        return None

    def _unchanged(self) -> LedgerState | None:
        """The shared reading, where the file still holds exactly the bytes it was made from
        and no process it names has exited; else ``None`` (read under the file lock).

        The file is compared without its lock: a change is written in place, so a read
        that overlaps one or several may mix their bytes (the kernel copies the page cache
        to a reader while a writer copies into it). Every write counts itself in the
        ledger's first field (:func:`encode_next`), so the file never holds the same
        bytes twice: a read that comes out equal to the bytes read before saw that count,
        which no write had yet replaced as it was read, and no later state restored by a
        change and its undoing can pass for the earlier one. A longer or shorter file
        reads unequal. Four system calls (``getpid`` by the
        caller, ``fstat``, ``pread``, ``poll``), and no wait for another process.
        """
        raw, fd = self._raw, self._fd
        if raw is None or fd is None:
            return None
        try:
            status = os.fstat(fd)
            if (status.st_dev, status.st_ino) != self._file or status.st_nlink == 0:
                return None  # another file took the number, or the host removed the ledger
            if os.pread(fd, len(raw) + 1, 0) != raw:
                return None
        except OSError:
            return None
        state = self._parsed
        if state is None:  # bytes this process wrote, or parsed for a change: parsed again
            state = self._parsed = json.loads(raw)
        if self._named[0] is not state:
            self._named = (state, named_processes(state))
        dead = self._liveness.dead(self._named[1])
        if dead:
            self._dead_seen |= dead
            return None
        return state

    def _look(self, size: int) -> tuple[LedgerState, set[tuple[int, str]]]:
        """The shared state as the file holds it, and the processes it names that are dead."""
        state = self._load(size, private=False)
        if self._named[0] is not state:
            self._named = (state, named_processes(state))
        return state, self._liveness.dead(self._named[1])

    def _settled(self, step: Callable[[LedgerState, int | None], _T | _Again]) -> _T:
        """``step`` on the state now (``size`` ``None``: it may not write, and answers
        :data:`_Again.WRITE` where it has to): on the reading this process already holds
        where the file still holds its bytes (:meth:`_unchanged`), else under the shared
        lock; then, if it has to write or a dead process has to be dropped, under the
        exclusive lock.

        A reading that changes nothing waits for no other reading, in any process.
        """
        if self._pid != own_pid():
            self._leave_parent()
        with self._thread_lock:
            state = self._unchanged()
            if state is not None:
                result = step(state, None)
                if result is not _Again.WRITE:
                    return result
        with self._locked(shared=True) as size:
            state = self._view_shared(size)
            if state is not None:
                result = step(state, None)
                if result is not _Again.WRITE:
                    return result
        with self._locked() as size:
            result = step(self._view(size), size)
            assert result is not _Again.WRITE, "a step under the exclusive lock writes itself"
            return result

    def _write(self, state: LedgerState, size: int) -> None:
        """Overwrite the ledger in place, valid JSON at every instant.

        Renaming a fresh file over the ledger costs ~200 us on ext4; an
        in-place write costs a few. The text counts this write (:func:`encode_next`).
        The new text is padded with spaces to the old length (JSON ignores
        trailing whitespace) and written in one ``pwrite``, so a process killed
        at any point leaves either the old state or the new one, then the file
        is cut to the new length.
        """
        assert self._fd is not None
        data = encode_next(state)
        padded = data.ljust(size)
        written = os.pwrite(self._fd, padded, 0)
        while written < len(padded):  # only on a full disk or an odd filesystem
            written += os.pwrite(self._fd, padded[written:], written)
        if len(data) < size:
            os.ftruncate(self._fd, len(data))
        self._raw, self._parsed = data, None

    def _apply(self, change: Callable[[LedgerState], _T], *, writes: bool) -> _T:
        """Run ``change`` on the current state under the lock, after dropping dead processes.

        The state is written back when ``writes`` is true or when a dead
        process was dropped.
        """
        with self._locked() as size:
            state, pruned = self._current(size)
            result = change(state)
            if writes or pruned:
                self._write(state, size)
            return result

    # -- operations ------------------------------------------------------------------------

    def snapshot(self) -> LedgerState:
        """The whole state now, dead processes dropped (a copy: changing it changes nothing)."""

        def copy(state: LedgerState, size: int | None) -> LedgerState:
            assert self._raw is not None  # the bytes ``state`` was read from
            copied: LedgerState = json.loads(self._raw)
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
                state = self._load(size, private=True)
                device_of(state, device)["procs"][key]["window"] = now
                self._write(state, size)
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
                state = self._load(size, private=True)
                device_of(state, device)["trees"][key] = TreeWindow(start=identity, window=now)
                self._write(state, size)
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
        ledger._liveness.close()
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
