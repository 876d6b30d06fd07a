"""The process layer under hostile payloads: no hang, no pickled backlog, no blind spot.

A test that failed (or hung) before the channel, reaper and worker start-up
of ``gpupool._pool`` were rewritten says how in its docstring.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import faulty
import pytest
from leakguard import LeakGuard, exited, wait_until

from gpupool import GpuPoolExecutor, WorkerLostError
from gpupool._pool import dispatcher as dispatcher_module
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = pytest.mark.faults

#: A guard against a hang, never a measurement: every wait here ends far sooner.
HANG_S = 120


def _host(cpus: int = 2) -> SimulatedHost:
    return SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=cpus, host_ram="64GiB")


@pytest.mark.parametrize("size", [300 * 1024, 1024 * 1024], ids=["300KiB", "1MiB"])
def test_large_arguments_and_results_in_flight_at_once_do_not_hang(guard: LeakGuard, size: int):
    """300 short tasks echoing a large payload: a second task is queued behind each busy
    worker while that worker sends its result (before: both sides blocked in send, for good)."""
    payload = os.urandom(size)
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures = [ex.submit(faulty.identity, payload) for _ in range(300)]
        done, not_done = concurrent.futures.wait(futures, timeout=HANG_S)
        guard.watch(ex)
    assert not not_done
    assert all(f.result() == payload for f in done)
    guard.assert_clean()


def test_chunked_map_over_200k_lines_does_not_hang(guard: LeakGuard):
    """``map(str.upper, lines, chunksize=5000)`` over 200,000 lines returns every line
    upper-cased, in order (before: it hung every time)."""
    lines = [
        f"line {i:06d} of the input, long enough to fill a socket buffer" for i in range(200_000)
    ]
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        results = ex.map(str.upper, lines, chunksize=5000, timeout=HANG_S)
        assert list(results) == [line.upper() for line in lines]
        guard.watch(ex)
    guard.assert_clean()


def test_waiting_calls_are_not_pickled_until_they_are_sent(tmp_path: Path):
    """Calls held back behind a busy pool are kept as objects, pickled once each when sent
    (before: every call was pickled at submit and the bytes kept until sent)."""
    gate = tmp_path / "go"
    faulty.CountsPickles.pickled = 0
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        blocker = ex.submit(faulty.wait_for_file, str(gate))
        futures = [ex.submit(faulty.size_of, faulty.CountsPickles(1024)) for _ in range(20)]
        assert wait_until(lambda: ex.statistics().workers_started == 1, HANG_S)
        pickled_while_waiting = faulty.CountsPickles.pickled
        gate.touch()
        assert blocker.result(timeout=HANG_S) is True
        assert [f.result(timeout=HANG_S) for f in futures] == [1024] * 20
    assert pickled_while_waiting == 0
    assert faulty.CountsPickles.pickled == 20


def test_a_call_that_cannot_be_pickled_fails_only_its_future():
    """An unpicklable argument fails its own future with the pickling error; the next works."""
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        bad = ex.submit(faulty.identity, threading.Lock())
        good = ex.submit(faulty.square, 4)
        assert isinstance(bad.exception(timeout=HANG_S), TypeError)
        assert good.result(timeout=HANG_S) == 16


def test_a_large_result_costs_the_parent_one_buffer_and_the_result():
    """A 64 MiB result: the parent's Python allocations peak near buffer + result (2x),
    not 3x (before: the whole message, then the payload copied out of it, then the result)."""
    size = 64 * 1024 * 1024
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        ex.submit(faulty.square, 2).result(timeout=HANG_S)  # a warm worker, imports done
        tracemalloc.start()
        try:
            result = ex.submit(os.urandom, size).result(timeout=HANG_S)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert len(result) == size
    assert peak_bytes < 2.5 * size


def test_a_dead_worker_is_seen_while_its_grandchild_holds_every_descriptor(tmp_path: Path):
    """A task forks a child that keeps all the worker's descriptors, then its worker dies:
    the future fails at once (before: it stayed pending until the grandchild exited)."""
    try:
        with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
            grandchild = ex.submit(faulty.fork_background, str(tmp_path), "g").result(HANG_S)
            error = ex.submit(faulty.exit_with, 5).exception(timeout=HANG_S)
            assert isinstance(error, WorkerLostError)
            assert error.exitcode == 5
            assert not exited(grandchild)  # the future did not wait for it
            assert ex.submit(faulty.square, 3).result(timeout=HANG_S) == 9
    finally:
        (tmp_path / "go").touch()


def test_shutdown_does_not_wait_for_a_background_process(tmp_path: Path, monkeypatch):
    """A good task left a background process holding the worker's pipes: shutdown still
    returns as soon as the worker exits (before: it waited the whole stop timeout)."""
    monkeypatch.setattr(dispatcher_module, "STOP_WAIT_S", 3 * HANG_S)
    try:
        with _host():
            ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
            ex.submit(faulty.fork_background, str(tmp_path), "g").result(HANG_S)
            t = threading.Thread(target=ex.shutdown, daemon=True)
            t.start()
            t.join(HANG_S)
            assert not t.is_alive()
    finally:
        (tmp_path / "go").touch()


@pytest.mark.parametrize("method", ["kill_workers", "terminate_workers"])
def test_stopping_the_workers_ends_what_their_tasks_started(tmp_path: Path, method: str):
    """``kill_workers()``/``terminate_workers()`` end a running task's background processes
    too, and the lost task's error names the pool as the sender of the signal (before: the
    background processes ran on, reparented to init, and SIGKILL was blamed on the OOM killer)."""
    gate = tmp_path / "never"
    try:
        with _host():
            ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
            background = ex.submit(faulty.start_background, str(tmp_path), "b").result(HANG_S)
            forked = ex.submit(faulty.fork_background, str(tmp_path), "f").result(HANG_S)
            running = ex.submit(faulty.wait_for_file, str(gate))
            assert wait_until(lambda: running.running(), HANG_S)
            getattr(ex, method)()
            error = running.exception(timeout=HANG_S)
            ex.shutdown()
        assert wait_until(lambda: exited(background) and exited(forked), HANG_S)
        assert isinstance(error, WorkerLostError)
        sig = signal.SIGKILL if method == "kill_workers" else signal.SIGTERM
        assert error.exitcode == -sig
        assert f"sent by the pool itself ({method}())" in str(error)
        assert "out-of-memory killer" not in str(error)
    finally:
        (tmp_path / "go").touch()


_PARENT = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
import faulty
from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost
with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="16GiB"):
    ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
    ex.submit(faulty.hold_the_gil, {directory!r})
    while not os.path.exists(os.path.join({directory!r}, "worker.pid")):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_die_with_a_sigkilled_parent_while_their_task_holds_the_gil(tmp_path: Path):
    """The parent is SIGKILLed while its worker backtracks in a regex (the GIL held): the
    worker is gone soon after (before: it ran on at a full core, an orphan)."""
    script = _PARENT.format(tests=str(Path(faulty.__file__).parent), directory=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], timeout=HANG_S, check=False)
    assert done.returncode == -signal.SIGKILL
    worker = int((tmp_path / "worker.pid").read_text())
    try:
        assert wait_until(lambda: exited(worker), HANG_S)
    finally:
        if not exited(worker):
            os.kill(worker, signal.SIGKILL)


_EMFILE = """
import errno, os, resource, sys, time
sys.path.insert(0, {tests!r})
import faulty
from gpupool import GpuPoolExecutor

