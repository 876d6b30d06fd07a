"""The answer frame and the parent's checks of it (:mod:`gpupool._pool.wire`), on a socket pair.

The worker's writer and the parent's reader meet on a real socket here; the
faults the checks name are those a forked child or a scribbling library
would cause (``tests/faults/test_forking_tasks.py`` has them on real workers).
"""

from __future__ import annotations

import pickle
import socket

import pytest

from gpupool._core.peak import PeakReport
from gpupool._pool import wire
from gpupool._pool.channel import Channel, ChannelCorrupt

WORKER_PID = 4242


def _one_answer(channel: Channel) -> wire.Answer:
    frames = channel.receive()
    assert len(frames) == 1
    return wire.parse_answer(frames[0])


def _check(answer: wire.Answer, *, ready: bool = True, running: int | None = 7) -> None:
    wire.check_answer(answer, worker_pid=WORKER_PID, ready=ready, running=running)


def test_an_answer_round_trips_with_its_task_and_pid(pair: tuple[socket.socket, Channel]):
    """What the worker sends is what the parent reads: pid, task, kind, report, payload."""
    worker, channel = pair
    payload = pickle.dumps(list(range(10_000)))
    report = PeakReport(
        device=0, device_peak_bytes=3 << 30, device_source="simulator", rejected_readings=("x",)
    )
    wire.send_answer(worker.fileno(), WORKER_PID, 7, "ok", wire.report_values(report), payload)
    answer = _one_answer(channel)
    assert (answer.pid, answer.task_id, answer.kind, answer.peak) == (
        WORKER_PID,
        7,
        "ok",
        report,
    )
    assert pickle.loads(answer.payload) == list(range(10_000))
    _check(answer)  # the running task's own answer passes


def test_an_answer_for_a_task_the_worker_is_not_running_is_its_fault(
    pair: tuple[socket.socket, Channel],
):
    """Task 8's answer while the worker runs task 7 (or nothing) is a protocol fault
    naming both tasks."""
    worker, channel = pair
    wire.send_answer(worker.fileno(), WORKER_PID, 8, "ok", None, pickle.dumps(1))
    answer = _one_answer(channel)
    with pytest.raises(wire.ProtocolFault, match=r"about task 8, which .* \(it runs task 7\)"):
        _check(answer, running=7)
    with pytest.raises(wire.ProtocolFault, match=r"about task 8, .* \(it runs no task\)"):
        _check(answer, running=None)


def test_an_answer_from_another_pid_is_the_workers_fault(pair: tuple[socket.socket, Channel]):
    """The right task's answer from another PID is refused, naming that PID."""
    worker, channel = pair
    wire.send_answer(worker.fileno(), 999, 7, "ok", None, pickle.dumps(1))
    with pytest.raises(wire.ProtocolFault, match=r"from pid 999, not from the worker"):
        _check(_one_answer(channel))


def test_a_second_ready_is_the_workers_fault(pair: tuple[socket.socket, Channel]):
    """``ready`` is said once, before any task: a ready worker saying it again is at fault."""
    worker, channel = pair
    wire.send_answer(worker.fileno(), WORKER_PID, wire.NO_TASK, "ready", {}, b"")
    answer = _one_answer(channel)
    _check(answer, ready=False, running=None)
    with pytest.raises(wire.ProtocolFault, match="already ready"):
        _check(answer, ready=True, running=None)


def test_a_frame_that_is_not_an_answer_is_refused_before_its_body_is_read(
    pair: tuple[socket.socket, Channel],
):
    """A frame claiming 2 GiB whose first bytes are not an answer's: the channel says so
    at once, quoting them, without waiting for (or making room for) the 2 GiB."""
    worker, channel = pair
    worker.sendall(b"\x7f\xff\xff\xf0" + b"garbage!")
    with pytest.raises(ChannelCorrupt, match=r"2147483632 bytes beginning b'garbage!'"):
        channel.receive()
    assert channel.corrupt is not None


def test_answers_before_the_garbage_are_returned_first(pair: tuple[socket.socket, Channel]):
    """A good answer, then garbage: the answer comes out, and the channel says it is corrupt."""
    worker, channel = pair
    wire.send_answer(worker.fileno(), WORKER_PID, 7, "ok", None, pickle.dumps("right"))
    worker.sendall(b"\xff\xff\xff\xf0")
    frames = channel.receive()
    assert [pickle.loads(wire.parse_answer(f).payload) for f in frames] == ["right"]
    assert channel.corrupt == "a frame of negative length -16: not an answer"
    with pytest.raises(ChannelCorrupt):
        channel.receive()


