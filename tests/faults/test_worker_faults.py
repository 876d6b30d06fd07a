"""Faults inside one pool: dying workers, pickling failures, a failing sensor, a full card.

Every test checks, besides its own fault: no future is left pending, every
non-faulty result is correct, the pool says what happened (a decision or the
error's message), and after shutdown no worker process, zombie or file
descriptor is left (the ``guard`` fixture, see conftest.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from pathlib import Path
from typing import Any

import faulty
import pytest
from leakguard import LeakGuard, wait_until

from gpupool import DeviceOutOfMemoryError, GpuPoolExecutor, WorkerLostError
from gpupool._core.census import HostCensus
from gpupool._errors import DeviceUnreadableError
from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading, Sensor
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = pytest.mark.faults

TIMEOUT_S = 20


def _host(total: str = "40GiB", **kwargs: Any) -> SimulatedHost:
    return SimulatedHost(
        devices=[SimulatedDevice(total=total)],
        cpus=2,
        host_ram="64GiB",
        **kwargs,
    )


def _settle(futures: list[concurrent.futures.Future[object]]) -> None:
    """Wait for every future; none may be left pending.

    ``concurrent.futures.wait`` counts a future cancelled by
    ``shutdown(cancel_futures=True)`` as not done, in CPython's pools too (it
    is ``CANCELLED``, never ``CANCELLED_AND_NOTIFIED``), so those are only
    checked with ``done()``.
    """
    live = [f for f in futures if not f.cancelled()]
    _, not_done = concurrent.futures.wait(live, timeout=TIMEOUT_S)
    assert not not_done, f"{len(not_done)} futures still pending"
    assert all(f.done() for f in futures)


def _wait_for_pid(directory: Path, name: str) -> int:
    path = directory / f"{name}.pid"
    assert wait_until(path.exists, TIMEOUT_S), f"{path} never appeared"
    return int(path.read_text())


def _still_works(ex: GpuPoolExecutor) -> None:
    assert list(ex.map(faulty.square, range(5))) == [0, 1, 4, 9, 16]


def _lost(ex: GpuPoolExecutor) -> list[dict[str, object]]:
    return [d.to_dict() for d in ex.decisions if d.event == "worker_lost"]


# -- workers that die --------------------------------------------------------------------


def test_worker_sigkilled_from_outside_fails_only_its_task(guard: LeakGuard, tmp_path: Path):
    """A worker SIGKILLed mid-task by another process fails only that task, naming SIGKILL."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        victim = ex.submit(faulty.note_pid_then_sleep, str(tmp_path), "victim", 30.0)
        pid = _wait_for_pid(tmp_path, "victim")
        others = [ex.submit(faulty.sleep_return, i, 0.05) for i in range(6)]
        guard.watch(ex)
        os.kill(pid, signal.SIGKILL)
        _settle([victim, *others])
        with pytest.raises(WorkerLostError) as info:
            victim.result()
        assert [f.result() for f in others] == list(range(6))
        _still_works(ex)
        guard.watch(ex)
        stats = ex.statistics()
        lost = _lost(ex)
    error = info.value
    assert isinstance(error, BrokenProcessPool)
    assert error.signal_name == "SIGKILL" and error.exitcode == -signal.SIGKILL
    assert f"pid {pid}" in str(error) and "SIGKILL" in str(error)
    assert [(d["signal"], d["pid"], d["exitcode"]) for d in lost] == [
        ("SIGKILL", pid, -signal.SIGKILL)
    ]
    assert stats.workers_lost == 1
    assert stats.tasks_completed + stats.tasks_failed == stats.tasks_submitted == 12
    guard.add([pid])
    guard.assert_clean()


