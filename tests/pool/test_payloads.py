"""Large calls and results through the pickler and the frames (:mod:`gpupool._pool.by_value`,
:mod:`gpupool._pool.wire`, :mod:`gpupool._pool.channel`), on a real socket pair.

The parent's channel is non-blocking and the worker's end blocks, as in a pool: a frame of
several MiB is written by a thread on one end while the other reads it.
"""

from __future__ import annotations

import os
import pickle
import selectors
import socket
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpupool._core.peak import PeakReport
from gpupool._pool import by_value, wire
from gpupool._pool.by_value import dumps_call
from gpupool._pool.channel import SOCKET_BUFFER_BYTES, Channel, ChannelClosed, size_buffers

WORKER_PID = 4242
MiB = 1 << 20


def _in_thread(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _receive_frames(channel: Channel, count: int) -> list[bytearray]:
    """Wait (on the selector, as the dispatcher does) until ``count`` frames have arrived."""
    frames: list[bytearray] = []
    with selectors.DefaultSelector() as selector:
        selector.register(channel.fd, selectors.EVENT_READ)
        while len(frames) < count:
            selector.select()
            frames.extend(channel.receive())
    return frames


def _answer_round_trip(pair: tuple[socket.socket, Channel], payload: bytes) -> wire.Answer:
    worker, channel = pair
    writer = _in_thread(
        lambda: wire.send_answer(worker.fileno(), WORKER_PID, 7, "ok", None, payload)
    )
    (frame,) = _receive_frames(channel, 1)
    writer.join()
    answer = wire.parse_answer(frame)
    wire.check_answer(answer, worker_pid=WORKER_PID, ready=True, running=7)
    return answer


def test_a_result_of_several_mib_round_trips(pair: tuple[socket.socket, Channel]):
    """An 8 MiB bytes result, pickled as a worker pickles it, arrives whole and unpickles."""
    result = os.urandom(8 * MiB)
    answer = _answer_round_trip(pair, dumps_call(result))
    assert pickle.loads(answer.payload) == result


def test_numpy_arrays_round_trip_by_name(pair: tuple[socket.socket, Channel]):
    """Arrays of several MiB (pickle protocol 5 buffers) arrive equal, dtype and shape kept;
    they are pickled by name, not by value."""
    np = pytest.importorskip("numpy")
    arrays = [np.arange(3 * MiB // 8, dtype=np.float64).reshape(-1, 4), np.ones(5, np.int8)]
    data = dumps_call(arrays)
    assert b"cloudpickle" not in data
    got = pickle.loads(_answer_round_trip(pair, data).payload)
    assert [a.dtype for a in got] == [a.dtype for a in arrays]
    assert all(np.array_equal(a, b) for a, b in zip(got, arrays, strict=True))


def _write_all(channel: Channel, done: bool) -> None:
    """Flush ``channel`` whenever its socket can take more, until all is written."""
    with selectors.DefaultSelector() as selector:
        selector.register(channel.fd, selectors.EVENT_WRITE)
        while not done:
            selector.select()
            done = channel.flush()


def test_a_task_frame_of_several_mib_is_read_whole_by_the_worker(
    pair: tuple[socket.socket, Channel],
):
    """The parent's channel queues a 6 MiB call; the worker reads it into one buffer of the
    announced size, and reads the frame after it (the empty one that asks it to exit)."""
    worker, channel = pair
    call = dumps_call((len, (os.urandom(6 * MiB),), {}))
    frames: list[bytearray | None] = []
    reader = _in_thread(lambda: frames.extend(wire.read_frame(worker.fileno()) for _ in "ab"))
    channel.send(call, wire.task_prefix(3))
    _write_all(channel, channel.send(b""))
    reader.join()
    first, empty = frames
    assert first is not None and empty == bytearray()
    task = wire.read_task(first)
    assert task is not None
    task_id, body = task
    fn, args, kwargs = pickle.loads(body)
    assert (task_id, fn(*args, **kwargs)) == (3, 6 * MiB)


def test_frames_queued_together_are_written_in_order_and_whole(
    pair: tuple[socket.socket, Channel],
):
    """Frames queued without writing (``now=False``: tasks queued behind a busy worker) go
    out together at the next flush, small and large alike, each read whole and in order,
    however the socket splits the writes."""
    worker, channel = pair
    sizes = [10, 3 * MiB, 20, 70_000, 5]
    calls = [dumps_call((len, (b"x" * size,), {})) for size in sizes]
    frames: list[bytearray | None] = []
    reader = _in_thread(lambda: frames.extend(wire.read_frame(worker.fileno()) for _ in sizes))
    for task_id, call in enumerate(calls):
        assert channel.send(call, wire.task_prefix(task_id, queued=True), now=False) is False
    assert channel._out  # queued, not written yet
    _write_all(channel, channel.flush())
    reader.join()
    assert not channel._out
    results = []
    for frame in frames:
        assert frame is not None
        task = wire.read_task(frame)
        assert task is not None
        task_id, body = task
        fn, args, kwargs = pickle.loads(body)
        results.append((task_id, fn(*args, **kwargs)))
    assert results == list(enumerate(sizes))


def test_a_truncated_task_frame_is_an_error_not_a_task():
    """A frame whose sender closed before its announced length: ``EOFError`` (the worker
    exits); an end of file before any frame is ``None``."""
    worker, parent = socket.socketpair()
    with worker, parent:
        parent.sendall((1000).to_bytes(4, "big") + b"GPt1" + b"x" * 100)
        parent.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError, match="after 104 of a frame's 1000 bytes"):
            wire.read_frame(worker.fileno())
    worker, parent = socket.socketpair()
    with worker, parent:
        parent.shutdown(socket.SHUT_WR)
        assert wire.read_frame(worker.fileno()) is None


def test_a_truncated_answer_closes_the_channel(pair: tuple[socket.socket, Channel]):
    """The worker dies in the middle of an answer: the channel says so; no frame comes out."""
    worker, channel = pair
    frame = bytearray()
    reader, writer = socket.socketpair()
    with reader, writer:
        wire.send_answer(writer.fileno(), WORKER_PID, 7, "ok", None, b"r" * 4096)
        frame += reader.recv(65536)
    worker.sendall(bytes(frame[:-100]))
    worker.shutdown(socket.SHUT_WR)
    with pytest.raises(ChannelClosed, match="mid-message"):
        _receive_frames(channel, 1)


def test_a_report_that_is_not_a_task_report_is_the_workers_fault(
    pair: tuple[socket.socket, Channel],
):
    """A task's report is the tuple of a PeakReport's fields: a dict (the old form) or a
    tuple of another length is a protocol fault naming it."""
    worker, channel = pair
    good = wire.report_values(PeakReport(device=None, device_peak_bytes=None, device_source="none"))
    for report in ({"device": None}, good[:-1]):
        wire.send_answer(worker.fileno(), WORKER_PID, 7, "ok", report, b"")
        (frame,) = _receive_frames(channel, 1)
        with pytest.raises(wire.ProtocolFault, match=r"not a tuple of the \d+ fields"):
            wire.parse_answer(frame)


@pytest.fixture
def main_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """This process's ``__main__``, with a fresh shared namespace for by-value functions."""
    monkeypatch.setattr(by_value, "_main_ns", None)
    monkeypatch.setattr(by_value, "_main_sent", {})
    return sys.modules["__main__"]


def _main_function(main: types.ModuleType, source: str, name: str) -> types.FunctionType:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<script>", "exec"), vars(main), namespace)
    fn = namespace[name]
    fn.__module__ = "__main__"
    return types.FunctionType(fn.__code__, vars(main), name)


def test_a_function_of_main_goes_by_value_into_the_shared_namespace(
    pair: tuple[socket.socket, Channel],
    main_module: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
):
    """A function whose globals are ``__main__``'s travels by value (with a 2 MiB argument),
    brings the globals it reads, and lands in the receiver's one namespace for
    ``__main__``, where a value the receiver rebound since is kept."""
    monkeypatch.setattr(main_module, "PAYLOAD_TEST_SCALE", 3, raising=False)
    fn = _main_function(
        main_module, "def scaled(b):\n    return len(b) * PAYLOAD_TEST_SCALE\n", "scaled"
    )
    argument = os.urandom(2 * MiB)
    call = dumps_call((fn, (argument,), {}))
    got, args, _ = pickle.loads(_answer_round_trip(pair, call).payload)
    assert got.__globals__ is by_value.main_namespace({})
    assert args == (argument,) and got(*args) == 6 * MiB
    got.__globals__["PAYLOAD_TEST_SCALE"] = 5  # the receiver rebinds it (a task's `global`)
    again, _, _ = pickle.loads(dumps_call((fn, (b"ab",), {})))
    assert again(b"ab") == 10


def test_objects_of_main_and_of_no_module_are_noticed_while_pickling(
    main_module: types.ModuleType,
):
    """An instance of a class of ``__main__`` nested in a call, and a function whose module is
    ``None``, go by value; a call of importable functions and plain values goes by name."""
    namespace: dict[str, Any] = {}
    exec("class Point:\n    pass\n", vars(main_module), namespace)
    point_class = namespace["Point"]
    point_class.__module__ = "__main__"
    point = point_class()
    point.x = 1
    by_name = dumps_call((len, ([1, 2], {"k": b"v" * 100_000}), {}))
    assert b"cloudpickle" not in by_name
    nested = dumps_call((len, ([{"p": point}],), {}))
    assert b"cloudpickle" in nested and pickle.loads(nested)[1][0][0]["p"].x == 1
    orphan = types.FunctionType((lambda: 4).__code__, {})
    orphan.__module__ = None  # type: ignore[assignment]
    assert pickle.loads(dumps_call(orphan))() == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's caps")
def test_socket_buffers_are_sized_for_a_large_frame_and_pipes_are_left_alone():
    """Both buffers grow to what was asked (Linux doubles it) or to the kernel's cap; a
    descriptor that is not a socket is left as it is, no descriptor left open."""
    core = Path("/proc/sys/net/core")
    caps = [int((core / name).read_text()) for name in ("wmem_max", "rmem_max")]
    one, other = socket.socketpair()
    with one, other:
        size_buffers(one.fileno())
        got = [one.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
    assert got == [2 * min(SOCKET_BUFFER_BYTES, cap) for cap in caps]
    read_end, write_end = os.pipe()
    try:
        before = sorted(os.listdir("/proc/self/fd"))
        size_buffers(read_end)
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(read_end)
        os.close(write_end)