def _frame_bytes(task_id: int, payload: bytes) -> bytes:
    """The bytes ``send_answer`` writes for one answer (its frame header included)."""
    reader, writer = socket.socketpair()
    with reader, writer:
        wire.send_answer(writer.fileno(), WORKER_PID, task_id, "ok", None, payload)
        writer.shutdown(socket.SHUT_WR)
        data = bytearray()
        while chunk := reader.recv(65536):
            data += chunk
    return bytes(data)


def test_bytes_written_into_an_answer_break_its_envelope(pair: tuple[socket.socket, Channel]):
    """Another writer's 8 bytes land inside an answer: the frame read (its declared length)
    no longer ends as it began, and the parser refuses it rather than hand a spoilt
    payload to the task."""
    worker, channel = pair
    whole = _frame_bytes(7, pickle.dumps(b"x" * 64))
    worker.sendall(whole[:40] + b"INTRUDER" + whole[40:-8])
    frames = channel.receive()
    assert len(frames) == 1
    with pytest.raises(wire.ProtocolFault, match="does not end as it began"):
        wire.parse_answer(frames[0])


def test_a_header_that_names_a_class_is_not_an_answer():
    """The header is plain values: one that would import and call anything is refused."""
    header = pickle.dumps(("ok", {"x": Exception("no")}))
    prefix = wire._PREFIX.pack(wire.ANSWER_MAGIC, WORKER_PID, 7, len(header))
    frame = bytearray(prefix + header + wire._TRAILER.pack(b"GPz1", WORKER_PID, 7))
    with pytest.raises(wire.ProtocolFault, match="header does not unpickle"):
        wire.parse_answer(frame)


def test_a_task_frame_carries_its_id():
    """The parent's task frame: the worker reads the task id and the call after it."""
    message = wire.task_prefix(12) + pickle.dumps(("fn", (1,), {}))
    task = wire.read_task(message)
    assert task is not None
    task_id, call = task
    assert task_id == 12 and pickle.loads(call) == ("fn", (1,), {})
    assert wire.read_task(b"gpupool-allocator-cap:123") is None


def test_a_queued_task_frame_is_told_apart_and_still_read():
    """A task sent behind a running one is marked so the worker can decline it; it reads as
    any task frame."""
    queued = wire.task_prefix(7, queued=True) + pickle.dumps(("fn", (), {}))
    plain = wire.task_prefix(7) + pickle.dumps(("fn", (), {}))
    assert wire.is_queued_task(queued) and not wire.is_queued_task(plain)
    task = wire.read_task(queued)
    assert task is not None and task[0] == 7


def _answer_frame(task_id: int, values: tuple[object, ...], kind: str = "ok") -> bytearray:
    header = pickle.dumps((kind, values))
    prefix = wire._PREFIX.pack(wire.ANSWER_MAGIC, WORKER_PID, task_id, len(header))
    return bytearray(prefix + header + wire._TRAILER.pack(b"GPz1", WORKER_PID, task_id))


def test_a_report_parsed_once_is_the_same_report_for_the_same_header():
    """Tasks of one key often report the same figures: the second answer with the same header
    gets the report the first one's parse made, and a different header gets its own."""
    wire._TASK_HEADERS.clear()
    report = PeakReport(device=0, device_peak_bytes=3 << 30, device_source="simulator")
    first = wire.parse_answer(_answer_frame(7, wire.report_values(report)))
    again = wire.parse_answer(_answer_frame(8, wire.report_values(report)))
    other = PeakReport(device=0, device_peak_bytes=4 << 30, device_source="simulator")
    third = wire.parse_answer(_answer_frame(9, wire.report_values(other)))
    assert first.peak == report and again.peak is first.peak
    assert (first.task_id, again.task_id, third.task_id) == (7, 8, 9)
    assert third.peak == other and third.peak is not first.peak


def test_the_parsed_headers_kept_are_bounded():
    """However many different reports come, at most ``_TASK_HEADERS_LIMIT`` are kept; a
    header that is not an answer's is never kept."""
    wire._TASK_HEADERS.clear()
    for peak in range(3 * wire._TASK_HEADERS_LIMIT):
        report = PeakReport(device=0, device_peak_bytes=peak, device_source="simulator")
        parsed = wire.parse_answer(_answer_frame(peak, wire.report_values(report)))
        assert parsed.peak == report
        assert len(wire._TASK_HEADERS) <= wire._TASK_HEADERS_LIMIT
    wire._TASK_HEADERS.clear()
    with pytest.raises(wire.ProtocolFault, match="unknown kind"):
        wire.parse_answer(_answer_frame(1, (), kind="surprise"))
    with pytest.raises(wire.ProtocolFault, match="is not a tuple of the"):
        wire.parse_answer(_answer_frame(1, (1, 2)))
    assert wire._TASK_HEADERS == {}
