"""The parent's end of a worker's socket: writes and reads that never block (process layer).

The dispatcher is one thread serving every worker, so nothing it does may
wait on one worker: a worker blocked sending a large result while the
dispatcher is blocked sending it the next call would freeze both for good.
Here the parent's end of the socket is non-blocking; a message that does
not fit the socket's buffer stays queued and is written as the worker
reads (the dispatcher's selector watches for the socket to be writable),
and a message is read piece by piece as it arrives. The worker keeps
plain blocking writes (:func:`gpupool._pool.wire.send_answer`) and reads
(:func:`gpupool._pool.wire.read_frame`): its end is its own. Both ends ask
for socket buffers of :data:`SOCKET_BUFFER_BYTES` (:func:`size_buffers`),
so that a frame of 1 MiB fits them.

Frames are those of :class:`multiprocessing.connection.Connection` (:func:`frame_header`).
A frame is read into one buffer, which the answer's payload is sliced out of, never
copied (:mod:`gpupool._pool.wire`).

A channel made with ``magic`` checks each frame as soon as its first bytes
arrive, before it makes room for the rest: a frame shorter than
``min_frame_bytes``, of a negative length, or whose body does not begin
with ``magic`` is not an answer, and the stream after it cannot be trusted
(:class:`ChannelCorrupt`). Bytes another process wrote on the worker's
socket therefore never make the parent allocate what their length claims.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import struct
from typing import Any

__all__ = [
    "SOCKET_BUFFER_BYTES",
    "Channel",
    "ChannelClosed",
    "ChannelCorrupt",
    "ChildEnd",
    "InheritedFd",
    "size_buffers",
]

#: Bytes asked of one ``read`` while a frame's header or a small frame is read.
_READ_CHUNK_BYTES = 256 * 1024
#: At most this many queued pieces go in one write (well under any IOV_MAX).
_WRITEV_MAX = 64
#: The send and receive buffers asked for on each end of a worker's socket, so a frame of
#: 1 MiB fits them (Linux doubles the figure for its bookkeeping, and caps it at
#: ``net.core.wmem_max`` and ``rmem_max``); the kernel holds that much only while bytes wait.
SOCKET_BUFFER_BYTES = 1024 * 1024

_SMALL = struct.Struct("!i")
_LARGE = struct.Struct("!Q")
_LARGE_ABOVE = 0x7FFFFFFF


class ChannelClosed(Exception):
    """The worker's end is closed (it exited, or was killed), or the socket failed."""


class ChannelCorrupt(ChannelClosed):
    """What arrived is not a frame of ours (the message quotes it): the stream is lost."""