@pytest.mark.parametrize(
    ("task", "args"),
    [(faulty.segfault, ()), (faulty.kill_self, (signal.SIGSEGV,))],
    ids=["null-dereference", "sigsegv"],
)
def test_segfaulting_worker_fails_only_its_task(
    guard: LeakGuard, task: Callable[..., object], args: tuple[int, ...]
):
    """A worker that segfaults fails only its task with SIGSEGV named; the pool goes on."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        before = [ex.submit(faulty.sleep_return, i, 0.1) for i in range(3)]
        crash = ex.submit(task, *args)
        after = [ex.submit(faulty.sleep_return, i, 0.05) for i in range(3, 6)]
        _settle([*before, crash, *after])
        guard.watch(ex)
        with pytest.raises(WorkerLostError, match="SIGSEGV") as info:
            crash.result()
        assert [f.result() for f in before + after] == list(range(6))
        _still_works(ex)
        guard.watch(ex)
        lost = _lost(ex)
    assert info.value.signal_name == "SIGSEGV"
    assert info.value.exitcode == -signal.SIGSEGV
    assert [d["signal"] for d in lost] == ["SIGSEGV"]
    guard.assert_clean()


def test_os_exit_in_a_task_names_the_exit_code(guard: LeakGuard):
    """os._exit(3) in a task fails that task with the exit code named; the rest complete."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures = [ex.submit(faulty.sleep_return, i, 0.05) for i in range(4)]
        crash = ex.submit(faulty.exit_with, 3)
        futures += [ex.submit(faulty.sleep_return, i, 0.05) for i in range(4, 8)]
        _settle([*futures, crash])
        guard.watch(ex)
        with pytest.raises(WorkerLostError, match="code 3") as info:
            crash.result()
        assert [f.result() for f in futures] == list(range(8))
        lost = _lost(ex)
    assert info.value.exitcode == 3 and info.value.signal_name is None
    assert [(d["exitcode"], d["signal"]) for d in lost] == [(3, None)]
    assert "code 3" in str(lost[0]["reason"])
    guard.assert_clean()


# -- pickling failures -------------------------------------------------------------------


def test_unpicklable_result_fails_only_its_future(guard: LeakGuard):
    """A result that cannot be pickled fails its future with the pickling error; nothing hangs."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        bad = ex.submit(faulty.unpicklable_result)
        good = [ex.submit(faulty.square, i) for i in range(6)]
        _settle([bad, *good])
        guard.watch(ex)
        with pytest.raises(TypeError, match="pickle") as info:
            bad.result()
        assert [f.result() for f in good] == [i * i for i in range(6)]
        stats = ex.statistics()
    assert isinstance(info.value.__cause__, _RemoteTraceback)
    assert stats.workers_lost == 0 and stats.tasks_failed == 1
    guard.assert_clean()


def test_argument_that_cannot_be_unpickled_in_the_child(guard: LeakGuard):
    """An argument whose unpickling raises in the child fails its future with a clear error."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        bad = ex.submit(faulty.identity, faulty.ErrorAtUnpickle("refused in the child"))
        good = [ex.submit(faulty.square, i) for i in range(6)]
        _settle([bad, *good])
        guard.watch(ex)
        with pytest.raises(BrokenProcessPool, match="failed to un-serialize in the worker") as info:
            bad.result()
        assert [f.result() for f in good] == [i * i for i in range(6)]
        _still_works(ex)
        stats = ex.statistics()
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and str(cause) == "refused in the child"
    assert stats.workers_lost == 0
    guard.assert_clean()


def test_result_that_cannot_be_unpickled_in_the_parent(guard: LeakGuard):
    """A result whose unpickling raises in the parent fails its future; the pool goes on."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        bad = ex.submit(faulty.return_error_at_unpickle)
        good = [ex.submit(faulty.square, i) for i in range(6)]
        _settle([bad, *good])
        guard.watch(ex)
        with pytest.raises(BrokenProcessPool, match="failed to un-serialize in the parent") as info:
            bad.result()
        assert [f.result() for f in good] == [i * i for i in range(6)]
        _still_works(ex)
    assert str(info.value.__cause__) == "the parent cannot rebuild this result"
    guard.assert_clean()


def test_exception_whose_pickling_fails_gets_a_stand_in(guard: LeakGuard):
    """An exception that cannot be pickled reaches the future as a RuntimeError naming it."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        bad = ex.submit(faulty.raise_locked_error, "the original message")
        good = [ex.submit(faulty.square, i) for i in range(6)]
        _settle([bad, *good])
        guard.watch(ex)
        with pytest.raises(RuntimeError) as info:
            bad.result()
        assert [f.result() for f in good] == [i * i for i in range(6)]
        _still_works(ex)
    message = str(info.value)
    assert "LockedError" in message and "the original message" in message
    assert "could not be pickled" in message
    # The child's traceback still comes back as the cause.
    cause = info.value.__cause__
    assert isinstance(cause, _RemoteTraceback) and "raise LockedError(message)" in cause.tb
    guard.assert_clean()


