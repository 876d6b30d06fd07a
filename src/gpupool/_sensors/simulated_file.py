"""The simulator's ledger file and its locks (I/O edge).

One room of :class:`~gpupool._sensors.simulated.Ledger`: the descriptor this
process holds on the ledger, what file it is, and the locks one operation
holds (a thread lock, since ``flock`` does not exclude two threads sharing
one descriptor, and the ``flock``, shared or exclusive). It reads and writes
the file's bytes; what they say, and whether a reading is still fresh, is
:class:`~gpupool._sensors.simulated_reading.LedgerReading`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading

from gpupool._errors import SensorError
from gpupool._sensors.simulated_state import SIMULATOR_ENV

__all__ = ["MAX_LEDGER_BYTES", "LedgerFile", "LedgerGoneError"]

#: The largest ledger read. A real one is a few KiB (a few hundred bytes per
#: device, process and refusal); a file past this is not a ledger, and reading
#: it whole (a sparse 2 GB file, say) would cost its size in memory.
MAX_LEDGER_BYTES = 16 * 1024 * 1024


class LedgerGoneError(SensorError):
    """The ledger file does not exist: its ``SimulatedHost`` block has exited (or never ran)."""


class LedgerFile:
    """The ledger's file as this process holds it open, and the locks of one operation.

    Its fields are written here only; the reading reads :attr:`fd` and
    :attr:`identity` to compare the file without its lock, and the ledger
    holds :attr:`thread_lock` around that comparison.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.thread_lock = threading.Lock()
        self.fd: int | None = None
        # What ``fd`` is (``fstat``'s device and inode): a task that closes every
        # descriptor (``os.closerange``) may leave another file on its number.
        self.identity: tuple[int, int] | None = None
        self._held_by: tuple[int, threading.Lock] = (-1, self.thread_lock)

    def close(self) -> None:
        """Close the file descriptor (reopened on the next operation); the caller holds
        :attr:`thread_lock`."""
        if self.is_ours():
            assert self.fd is not None
            os.close(self.fd)
        self.fd = None

    def is_ours(self) -> bool:
        """Whether ``fd`` is open on the ledger this object opened (not closed behind its
        back, its number then taken by another file)."""
        if self.fd is None:
            return False
        try:
            status = os.fstat(self.fd)
        except OSError:
            return False
        return (status.st_dev, status.st_ino) == self.identity

    def leave_parent(self) -> None:
        """In a forked child, start afresh: the inherited descriptor is the parent's open file,
        whose flock parent and child would both "hold", and the thread lock may have been
        held by another thread at the fork (asked by
        :meth:`~gpupool._sensors.simulated.Ledger._leave_parent`, which says when)."""
        self.thread_lock = threading.Lock()
        if self.is_ours():
            assert self.fd is not None
            with contextlib.suppress(OSError):
                os.close(self.fd)  # this process's copy only: the parent's lock stands
        self.fd = None

    def acquire(self, *, shared: bool) -> int:
        """Take the thread lock and the file lock (shared or exclusive); the ledger's size in
        bytes.

        Paired with :meth:`release` by the ledger's ``_Held`` (a plain object, not a
        generator: every reading of the card takes this path), which first leaves a parent's
        locks behind in a forked child.
        """
        lock = self.thread_lock
        lock.acquire()
        try:
            fd = self.fd
            if fd is None or not self.is_ours():
                fd = self.fd = self._open()  # the first time, or another file took its number
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                status = os.fstat(fd)
                if status.st_nlink == 0:  # unlinked by its host while we held it open
                    raise self.gone()
                if status.st_size > MAX_LEDGER_BYTES:
                    raise self.not_a_ledger(
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

    def release(self) -> None:
        """Give back the locks :meth:`acquire` took."""
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
            raise self.gone() from None
        except OSError as exc:
            raise self.not_a_ledger(f"it cannot be opened ({exc.strerror or exc})") from exc
        try:
            status = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise self.not_a_ledger(f"it cannot be read ({exc.strerror or exc})") from exc
        if not stat.S_ISREG(status.st_mode):
            os.close(fd)
            raise self.not_a_ledger("it is not a regular file")
        self.identity = (status.st_dev, status.st_ino)
        return fd

    def read(self, size: int) -> bytes:
        """The file's first ``size`` bytes, under the file lock."""
        assert self.fd is not None
        try:
            return os.pread(self.fd, size, 0)
        except OSError as exc:
            raise self.not_a_ledger(f"it cannot be read ({exc.strerror or exc})") from exc

    def write(self, data: bytes, size: int) -> None:
        """Overwrite the ledger in place with ``data``, valid JSON at every instant, under the
        exclusive lock (``size``: the file's length now).

        Renaming a fresh file over the ledger costs ~200 us on ext4; an
        in-place write costs a few. The text counts this write (the caller
        encodes it with :func:`~gpupool._sensors.simulated_state.encode_next`).
        The new text is padded with spaces to the old length (JSON ignores
        trailing whitespace) and written in one ``pwrite``, so a process killed
        at any point leaves either the old state or the new one, then the file
        is cut to the new length.
        """
        assert self.fd is not None
        padded = data.ljust(size)
        written = os.pwrite(self.fd, padded, 0)
        while written < len(padded):  # only on a full disk or an odd filesystem
            written += os.pwrite(self.fd, padded[written:], written)
        if len(data) < size:
            os.ftruncate(self.fd, len(data))

    def not_a_ledger(self, why: str) -> SensorError:
        """The error for a file that is not a simulated host's ledger, saying ``why``."""
        return SensorError(
            f"{SIMULATOR_ENV}={self.path!r} does not name a simulated host's ledger: {why}. "
            f"Unset {SIMULATOR_ENV} outside a gpupool.testing.SimulatedHost block, or "
            "point it at the ledger a SimulatedHost wrote."
        )

    def gone(self) -> LedgerGoneError:
        """The error for a ledger that no longer exists."""
        return LedgerGoneError(
            f"{SIMULATOR_ENV}={self.path!r} names a file that does not exist (the simulated "
            f"host's ledger is gone). {SIMULATOR_ENV} is set by "
            "gpupool.testing.SimulatedHost to its ledger while its block runs (child processes "
            "inherit it): that block has exited, or the variable was set by hand or left over. "
            "Run simulated work inside `with gpupool.testing.SimulatedHost(...)`, or unset "
            f"{SIMULATOR_ENV} to read the real cards."
        )