def size_buffers(fd: int, size_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Ask for ``size_bytes`` send and receive buffers on the socket ``fd`` (the kernel caps
    them); nothing when ``fd`` is not a socket or the kernel refuses."""
    try:
        copy = os.dup(fd)
    except OSError:
        return
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return
    with sock:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, size_bytes)
            except OSError:
                pass


def frame_header(size: int) -> bytes:
    """The header ``Connection.send_bytes`` writes before ``size`` bytes."""
    if size > _LARGE_ABOVE:
        return _SMALL.pack(-1) + _LARGE.pack(size)
    return _SMALL.pack(size)


def drop_written(views: collections.deque[memoryview], written: int) -> None:
    """Take ``written`` bytes off the front of ``views`` (each released once written)."""
    while written:
        view = views[0]
        if written >= view.nbytes:
            written -= view.nbytes
            views.popleft()
            view.release()
        else:
            views[0] = view[written:]
            written = 0


class Channel:
    """Non-blocking framed I/O on the parent's end of one worker's connection.

    Only the dispatcher thread uses a channel. ``send`` queues a frame and
    writes what the socket takes now; ``flush`` writes more when the
    selector says the socket is writable; ``receive`` returns the complete
    frames read so far, keeping a partial one for the next call.
    """

    __slots__ = (
        "_body",
        "_body_at",
        "_closed",
        "_frames",
        "_head",
        "_magic",
        "_min_frame_bytes",
        "_out",
        "conn",
        "corrupt",
        "fd",
    )

    def __init__(self, conn: Any, *, magic: bytes = b"", min_frame_bytes: int = 0) -> None:
        self.conn = conn
        self.fd: int = conn.fileno()
        os.set_blocking(self.fd, False)
        size_buffers(self.fd)
        self._out: collections.deque[memoryview] = collections.deque()
        self._head = bytearray()
        self._body: bytearray | None = None
        self._body_at = 0
        self._frames: list[bytearray] = []
        # Why the channel closed (text only: an exception kept here would hold this
        # channel through its traceback's frames, and with it the worker's descriptors).
        self._closed: str | None = None
        # What arrived that was not a frame of ours, once it did (quoted): the frames read
        # before it are returned first, and every call after raises ChannelCorrupt.
        self.corrupt: str | None = None
        self._magic = magic
        self._min_frame_bytes = max(min_frame_bytes, len(magic))

    # -- writing -------------------------------------------------------------------------

    def send(
        self, payload: bytes | bytearray | memoryview, prefix: bytes = b"", *, now: bool = True
    ) -> bool:
        """Queue one frame, ``prefix`` then ``payload`` (not copied when large), and write
        what the socket takes now; ``True`` when all is written. ``now=False``: only queue
        it (the next :meth:`flush` writes the frames queued together, in one call).

        Raises:
            ChannelClosed: the worker's end is closed.
        """
        view = memoryview(payload).cast("B")
        size = len(prefix) + view.nbytes
        header = frame_header(size) + prefix
        if view.nbytes <= 16384:
            # One write for a small frame (no empty write when the frame is empty).
            self._out.append(memoryview(header + bytes(view)))
        else:
            self._out.append(memoryview(header))
            self._out.append(view)
        return self.flush() if now else False

    def flush(self) -> bool:
        """Write queued bytes until the socket is full; ``True`` when nothing is left queued.

        Raises:
            ChannelClosed: the worker's end is closed.
        """
        out = self._out
        while out:
            try:
                if len(out) == 1:
                    written = os.write(self.fd, out[0])
                else:  # the frames queued together, in one call
                    written = os.writev(self.fd, list(itertools.islice(out, _WRITEV_MAX)))
            except BlockingIOError:
                return False
            except OSError as exc:  # EPIPE, ECONNRESET, EBADF: the worker is gone
                raise ChannelClosed(str(exc)) from exc
            drop_written(out, written)
        return True

    def discard_output(self) -> None:
        """Drop what is queued (the worker is gone; nobody will read it)."""
        self._out.clear()

    # -- reading -------------------------------------------------------------------------

    def receive(self) -> list[bytearray]:
        """Read what the socket holds now; return the frames completed, oldest first.

        Raises:
            ChannelClosed: end of file (the worker's end closed), or the socket
                failed. Frames completed before the end are returned first: the
                error comes on the next call.
            ChannelCorrupt: what arrived is not a frame of ours; :attr:`corrupt`
                says what. As for the end, frames completed before come first.
        """
        if self.corrupt is not None:
            raise ChannelCorrupt(self.corrupt)
        if self._closed is not None:
            raise ChannelClosed(self._closed)
        try:
            self._read_available()
        except ChannelClosed as exc:
            self._closed = str(exc)
            if isinstance(exc, ChannelCorrupt):
                self.corrupt = str(exc)
            if not self._frames:
                raise
        frames, self._frames = self._frames, []
        return frames

    def _read_available(self) -> None:
        while True:
            if self._body is None:
                data = self._read(_READ_CHUNK_BYTES)
                if data is None:
                    return
                self._head += data
                self._split_head()
                if len(data) < _READ_CHUNK_BYTES and self._body is None:
                    # The socket held less than a read takes: it is empty now (the selector
                    # says when more comes), so no second read only to be told so.
                    return
            else:
                body = self._body
                view = memoryview(body)[self._body_at :]
                try:
                    got = os.readv(self.fd, [view])
                except BlockingIOError:
                    return
                except OSError as exc:
                    raise ChannelClosed(str(exc)) from exc
                finally:
                    view.release()
                if got == 0:
                    raise ChannelClosed("the worker closed its end mid-message")
                self._body_at += got
                if self._body_at == len(body):
                    self._frames.append(body)
                    self._body = None
                    self._body_at = 0
                    self._split_head()

    def _read(self, size: int) -> bytes | None:
        try:
            data = os.read(self.fd, size)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise ChannelClosed(str(exc)) from exc
        if not data:
            raise ChannelClosed("end of file")
        return data

    def _split_head(self) -> None:
        """Cut complete frames out of the bytes read ahead; start the body of a partial one."""
        head = self._head
        while self._body is None:
            if len(head) < 4:
                return
            (size,) = _SMALL.unpack_from(head)
            start = 4
            if size == -1:
                if len(head) < 12:
                    return
                (size,) = _LARGE.unpack_from(head, 4)
                start = 12
            elif size < 0:
                raise ChannelCorrupt(f"a frame of negative length {size}: not an answer")
            if self._magic and not self._frame_begins_well(start, size):
                return  # its first bytes are not here yet
            end = start + size
            if len(head) >= end:
                self._frames.append(bytearray(head[start:end]))
                del head[:end]
                continue
            body = bytearray(size)
            have = len(head) - start
            body[:have] = head[start:]
            head.clear()
            self._body = body
            self._body_at = have

    def _frame_begins_well(self, start: int, size: int) -> bool:
        """Whether the frame at ``start`` of the bytes read ahead begins as ours; ``False``
        while too few of its bytes are here to tell.

        Raises:
            ChannelCorrupt: it is too short, or does not begin with the magic.
        """
        head = self._head
        if size < self._min_frame_bytes:
            raise ChannelCorrupt(
                f"a frame of {size} bytes ({bytes(head[start : start + size])!r}), shorter "
                "than an answer: not an answer"
            )
        if len(head) < start + len(self._magic):
            return False
        if head[start : start + len(self._magic)] != self._magic:
            quoted = bytes(head[start : start + min(size, 32)])
            raise ChannelCorrupt(f"a frame of {size} bytes beginning {quoted!r}: not an answer")
        return True


class InheritedFd:
    """A descriptor a worker is given: duplicated into the worker as it is spawned, under
    its own number (as a ``multiprocessing`` connection's is), and rebuilt there as the
    same class."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_inherited, (type(self), reduction.DupFd(self.fd)))


def _inherited(cls: type[InheritedFd], dup: Any) -> InheritedFd:
    return cls(dup.detach())


class ChildEnd(InheritedFd):
    """The worker's end of its channel, as the worker is given it: the bare descriptor,
    without the module that defines connections (``multiprocessing.connection`` loads
    ``tempfile``, ``shutil`` and ``random``: a few milliseconds of every worker's start).
    The worker only reads and writes the descriptor."""

    __slots__ = ()

    def fileno(self) -> int:
        return self.fd
