"""The read cell: how a worker acknowledges each task frame it reads (process layer).

Each worker shares one 8-byte word of memory with the pool (a ``memfd``, or an unlinked
temporary file elsewhere, mapped on both sides). As soon as the worker has read a task
frame, before it unpickles or runs anything, it stores there how many task frames it has
read and the task's id (:meth:`ReadCell.note`): one store, no system call, nothing for the
parent to wake up for. The parent looks only when it needs to (:meth:`ReadCell.read`): a
task at the head of a worker's queue whose frame is not acknowledged within
:data:`ACK_BOUND_S` was never read by the worker (another reader of its socket, such as a
thread a task started, took it), and a frame read in its place (the worker read the next
one) says the same at once. Either way the worker is lost, and the task never ran.

The count is kept modulo 2**24 and the id modulo 2**40, in one aligned word, so a reader
never sees one half of a store.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence

from gpupool._pool.channel import InheritedFd

__all__ = ["ACK_BOUND_S", "ReadCell"]

#: How long a task frame at the head of a worker's queue may go unacknowledged (counted
#: from when it became the head: written to an idle worker, or the task before it answered)
#: before the worker is taken for lost. A worker reads its next frame as soon as it answered.
ACK_BOUND_S = 5.0

_WORD = struct.Struct("=Q")
_COUNT_BITS = 24
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_ID_MASK = (1 << 40) - 1


class ReadCell:
    """One worker's read cell: made by the pool (:meth:`create`), passed to the worker as a
    descriptor it inherits (pickled while the worker is spawned), mapped by both."""

    __slots__ = ("_map",)

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, _WORD.size)

    @classmethod
    def create(cls) -> tuple[ReadCell, int]:
        """A new cell, and the descriptor to pass to its worker (the caller closes it)."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("gpupool-read-cell", os.MFD_CLOEXEC)
        else:
            import tempfile  # the pool's side only, without memfd: a worker never loads it

            with tempfile.TemporaryFile() as file:
                fd = os.dup(file.fileno())
        try:
            os.ftruncate(fd, _WORD.size)
            return cls(fd), fd
        except BaseException:
            os.close(fd)
            raise

    # -- the worker's side -------------------------------------------------------------

    def note(self, count: int, task_id: int) -> None:
        """The worker read its ``count``-th task frame, that of ``task_id``."""
        _WORD.pack_into(self._map, 0, ((task_id & _ID_MASK) << _COUNT_BITS) | (count & _COUNT_MASK))

    # -- the pool's side ---------------------------------------------------------------

    def read(self, answered: int, sent: Sequence[int]) -> bool | None:
        """Whether the worker read the frame after the ``answered`` ones it answered: the
        first of ``sent`` (the ids of the task frames sent after those, in order). ``None``:
        not yet; ``True``: it did (its last read is the frame of ``sent`` at its place);
        ``False``: it read a frame in its place (another reader took one of them: the
        worker's count no longer matches what was sent, for good)."""
        word = _WORD.unpack_from(self._map, 0)[0]
        ahead = (word - answered) & _COUNT_MASK
        if ahead == 0 or ahead >= 1 << (_COUNT_BITS - 1):
            return None
        if ahead > len(sent):
            return False
        return bool(sent[ahead - 1] & _ID_MASK == word >> _COUNT_BITS)

    def close(self) -> None:
        self._map.close()


class CellHandle(InheritedFd):
    """What the worker is given: the cell's descriptor, mapped there by :meth:`open`."""

    __slots__ = ()

    def open(self) -> ReadCell:
        try:
            return ReadCell(self.fd)
        finally:
            os.close(self.fd)
