"""What the pool and a worker say about tasks, and the parent's checks of it (process layer).

Both directions use the frames of :class:`multiprocessing.connection.Connection`
(:mod:`gpupool._pool.channel`). The parent sends a task as one frame::

    b"GPt1" | task id (8 bytes, signed) | the pickled call

or, for a task queued behind the one the worker runs (sent before that one
ended), ``b"GPq1"`` in place of ``b"GPt1"``: the worker declines it (answers
``"declined"`` without running it) when the task before it ended in a device
out-of-memory, since its booking was made before that was known.

(beside it, on the same channel: the allocator cap of the next task, and an
empty frame that asks the worker to exit; a worker acknowledges each task
frame it reads in memory shared with the pool, not on the wire:
:mod:`gpupool._pool.acks`). A frame that does not begin as one of these is
not the pool's (another reader of the socket cut into the stream): the worker
reads no further and exits. A worker sends every answer as
one frame, which names the task it is about and the worker's PID at both
ends::

    b"GPa1" | pid (8) | task id (8; -1: none) | header length (4) | header | payload
    | b"GPz1" | pid (8) | task id (8)

The header is plain pickle of ``(kind, report)``: plain values only, read
with an unpickler that refuses every global, so the parent learns what
happened even when the payload cannot be unpickled. ``kind`` is ``"ready"``
or ``"init"`` (about no task; the report a dict or ``None``) or ``"ok"``,
``"error"``, ``"oom"``, ``"unpickle"``, ``"declined"`` (about the task the worker runs; the
report the task's :class:`~gpupool._core.peak.PeakReport` as a tuple of its
fields in order, or ``None``). The payload (a pickled result or exception)
is sliced out of the frame, never copied.

The parent takes an answer only from its worker's PID, only about the task
that worker runs, and once; anything else (bytes that are not an answer,
an answer that does not end as it began, a second answer, a second
``ready``) is a :class:`ProtocolFault` of that worker. One frame per answer,
marked at both ends, means bytes another process writes into the stream
cannot pass for an answer: they break a frame's envelope, or the frame after.
"""

# No postponed annotations here: a named tuple's string annotations are compiled as it is made,
# which a worker would pay at every start.

import collections
import io
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from gpupool._core.peak import PeakReport
from gpupool._pool.channel import _LARGE, _SMALL, drop_written, frame_header

__all__ = [
    "ANSWER_MAGIC",
    "NoRoomForFrame",
    "MIN_ANSWER_BYTES",
    "NO_TASK",
    "Answer",
    "ProtocolFault",
    "check_answer",
    "describe",
    "is_queued_task",
    "parse_answer",
    "read_frame",
    "read_task",
    "report_values",
    "send_answer",
    "task_id_of",
    "task_prefix",
]

ANSWER_MAGIC = b"GPa1"
_TRAILER_MAGIC = b"GPz1"
_TASK_MAGIC = b"GPt1"
_QUEUED_MAGIC = b"GPq1"
_PREFIX = struct.Struct("!4sqqI")
_TRAILER = struct.Struct("!4sqq")
_TASK = struct.Struct("!4sq")
#: How a frame from the pool begins: a task, a queued task, an allocator cap
#: (``gpupool-allocator-cap:``).
_POOL_MAGICS = frozenset({_TASK_MAGIC, _QUEUED_MAGIC, b"gpup"})
_MAGIC_BYTES = 4

#: The task id of an answer about no task (``ready``, ``init``).
NO_TASK = -1
#: The smallest frame that can be an answer: its envelope with an empty header and payload.
MIN_ANSWER_BYTES = _PREFIX.size + _TRAILER.size

_TASK_KINDS = frozenset({"ok", "error", "oom", "unpickle", "declined"})
_WORKER_KINDS = frozenset({"ready", "init"})
#: How many bytes of what arrived a fault quotes.
_QUOTE_BYTES = 32

#: A task's report travels as the values of these fields of :class:`PeakReport`, in order.
_REPORT_FIELDS = PeakReport._fields
#: A task's report as the worker sends it: its fields' values, in order (a plain tuple,
#: which the header's unpickler takes, not the named one).
report_values: Callable[[PeakReport], tuple[Any, ...]] = tuple


class ProtocolFault(Exception):
    """What a worker sent is not the answer the parent waits for; the message says what came."""


class Answer(NamedTuple):
    """One answer, as parsed: who sent it, about which task, and its payload (a view).
    ``report`` is a worker's (``ready``, ``init``), ``peak`` a task's report."""

    pid: int
    task_id: int | None
    kind: str
    report: dict[str, Any] | None
    payload: memoryview
    peak: PeakReport | None = None


def describe(data: bytes | bytearray | memoryview) -> str:
    """``N bytes beginning b'...'``: what arrived, quoted for an error message."""
    view = memoryview(data).cast("B")
    return f"{view.nbytes} bytes beginning {bytes(view[:_QUOTE_BYTES])!r}"


# -- the parent's side ----------------------------------------------------------------------