def until(predicate):
    deadline = time.monotonic() + 120
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
def starve():  # no new descriptor can be opened from now on, whatever closes
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
def feed():
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

# A host-bounded pool (no card): nothing reads a sensor while descriptors are short.
ex = GpuPoolExecutor(max_workers=2, max_tasks_per_child=1, sensor=faulty.no_devices())
d = ex._dispatcher
# A brief shortage: the start is retried, and the task runs once descriptors are back.
running = ex.submit(faulty.wait_for_file, {gate1!r})
until(running.running)
starve()
brief = ex.submit(faulty.square, 3)
until(lambda: d.outcomes.counts["spawn_failures"] >= 2)
feed()
assert brief.result(timeout=120) == 9, brief
assert not running.done()
open({gate1!r}, "w").close()
assert running.result(timeout=120) is True
# A lasting shortage: only the task that needed the worker fails, with the OS error.
running = ex.submit(faulty.wait_for_file, {gate2!r})
until(running.running)
starve()
lasting = ex.submit(faulty.square, 4)
error = lasting.exception(timeout=120)
feed()
assert isinstance(error, OSError) and error.errno == errno.EMFILE, repr(error)
assert "only this task failed" in str(error), str(error)
assert not running.done()
open({gate2!r}, "w").close()
assert running.result(timeout=120) is True
assert ex.submit(faulty.square, 5).result(timeout=120) == 25
ex.shutdown()
print("ok", d.outcomes.counts["spawn_failures"])
"""


def test_a_worker_that_cannot_start_fails_no_running_task(tmp_path: Path):
    """Worker starts that fail with EMFILE: retried with back-off; a brief shortage costs no
    task, a lasting one fails only the task that needed the worker, with the OS error
    (before: the first failed start broke the pool and failed the running task)."""
    script = _EMFILE.format(
        tests=str(Path(faulty.__file__).parent),
        gate1=str(tmp_path / "gate1"),
        gate2=str(tmp_path / "gate2"),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("ok ")
    assert int(done.stdout.split()[1]) >= 2 + dispatcher_module.SPAWN_TRIES