def test_exception_whose_unpickling_fails_in_the_parent(guard: LeakGuard):
    """An exception that pickles but cannot be rebuilt in the parent gets a clear stand-in."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        bad = ex.submit(faulty.raise_two_argument_error)
        good = [ex.submit(faulty.square, i) for i in range(6)]
        _settle([bad, *good])
        guard.watch(ex)
        with pytest.raises(BrokenProcessPool, match="exception raised by the task") as info:
            bad.result()
        assert [f.result() for f in good] == [i * i for i in range(6)]
    assert isinstance(info.value.__cause__, TypeError)
    guard.assert_clean()


# -- the sensor and the card -------------------------------------------------------------


class FailingSensor(Sensor):
    """Reads a simulated host, then every device reading raises once it is told to fail."""

    name = "failing"

    def __init__(self, inner: Sensor, error: type[Exception]) -> None:
        self.inner = inner
        self.error = error
        self.fail_after: int | None = None
        self.calls = 0
        self.failures = 0
        self._lock = threading.Lock()

    def _tick(self) -> None:
        with self._lock:
            self.calls += 1
            if self.fail_after is not None and self.calls > self.fail_after:
                self.failures += 1
                raise self.error(f"sensor broke mid-run (call {self.calls})")

    def read_devices(self) -> tuple[DeviceInfo, ...]:
        return self.inner.read_devices()

    def read_memory(self, device: DeviceInfo) -> MemoryReading:
        self._tick()
        return self.inner.read_memory(device)

    def read_processes(self, device: DeviceInfo) -> tuple[ProcessReading, ...] | None:
        self._tick()
        return self.inner.read_processes(device)

    def read_process_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        self._tick()
        return self.inner.read_process_bytes(device, pid)

    def read_host(self) -> HostCensus:
        return self.inner.read_host()


@pytest.mark.parametrize("error", [DeviceUnreadableError, RuntimeError])
def test_sensor_failing_mid_run_keeps_the_pool_running(guard: LeakGuard, error: type[Exception]):
    """A sensor that starts raising mid-run: every future completes, and the log says so."""
    with _host() as host:
        sensor = FailingSensor(host.sensor(), error)
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB", sensor=sensor) as ex:
            sensor.fail_after = sensor.calls + 3
            futures = [ex.submit(faulty.hold_then_return, i, "1GiB", 0.02) for i in range(20)]
            _settle(futures)
            guard.watch(ex)
            assert [f.result() for f in futures] == list(range(20))
            decisions = ex.decisions
        events = host.out_of_memory_events
    assert sensor.failures > 0, "the sensor never failed: the test proves nothing"
    assert events == []
    said = [
        d for d in decisions if "sensor broke mid-run" in d.reason or error.__name__ in d.reason
    ]
    assert said, (
        f"{sensor.failures} failed sensor readings, and no decision says so: "
        f"{[(d.event, d.reason) for d in decisions]}"
    )
    guard.assert_clean()


def test_cotenant_filling_the_card_mid_run(guard: LeakGuard):
    """A co-tenant that takes the card mid-run: tasks complete or fail with an OOM naming card 0."""
    stop = threading.Event()
    with _host(context=0) as host:
        total = host.devices[0].total_bytes
        task_bytes = 4 * 2**30

        def fill() -> None:
            # A greedy co-tenant: whatever is free beyond 1 GiB, it takes within 5 ms.
            while not stop.is_set():
                free = total - host.used(0)
                if free > 2**30:
                    try:
                        host.grow("hog", free - 2**30)
                    except Exception:  # a race with a task's allocation: try again
                        pass
                time.sleep(0.005)

        # A lone OOM waits room_wait_s for the hog to give the room back; it never does.
        with GpuPoolExecutor(max_workers=2, task_peak="5GiB", reserve=0, room_wait_s=0.5) as ex:
            first = [ex.submit(faulty.hold_then_return, i, "4GiB", 1.0) for i in range(2)]
            assert wait_until(lambda: host.used(0) >= 2 * task_bytes, TIMEOUT_S)
            filler = threading.Thread(target=fill, daemon=True)
            filler.start()
            assert wait_until(lambda: total - host.used(0) <= 2**30, TIMEOUT_S)
            # These allocate 0.5 s after they start, long after the hog has taken
            # what the first two give back: each must end in an OOM, not a hang.
            later = [ex.submit(faulty.sleep_then_hold, i, "4GiB", 0.5) for i in range(2, 6)]
            futures = first + later
            try:
                _settle(futures)
            finally:
                stop.set()
                filler.join()
            guard.watch(ex)
            decisions = [d.to_dict() for d in ex.decisions]
            stats = ex.statistics()
        assert host.device_peak(0) <= total
    # The first two held their bytes before the hog came.
    assert [f.result() for f in first] == [0, 1]
    for i, future in enumerate(later, start=2):
        error = future.exception()
        assert isinstance(error, DeviceOutOfMemoryError), (i, error)
        assert str(error).startswith("card 0: ") and error.device == 0
        assert "alone on the card" in str(error)
    events = {d["event"] for d in decisions}
    assert events & {"live_gate_wait", "serial_start"}, events
    ooms = [d for d in decisions if d["event"] == "out_of_memory"]
    assert len(ooms) == stats.out_of_memory >= len(later)
    assert all(d["device"] == 0 and d["live_free_bytes"] is not None for d in ooms)
    assert all(int(d["live_free_bytes"]) < task_bytes for d in ooms)
    assert stats.tasks_completed + stats.tasks_failed == stats.tasks_submitted == 6
    guard.assert_clean()


# -- shutting down with work in flight ----------------------------------------------------


def test_shutdown_cancel_futures_while_tasks_run(guard: LeakGuard, tmp_path: Path):
    """shutdown(cancel_futures=True) mid-run: running tasks finish, the rest are cancelled.

    The two running tasks wait for a file the test creates after the shutdown: nothing else
    can have started, whatever the load."""
    release = tmp_path / "release"
    with _host():
        ex = GpuPoolExecutor(max_workers=2, task_peak="1GiB")
        futures = [
            ex.submit(faulty.note_pid_then_wait_return, str(tmp_path), i, str(release))
            for i in range(10)
        ]
        _wait_for_pid(tmp_path, "0")
        _wait_for_pid(tmp_path, "1")
        guard.watch(ex)
        try:
            ex.shutdown(wait=False, cancel_futures=True)
            assert wait_until(lambda: all(f.done() for f in futures[2:]), TIMEOUT_S)
        finally:
            release.touch()
        ex.shutdown(wait=True)
        _settle(futures)
        statistics = ex.statistics()
        shutdown = [d for d in ex.decisions if d.event == "shutdown"]
    guard.add(int(p.read_text()) for p in tmp_path.glob("*.pid"))
    ran = [i for i, f in enumerate(futures) if not f.cancelled()]
    assert ran == [0, 1], ran  # the two running when shutdown came; nothing else fits
    assert all(futures[i].result() == i for i in ran)
    assert statistics.tasks_cancelled == 10 - len(ran)
    assert len(shutdown) == 1 and f"{10 - len(ran)} cancelled" in shutdown[0].reason
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(faulty.square, 1)
    guard.assert_clean()


def test_a_cancelled_pending_future_is_seen_by_wait(guard: LeakGuard, tmp_path: Path):
    """A future cancelled while held back is reported done by wait(), as CPython's pools do."""
    release = tmp_path / "release"
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        # The first task runs until released: the cancel lands while the fourth is held back.
        futures = [ex.submit(faulty.note_pid_then_wait_return, str(tmp_path), 0, str(release))]
        futures += [ex.submit(faulty.sleep_return, i, 0.0) for i in range(1, 4)]
        try:
            _wait_for_pid(tmp_path, "0")
            assert futures[3].cancel()
        finally:
            release.touch()
        # CPython calls set_running_or_notify_cancel() when it reaches the item,
        # which wakes wait() and as_completed().
        done, not_done = concurrent.futures.wait([futures[3]], timeout=TIMEOUT_S)
        states = [f._state for f in futures]
        guard.watch(ex)
        assert [f.result(timeout=TIMEOUT_S) for f in futures[:3]] == [0, 1, 2]
    assert not not_done, f"wait() never saw the cancelled future: {states}"
    assert done == {futures[3]}
    guard.assert_clean()
