"""How a pool breaks, and that a broken pool still resolves every future and keeps its books.

An initializer that kills its worker (``os._exit``, a segfault) breaks the pool as the
standard pool does, with no task charged as if it had run; a strict pool that would
narrow mid-run delivers what ran and fails only what had not started.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import faulty
import pytest
import regress_tasks as rt
from leakguard import LeakGuard, exited_unreaped, wait_until

from gpupool import GpuPoolExecutor, InitializerError, WidthError, WorkerLostError
from gpupool._core.units import GiB, MiB
from gpupool._pool import dispatcher as dispatcher_module
from gpupool.testing import SimulatedDevice, SimulatedHost, hold

pytestmark = pytest.mark.faults

TIMEOUT_S = 60
TASKS = 40
MAX_WORKERS = 2


def _host(**kwargs: object) -> SimulatedHost:
    return SimulatedHost(
        devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB", **kwargs
    )


def _resolved(futures: list[concurrent.futures.Future[object]]) -> None:
    _, not_done = concurrent.futures.wait(futures, timeout=TIMEOUT_S)
    assert not not_done, f"{len(not_done)} futures still pending"


# -- an initializer that kills its worker ------------------------------------------------


@pytest.mark.parametrize(
    ("how", "named"), [("exit", r"exited with code 3"), ("segv", r"was killed by SIGSEGV")]
)
def test_an_initializer_that_kills_its_worker_breaks_the_pool(
    guard: LeakGuard, tmp_path: Path, how: str, named: str
):
    """A worker that dies in its initializer breaks the pool: every future and every later
    submit get BrokenProcessPool (never WorkerLostError), and no more workers are started."""
    go = tmp_path / "go"
    with _host():
        ex = GpuPoolExecutor(
            max_workers=MAX_WORKERS,
            task_peak="1GiB",
            initializer=faulty.die_when_told,
            initargs=(str(go), how),
        )
        try:
            futures = [ex.submit(faulty.square, i) for i in range(TASKS)]
            go.touch()  # every task is submitted before any worker dies
            _resolved(futures)
            errors = [f.exception() for f in futures]
            with pytest.raises(BrokenProcessPool, match=r"faulty\.die_when_told"):
                ex.submit(faulty.square, 0)
            stats = ex.statistics()
        finally:
            ex.shutdown()
        records = [d.to_dict() for d in ex.decisions]
    assert all(isinstance(e, InitializerError) for e in errors), {type(e) for e in errors}
    assert not any(isinstance(e, WorkerLostError) for e in errors)
    message = str(errors[0])
    assert "faulty.die_when_told" in message
    assert named in message
    assert stats.workers_started <= MAX_WORKERS + 1
    assert stats.workers_lost == 0
    assert (stats.tasks_completed, stats.tasks_failed, stats.tasks_cancelled) == (0, TASKS, 0)
    assert not [r for r in records if r["event"] == "worker_lost"]
    shutdown = [r for r in records if r["event"] == "shutdown"][-1]
    assert (shutdown["tasks_failed"], shutdown["tasks_lost"]) == (TASKS, 0)


def test_a_ready_worker_reports_what_its_initializer_left_on_the_card():
    """A worker says it is ready after its initializer, with its own device bytes then."""
    with _host(context="300MiB"):
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="1GiB",
            initializer=faulty.hold_for_life,
            initargs=("2GiB",),
        ) as ex:
            assert ex.submit(faulty.square, 3).result(timeout=TIMEOUT_S) == 9
            # The ready answer comes before the task's, on the same ordered channel.
            (worker,) = ex._dispatcher.workers.on(0)
            assert worker.ready
            assert worker.resident_bytes == 2 * GiB + 300 * MiB


def test_a_worker_without_an_initializer_is_ready_and_holding_nothing_known():
    """Without an initializer a worker is ready holding no device row: its bytes are unknown."""
    with _host(context="300MiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
            assert ex.submit(faulty.square, 3).result(timeout=TIMEOUT_S) == 9
            (worker,) = ex._dispatcher.workers.on(0)
            assert worker.ready
            assert worker.resident_bytes is None


# -- a strict pool that would narrow mid-run ---------------------------------------------


def test_a_strict_break_mid_run_delivers_what_ran_and_keeps_its_books(tmp_path: Path):
    """strict=True, the parent growing mid-run: the tasks that ended and the two running
    deliver their results, the tasks not yet started fail with WidthError, and the
    statistics and the shutdown record add up to the tasks submitted."""

    def path(name: str, i: int) -> str:
        return str(tmp_path / f"{name}{i}")

    def started(i: int) -> None:
        assert wait_until(Path(path("ready", i)).exists, TIMEOUT_S), f"task {i} never started"

    def release(i: int) -> None:
        started(i)
        Path(path("go", i)).touch()

    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        ex = GpuPoolExecutor(max_workers=3, strict=True, task_peak="3GiB", reserve=0)
        try:
            assert ex.width == 3
            # Each task says it started, waits to be told, then holds 2 GiB for a moment.
            futures = [
                ex.submit(rt.hold_when_told, i, "2GiB", path("ready", i), path("go", i))
                for i in range(7)
            ]
            release(0)
            assert futures[0].result(timeout=TIMEOUT_S) == 0
            started(3)  # in task 0's place: 1, 2 and 3 run
            # The parent takes 5 GiB: 5 GiB of room hold two tasks at 2 GiB and a margin,
            # below the 3 asked.
            with hold("5GiB", device=0):
                release(1)
                assert futures[1].result(timeout=TIMEOUT_S) == 1
                # The pool breaks at its next reading: what has not started fails now.
                _, not_done = concurrent.futures.wait(futures[4:], timeout=TIMEOUT_S)
                assert not not_done, "the tasks not yet started were left pending"
                with pytest.raises(WidthError):
                    ex.submit(faulty.square, 0)
                release(2)  # 2 and 3 ran when the pool broke: they finish and deliver
                release(3)
                assert [f.result(timeout=TIMEOUT_S) for f in futures[2:4]] == [2, 3]
            for future in futures[4:]:
                with pytest.raises(WidthError, match=r"^strict mode: .*refusing to narrow"):
                    future.result(timeout=0)
        finally:
            ex.shutdown()
        stats = ex.statistics()
        shutdown = [d.to_dict() for d in ex.decisions if d.event == "shutdown"][-1]
    assert stats.tasks_submitted == 7
    assert (stats.tasks_completed, stats.tasks_failed, stats.tasks_cancelled) == (4, 3, 0)
    totals = (
        shutdown["tasks_completed"],
        shutdown["tasks_failed"],
        shutdown["tasks_cancelled"],
        shutdown["tasks_lost"],
    )
    assert totals == (4, 3, 0, 0)


def _submits_again(ex: GpuPoolExecutor, seen: list[str]) -> Callable[[object], None]:
    """A done-callback that submits to ``ex`` again and tells ``seen`` whether the submit
    raised ``WidthError`` (the pool broke before the future was done) or was accepted."""

    def submit_again(_future: object) -> None:
        try:
            ex.submit(faulty.square, 0)
        except WidthError:
            seen.append("WidthError")
        else:
            seen.append("accepted")

    return submit_again


def test_a_strict_break_comes_before_a_result_whose_turn_also_lost_a_worker(tmp_path: Path):
    """strict=True: a measurement that narrows below max_workers breaks the pool before the
    measured task's result is given, even when a worker dies in the same turn (its task's
    failure gives the turn's results at once): a submit from the result's callback raises
    WidthError."""
    sent, pid_path, go = tmp_path / "sent", tmp_path / "pid", tmp_path / "go"
    release = threading.Event()
    seen: list[str] = []

    def block(_future: object) -> None:  # the dispatcher waits here, the answers pile up
        release.wait(TIMEOUT_S)

    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        ex = GpuPoolExecutor(max_workers=2, strict=True, task_peak="1GiB", reserve=0)
        try:
            assert ex.width == 2
            dies = ex.options(key="dies").submit(rt.exit_when_told, str(pid_path), str(go))
            assert wait_until(pid_path.exists, TIMEOUT_S)
            trigger = ex.options(key="trigger").submit(
                rt.tell_and_wait, str(tmp_path / "ready"), str(tmp_path / "end")
            )
            measured = ex.options(key="measured").submit(rt.hold_and_say_sent, "6GiB", str(sent))
            measured.add_done_callback(_submits_again(ex, seen))
            trigger.add_done_callback(block)
            (tmp_path / "end").touch()  # the measured task starts in the trigger's place
            # While the dispatcher waits in the trigger's callback: the measured task answers
            # and the other worker dies; the next turn reads both.
            assert wait_until(sent.exists, TIMEOUT_S), "the measured task never answered"
            go.touch()
            worker_pid = int(pid_path.read_text())
            assert wait_until(lambda: exited_unreaped(worker_pid), TIMEOUT_S)
            release.set()
            measured.result(timeout=TIMEOUT_S)
            with pytest.raises(WorkerLostError):
                dies.result(timeout=TIMEOUT_S)
        finally:
            release.set()
            ex.shutdown()
    assert seen == ["WidthError"]


def test_a_strict_pool_breaks_when_a_failed_task_held_more_than_its_ask():
    """strict=True: a task that raised after holding more than its key's ask raises the
    price, narrowing below max_workers: the pool breaks before the failure is given (the
    next submit raises WidthError)."""
    seen: list[str] = []

    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        ex = GpuPoolExecutor(max_workers=2, strict=True, task_peak="1GiB", reserve=0)
        try:
            assert ex.width == 2
            failed = ex.submit(rt.hold_then_raise, "6GiB")
            failed.add_done_callback(_submits_again(ex, seen))  # run as the failure is given
            with pytest.raises(ValueError, match="after holding"):
                failed.result(timeout=TIMEOUT_S)
        finally:
            ex.shutdown()
    assert seen == ["WidthError"]


# -- workers that die as they boot, after shutdown() was called --------------------------

_BOOT_DEATH_AT_SHUTDOWN = """
import concurrent.futures, os, sys
sys.path.insert(0, {tests!r})
import faulty
from concurrent.futures.process import BrokenProcessPool
from gpupool import GpuPoolExecutor, InitializerError
from gpupool.testing import SimulatedDevice, SimulatedHost

with SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB"):
    if {initializer!r}:
        ex = GpuPoolExecutor(
            max_workers=2, task_peak="1GiB", initializer=faulty.die_when_told,
            initargs=({go!r}, "exit"),
        )
    else:
        # The interpreter dies as it starts in a worker (a sitecustomize that exits), before
        # it is ready.
        ex = GpuPoolExecutor(max_workers=2, task_peak="1GiB", env={{"PYTHONPATH": {boot!r}}})
    futures = [ex.submit(faulty.square, i) for i in range(4)]
    ex.shutdown(wait=False)  # as a with-block that ends right after its submits
    open({go!r}, "w").close()
    _, not_done = concurrent.futures.wait(futures, timeout={timeout_s})
    if not_done:  # the pool would never stop: say so, and leave at once
        print(f"pending {{len(not_done)}} {{ex.statistics().workers_started}}", flush=True)
        os._exit(1)
    errors = [f.exception() for f in futures]
    kind = InitializerError if {initializer!r} else BrokenProcessPool
    assert all(isinstance(e, kind) for e in errors), errors
    ex.shutdown()
    print("ok", ex.statistics().workers_started)
"""


@pytest.mark.parametrize("initializer", [True, False], ids=["initializer", "no-initializer"])
def test_workers_that_die_as_they_boot_after_shutdown_break_the_pool(
    tmp_path: Path, initializer: bool
):
    """shutdown() called right after the submits, then every worker dies before it is ready:
    the pool breaks as it would without the shutdown (at once with an initializer, after
    SPAWN_TRIES in a row without), every future fails, and no worker is started beyond
    that (before: a death during shutdown was not counted, so the pool started workers
    without end and shutdown() never returned)."""
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    script = _BOOT_DEATH_AT_SHUTDOWN.format(
        tests=str(Path(faulty.__file__).parent),
        boot=str(boot),
        initializer=initializer,
        go=str(tmp_path / "go"),
        timeout_s=TIMEOUT_S,
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok "), done.stdout
    # A worker per slot at most, then the tries in a row that break the pool.
    assert int(done.stdout.split()[1]) <= MAX_WORKERS + dispatcher_module.SPAWN_TRIES