def task_prefix(task_id: int, *, queued: bool = False) -> bytes:
    """What goes before a pickled call in its frame; ``queued``: the task is sent behind
    the one the worker runs, to be declined when that one runs out of device memory."""
    return _TASK.pack(_QUEUED_MAGIC if queued else _TASK_MAGIC, task_id)


#: A task's answer header (its kind and report) already parsed, by its bytes: tasks of one
#: key often report the very same figures, and a report is never changed once made. At most
#: :data:`_TASK_HEADERS_LIMIT` are kept (then it starts again, empty).
_TASK_HEADERS: dict[bytes, tuple[str, PeakReport | None]] = {}
_TASK_HEADERS_LIMIT = 64


class _PlainUnpickler(pickle.Unpickler):
    """Plain values only: a header that names a class or function is not one of ours."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the header names {module}.{name}")


def parse_answer(frame: bytearray) -> Answer:
    """Read one answer frame.

    Raises:
        ProtocolFault: the frame is not an answer: no envelope, an envelope that
            does not end as it began, or a header that is not ``(kind, report)``.
    """
    size = len(frame)
    if size < MIN_ANSWER_BYTES:
        raise ProtocolFault(f"{describe(frame)}, shorter than an answer: not an answer")
    magic, pid, task_id, header_bytes = _PREFIX.unpack_from(frame)
    if magic != ANSWER_MAGIC:
        raise ProtocolFault(f"{describe(frame)}: not an answer")
    header_end = _PREFIX.size + header_bytes
    payload_end = size - _TRAILER.size
    if header_end > payload_end:
        raise ProtocolFault(
            f"{describe(frame)}: not an answer (its header of {header_bytes} bytes "
            "runs past the frame)"
        )
    if _TRAILER.unpack_from(frame, payload_end) != (_TRAILER_MAGIC, pid, task_id):
        raise ProtocolFault(
            f"{describe(frame)}: not an answer (it does not end as it began: "
            "another process wrote into it)"
        )
    with memoryview(frame) as view:
        header = bytes(view[_PREFIX.size : header_end])
    known = _TASK_HEADERS.get(header)
    if known is not None:
        (kind, peak), report = known, None
    else:
        kind, report, peak = _parse_header(frame, header)
    return Answer(
        pid=pid,
        task_id=None if task_id == NO_TASK else task_id,
        kind=kind,
        report=report,
        payload=memoryview(frame)[header_end:payload_end],
        peak=peak,
    )


def _parse_header(
    frame: bytearray, header: bytes
) -> tuple[str, dict[str, Any] | None, PeakReport | None]:
    """The answer's ``(kind, worker's report, task's report)`` from its header; a task's
    is remembered by the header's bytes (:data:`_TASK_HEADERS`)."""
    try:
        kind, report = _PlainUnpickler(io.BytesIO(header)).load()
    except Exception as exc:
        raise ProtocolFault(
            f"{describe(frame)}: not an answer (its header does not unpickle: "
            f"{type(exc).__name__}: {exc})"
        ) from None
    if kind in _TASK_KINDS:
        peak = None if report is None else _peak_report(frame, report)
        if len(_TASK_HEADERS) >= _TASK_HEADERS_LIMIT:
            _TASK_HEADERS.clear()
        _TASK_HEADERS[header] = (kind, peak)
        return kind, None, peak
    if kind in _WORKER_KINDS and (
        report is None or (isinstance(report, dict) and all(isinstance(k, str) for k in report))
    ):
        return kind, report, None
    raise ProtocolFault(f"{describe(frame)}: not an answer (an unknown kind {kind!r:.40})")


def _peak_report(frame: bytearray, values: object) -> PeakReport:
    """The task's report from the values a worker sent (:func:`report_values`).

    Raises:
        ProtocolFault: they are not a tuple of one value per field.
    """
    if not isinstance(values, tuple) or len(values) != len(_REPORT_FIELDS):
        raise ProtocolFault(
            f"{describe(frame)}: not an answer (its report is not a tuple of the "
            f"{len(_REPORT_FIELDS)} fields of a task's report: {values!r:.80})"
        )
    return PeakReport._make(values)


def check_answer(answer: Answer, *, worker_pid: int, ready: bool, running: int | None) -> None:
    """Whether ``answer`` is one the worker ``worker_pid`` may send now: from its own PID;
    ``ready`` or ``init`` once, before it is ready; about a task only the one it runs
    (``running``, ``None`` when idle), which it then answers once (the parent stops
    counting it as running).

    Raises:
        ProtocolFault: it is not; the message names what came and what was expected.
    """
    if (
        running is not None
        and answer.task_id == running
        and answer.pid == worker_pid
        and answer.kind in _TASK_KINDS
    ):
        return  # the usual answer: about the task it runs, from the worker itself
    said = f"an answer {answer.kind!r} about {_task(answer.task_id)}"
    if answer.pid != worker_pid:
        raise ProtocolFault(
            f"{said} from pid {answer.pid}, not from the worker (pid {worker_pid}): another "
            "process (a child the task forked?) wrote on the worker's channel"
        )
    if answer.kind in _WORKER_KINDS:
        if ready or answer.task_id is not None:
            raise ProtocolFault(f"{said}, from a worker that was already ready")
        return
    if answer.task_id is None or answer.task_id != running:
        runs = f"it runs {_task(running)}" if running is not None else "it runs no task"
        raise ProtocolFault(f"{said}, which this worker was not running ({runs})")


