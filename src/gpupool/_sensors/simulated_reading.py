"""The simulator's ledger as this process last read it, and whether that is fresh (I/O edge).

One room of :class:`~gpupool._sensors.simulated.Ledger`: the ledger's bytes as
this process last read (and validated) or wrote them, their parse, the
processes that parse names and the liveness of those processes. A reading
that changes nothing is answered from here where the file still holds the
same bytes (:meth:`LedgerReading.unchanged`, without the file lock); else the
bytes are read under the lock the ledger holds
(:class:`~gpupool._sensors.simulated_file.LedgerFile`), and parsed and
validated only where they differ from those read last.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from gpupool._errors import SensorError
from gpupool._sensors.simulated_alive import Liveness
from gpupool._sensors.simulated_check import ledger_problem
from gpupool._sensors.simulated_state import (
    LedgerState,
    drop_dead,
    encode_next,
    named_processes,
)

if TYPE_CHECKING:
    from gpupool._sensors.simulated_file import LedgerFile

__all__ = ["LEDGER_VERSION", "LedgerReading"]

#: Bumped when the ledger's layout changes; a ledger of another version is refused.
LEDGER_VERSION = 1


class LedgerReading:
    """The ledger's state as this process last read or wrote it, and the dead processes it
    names.

    Its fields are written here only. Its readings and writes run under the file's thread
    lock, and all but :meth:`unchanged` under the file lock too (shared or exclusive, as
    each says), which the ledger holds; :meth:`unchanged` compares the file without it.
    """

    def __init__(self, file: LedgerFile) -> None:
        self._file = file
        self._liveness = Liveness()
        # The ledger's bytes as this process last read (and validated) or wrote them, and
        # their parse once asked for: shared by every reader (never changed), reused for
        # as long as the file holds the same bytes.
        self._raw: bytes | None = None
        self._parsed: LedgerState | None = None
        # The processes a shared reading names (asked of the liveness as the same set).
        self._named: tuple[LedgerState | None, set[tuple[int, str]]] = (None, set())
        # Processes a reading under the shared lock found dead, for the next exclusive
        # one to drop (a dead identity stays dead: its PID's next process has another token).
        self._dead_seen: set[tuple[int, str]] = set()

    @property
    def raw(self) -> bytes | None:
        """The bytes the reading was made from (``None``: none read yet)."""
        return self._raw

    def close(self) -> None:
        """Close the pidfds (reopened as they are asked for)."""
        self._liveness.close()

    def leave_parent(self) -> None:
        """In a forked child: the pidfds are this process's copies of the parent's; close
        them and watch afresh."""
        self._liveness.close()
        self._liveness = Liveness()

    def load(self, size: int, *, private: bool) -> LedgerState:
        """The state the file holds, its bytes validated once whoever wrote them.

        ``private``: a copy the caller may change; else the parse shared by this
        process's readers, kept while the file holds the same bytes (never change it).
        """
        raw = self._file.read(size)
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
            raise self._file.not_a_ledger(f"it is not JSON ({exc})") from None
        if not isinstance(value, dict) or "version" not in value:
            raise self._file.not_a_ledger("it is JSON but not a ledger (no version)")
        if value["version"] != LEDGER_VERSION:
            raise SensorError(
                f"the simulated host's ledger {self._file.path} has version "
                f"{value['version']!r}; this gpupool reads version {LEDGER_VERSION}"
            )
        problem = ledger_problem(value)
        if problem is not None:
            raise self._file.not_a_ledger(f"it is not a well-formed ledger ({problem})")
        state: LedgerState = value  # type: ignore[assignment]
        return state

    def current(self, size: int) -> tuple[LedgerState, bool]:
        """A private copy of the state, dead processes dropped; whether any were."""
        state = self.load(size, private=True)
        return state, drop_dead(state, self._liveness.dead(named_processes(state)))

    def view(self, size: int) -> LedgerState:
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
        private = self.load(size, private=True)
        if not drop_dead(private, dead):
            return state  # found dead under the shared lock, and dropped by another since
        self.write(private, size)
        self._parsed = private  # from now on shared, as the file holds it
        return private

    def view_shared(self, size: int) -> LedgerState | None:
        """As :meth:`view`, under the shared lock, where nothing may be written: ``None``
        when a dead process has to be dropped (kept for the exclusive reading that follows)."""
        state, dead = self._look(size)
        if not dead:
            return state
        self._dead_seen |= dead
        return None

    def unchanged(self) -> LedgerState | None:
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
        file = self._file
        raw, fd = self._raw, file.fd
        if raw is None or fd is None:
            return None
        try:
            status = os.fstat(fd)
            if (status.st_dev, status.st_ino) != file.identity or status.st_nlink == 0:
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
        state = self.load(size, private=False)
        if self._named[0] is not state:
            self._named = (state, named_processes(state))
        return state, self._liveness.dead(self._named[1])

    def write(self, state: LedgerState, size: int) -> None:
        """Write ``state`` over the ledger (:meth:`LedgerFile.write
        <gpupool._sensors.simulated_file.LedgerFile.write>`: in place, valid at every
        instant), counting the write (:func:`encode_next`), under the exclusive lock; the
        reading is now the bytes written, parsed again when asked for."""
        data = encode_next(state)
        self._file.write(data, size)
        self._raw, self._parsed = data, None