def _task(task_id: int | None) -> str:
    return "no task" if task_id is None else f"task {task_id}"


# -- the worker's side ----------------------------------------------------------------------


def read_frame(fd: int) -> bytearray | None:
    """Read one frame from the blocking descriptor ``fd`` into a buffer of the size its
    header announces; ``None`` at end of file before a frame began.

    Raises:
        EOFError: the other end closed in the middle of a frame.
        OSError: the socket failed.
    """
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    (size,) = _SMALL.unpack(head)
    if size == -1:
        large = _read_exactly(fd, 8)
        if large is None:
            raise EOFError("the pool closed its end in a frame's header")
        (size,) = _LARGE.unpack(large)
    elif size < 0:
        raise OSError(f"a frame of negative length {size} from the pool")
    if size == 0:
        return bytearray()
    # Its first bytes before room for the rest: a frame of ours begins with a magic of ours,
    # so bytes that are not (a stream another reader cut into) allocate nothing.
    magic = _read_exactly(fd, min(size, _MAGIC_BYTES))
    if magic is None:
        raise EOFError("the pool closed its end in a frame")
    if magic not in _POOL_MAGICS:
        raise OSError(f"a frame of {size} bytes beginning {magic!r}: not the pool's")
    try:
        body = bytearray(size)
    except MemoryError:
        rest = _skip_frame(fd, size - len(magic))
        raise NoRoomForFrame(
            f"no memory for a frame of {size} bytes", head=(magic + rest)[: _TASK.size]
        ) from None
    body[: len(magic)] = magic
    got = len(magic)
    with memoryview(body) as view:
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise EOFError(f"the pool closed its end after {got} of a frame's {size} bytes")
            got += n
    return body


class NoRoomForFrame(Exception):
    """The worker has no memory for a frame of ``size`` bytes (a task before it used it up):
    the frame was read past, its first bytes kept (``head``: a task frame's id)."""

    def __init__(self, message: str, *, head: bytes = b"") -> None:
        super().__init__(message)
        self.head = head


def _skip_frame(fd: int, size: int) -> bytes:
    """Read past a frame's ``size`` bytes in small pieces, keeping its first ``_TASK.size``."""
    head = b""
    got = 0
    while got < size:
        part = os.read(fd, min(size - got, 1 << 16))
        if not part:
            raise EOFError(f"the pool closed its end after {got} of a frame's {size} bytes")
        if len(head) < _TASK.size:
            head += part[: _TASK.size - len(head)]
        got += len(part)
    return head


def _read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes; ``None`` at end of file before the first."""
    data = os.read(fd, size)
    if not data:
        return None
    while len(data) < size:
        more = os.read(fd, size - len(data))
        if not more:
            raise EOFError("the pool closed its end in a frame's header")
        data += more
    return data


def read_task(message: bytes | bytearray) -> tuple[int, memoryview] | None:
    """The task id and the pickled call (a view) of a task frame; ``None`` for any other."""
    if len(message) < _TASK.size or not message.startswith((_TASK_MAGIC, _QUEUED_MAGIC)):
        return None
    _, task_id = _TASK.unpack_from(message)
    return task_id, memoryview(message)[_TASK.size :]


def task_id_of(message: bytes | bytearray) -> int:
    """The task id of a task frame; ``NO_TASK`` for any other frame."""
    if len(message) < _TASK.size or not message.startswith((_TASK_MAGIC, _QUEUED_MAGIC)):
        return NO_TASK
    task_id: int = _TASK.unpack_from(message)[1]
    return task_id


def is_queued_task(message: bytes | bytearray) -> bool:
    """Whether ``message`` is a task frame sent behind a running task (:func:`task_prefix`)."""
    return message.startswith(_QUEUED_MAGIC)


def send_answer(
    fd: int,
    pid: int,
    task_id: int,
    kind: str,
    report: dict[str, Any] | tuple[Any, ...] | None,
    payload: bytes | bytearray | memoryview,
) -> None:
    """Write one answer frame on the blocking descriptor ``fd``, the payload uncopied.

    Raises:
        OSError: the parent's end is closed.
    """
    header = pickle.dumps((kind, report))
    body = memoryview(payload).cast("B")
    envelope = _PREFIX.pack(ANSWER_MAGIC, pid, task_id, len(header))
    trailer = _TRAILER.pack(_TRAILER_MAGIC, pid, task_id)
    size = len(envelope) + len(header) + body.nbytes + len(trailer)
    _write_all(fd, [frame_header(size) + envelope + header, body, trailer])


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = collections.deque(memoryview(part).cast("B") for part in parts if len(part))
    while views:  # os.writev retries itself when a signal interrupts it (PEP 475)
        drop_written(views, os.writev(fd, views))
