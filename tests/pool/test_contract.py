"""The concurrent.futures contract, on a simulated card with real worker processes."""

from __future__ import annotations

import concurrent.futures
import math
import signal
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback

import numpy as np
import pytest
import tasks

from gpupool import GpuPoolExecutor, WorkerLostError
from gpupool.testing import SimulatedDevice, SimulatedHost


@pytest.fixture(scope="module")
def host():
    with SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=4, host_ram="64GiB") as h:
        yield h


@pytest.fixture
def pool(host):
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        yield ex


def test_is_an_executor_returning_stdlib_futures(pool):
    """It subclasses Executor, and submit returns a concurrent.futures.Future."""
    assert isinstance(pool, concurrent.futures.Executor)
    future = pool.submit(pow, 2, 10)
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(timeout=60) == 1024


def test_lambdas_and_closures_travel_with_cloudpickle(pool):
    """Lambdas and closures run in the workers (the standard library cannot pickle them)."""
    offset = 7
    assert pool.submit(lambda x: x + offset, 1).result(timeout=60) == 8

    def scaled(x: int) -> int:
        return x * offset

    assert list(pool.map(scaled, [1, 2, 3])) == [7, 14, 21]


def test_submit_fn_is_positional_only(pool):
    """Keyword arguments named fn and self reach the function, as in CPython."""
    future = pool.submit(dict, fn=1, self=2)
    assert future.result(timeout=60) == {"fn": 1, "self": 2}
    with pytest.raises(TypeError):
        pool.submit(fn=dict)  # type: ignore[call-arg]


def test_exception_keeps_its_type_and_the_remote_traceback(pool):
    """A task's exception comes back with its type and the child's traceback as __cause__."""
    future = pool.submit(tasks.fail, "boom")
    with pytest.raises(ValueError, match=r"^boom$") as info:
        future.result(timeout=60)
    cause = info.value.__cause__
    assert type(cause) is _RemoteTraceback
    assert "raise ValueError(message)" in cause.tb


def test_wait_and_as_completed_accept_its_futures(pool):
    """concurrent.futures.wait and as_completed work on gpupool futures."""
    futures = [pool.submit(tasks.sleep_return, i, 0.05 * (3 - i)) for i in range(3)]
    done, not_done = concurrent.futures.wait(futures, timeout=60)
    assert len(done) == 3 and not not_done
    assert sorted(f.result() for f in concurrent.futures.as_completed(futures)) == [0, 1, 2]


def test_map_orders_results_and_honours_chunksize_and_buffersize(pool):
    """map returns results in input order for any chunksize and buffersize."""
    assert list(pool.map(pow, range(10), [2] * 10)) == [i * i for i in range(10)]
    assert list(pool.map(pow, range(10), [2] * 10, chunksize=3)) == [i * i for i in range(10)]
    assert list(pool.map(abs, range(-5, 0), buffersize=2)) == [5, 4, 3, 2, 1]
    with pytest.raises(ValueError, match=r"^chunksize must be >= 1\.$"):
        pool.map(abs, [1], chunksize=0)
    with pytest.raises(ValueError, match=r"^buffersize must be None or >= 1\.$"):
        pool.map(abs, [1], buffersize=0)
    # The wrong type is a TypeError, as on CPython 3.14 (was: ValueError); nothing is submitted.
    submitted = pool.statistics().tasks_submitted
    for wrong in (1.5, "2"):
        with pytest.raises(TypeError, match=r"^buffersize must be an integer or None$"):
            pool.map(abs, [1], buffersize=wrong)
    assert pool.statistics().tasks_submitted == submitted


def test_map_whose_iterable_raises_cancels_what_it_submitted(host, tmp_path):
    """map over an iterable that raises part-way raises its error, and cancels the tasks it
    had submitted and that have not started: the caller holds none of their futures."""
    release = tmp_path / "release"

    def paths():
        for i in range(4):
            yield str(tmp_path / f"started{i}")
        raise ValueError("bad input after item 3")

    with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        try:
            with pytest.raises(ValueError, match=r"^bad input after item 3$"):
                ex.map(tasks.touch_and_wait, paths(), [str(release)] * 5)
        finally:
            release.touch()  # the one task that may have started ends
    stats = ex.statistics()
    assert stats.tasks_submitted == 4
    assert stats.tasks_cancelled >= 3
    assert stats.tasks_cancelled + stats.tasks_completed == 4


@pytest.mark.parametrize(
    ("arguments", "error", "pattern"),
    [
        ({"timeout": "1"}, TypeError, r"^timeout='1': pass a number of seconds after which"),
        ({"timeout": math.nan}, ValueError, r"^timeout=nan: pass a number of seconds after"),
        ({"chunksize": "2"}, TypeError, r"^chunksize='2': pass a whole number of calls per task"),
        ({"chunksize": 2.5}, TypeError, r"^chunksize=2\.5: pass a whole number of calls per"),
    ],
    ids=["timeout-text", "timeout-nan", "chunksize-text", "chunksize-fraction"],
)
def test_map_refuses_a_bad_timeout_or_chunksize_before_submitting(host, arguments, error, pattern):
    """A timeout or chunksize that is not a number of seconds or of calls is refused by map,
    naming it, before any task is submitted (Python's own errors named neither)."""
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        with pytest.raises(error, match=pattern):
            ex.map(abs, [-1, -2], **arguments)
        assert list(ex.map(abs, [-1, -2], timeout=math.inf, chunksize=np.int64(2))) == [1, 2]
    assert ex.statistics().tasks_submitted == 1  # the one chunk of the good call


def test_map_timeout_raises_timeout_error(pool):
    """A map result not ready within timeout raises concurrent.futures.TimeoutError.

    (Python 3.11 made it the builtin TimeoutError; on 3.10 it is its own class.)
    """
    results = pool.map(tasks.sleep_return, [1], [2.0], timeout=0.2)
    with pytest.raises(concurrent.futures.TimeoutError):
        list(results)


def test_runtime_error_after_shutdown(host):
    """submit after shutdown raises RuntimeError, and shutdown is idempotent."""
    pool = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
    pool.shutdown()
    pool.shutdown()
    with pytest.raises(RuntimeError, match=r"^cannot schedule new futures after shutdown$"):
        pool.submit(abs, 1)


def test_shutdown_cancel_futures_cancels_what_has_not_started(host, tmp_path):
    """shutdown(cancel_futures=True) cancels queued tasks; the running one finishes.

    The first task runs until the test releases it, after the shutdown: at width 1 nothing
    else can have started, whatever the load."""
    started, release = tmp_path / "started", tmp_path / "release"
    pool = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
    try:
        first = pool.submit(tasks.touch_and_wait, str(started), str(release), 0)
        queued = [pool.submit(tasks.sleep_return, i, 0.0) for i in range(1, 10)]
        assert _wait_until(started.exists)
        pool.shutdown(wait=False, cancel_futures=True)
        assert _wait_until(lambda: all(f.done() for f in queued))
        assert all(f.cancelled() for f in queued)
    finally:
        release.touch()
        pool.shutdown(wait=True)
    assert not first.cancelled()
    assert first.result() == 0


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll ``predicate`` (a file a task writes, a future's state) until true or timed out."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_max_workers_is_validated_like_cpython(host):
    """max_workers <= 0 raises CPython's ValueError."""
    for bad in (0, -3):
        with pytest.raises(ValueError, match=r"^max_workers must be greater than 0$"):
            GpuPoolExecutor(max_workers=bad)


def test_workers_start_lazily_and_stay_warm(host):
    """A pool for one item at a time starts one worker and reuses it."""
    with GpuPoolExecutor(max_workers=4, task_peak="1GiB") as pool:
        first = pool.submit(tasks.pid_of).result(timeout=60)
        second = pool.submit(tasks.pid_of).result(timeout=60)
        assert first == second
        assert pool.statistics().workers_started == 1


def test_initializer_runs_in_every_worker(host):
    """The user's initializer runs before the worker's first task."""
    with GpuPoolExecutor(
        max_workers=2, task_peak="1GiB", initializer=tasks.init_marker, initargs=("ready",)
    ) as pool:
        assert set(pool.map(tasks.read_marker, range(4))) == {"ready"}


def test_failing_initializer_breaks_the_pool(host):
    """An initializer that raises breaks the pool, as in CPython, and no future hangs."""
    pool = GpuPoolExecutor(
        max_workers=1, task_peak="1GiB", initializer=tasks.fail, initargs=("no init",)
    )
    try:
        future = pool.submit(abs, -1)
        with pytest.raises(BrokenProcessPool):
            future.result(timeout=60)
        with pytest.raises(BrokenProcessPool):
            pool.submit(abs, -1)
    finally:
        pool.shutdown()


def test_max_tasks_per_child_replaces_workers(host):
    """With max_tasks_per_child=2 each worker runs at most two tasks; all complete."""
    with GpuPoolExecutor(1, task_peak="1GiB", max_tasks_per_child=2) as pool:
        pids = [pool.submit(tasks.pid_of).result(timeout=60) for _ in range(6)]
    assert len(set(pids)) == 3
    assert pids[0] == pids[1] and pids[2] == pids[3] and pids[4] == pids[5]


def test_max_tasks_per_child_with_a_backlog_does_not_hang(host):
    """A backlog with max_tasks_per_child completes (CPython gh-115634 deadlocks here)."""
    with GpuPoolExecutor(1, task_peak="1GiB", max_tasks_per_child=2) as pool:
        futures = [pool.submit(tasks.sleep_return, i, 0.0) for i in range(6)]
        assert [f.result(timeout=60) for f in futures] == list(range(6))


def test_sigkilled_worker_fails_only_its_own_task(host):
    """A worker killed with SIGKILL fails its task with the signal named; the rest complete."""
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as pool:
        futures = [pool.submit(tasks.kill_self_on, i, 3) for i in range(8)]
        outcomes = {}
        for i, future in enumerate(futures):
            try:
                outcomes[i] = future.result(timeout=60)
            except WorkerLostError as exc:
                outcomes[i] = exc
        stats = pool.statistics()
        decisions = pool.decisions
    lost = outcomes.pop(3)
    assert isinstance(lost, WorkerLostError)
    assert isinstance(lost, BrokenProcessPool)
    assert lost.signal_name == "SIGKILL"
    assert lost.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(lost)
    assert outcomes == {i: i for i in range(8) if i != 3}
    assert stats.workers_lost == 1
    assert any(d.event == "worker_lost" for d in decisions)


def test_unpicklable_result_fails_only_that_task(pool):
    """A result that cannot be pickled fails its future; the pool goes on."""
    import threading

    future = pool.submit(threading.Lock)
    with pytest.raises(TypeError):
        future.result(timeout=60)
    assert pool.submit(abs, -3).result(timeout=60) == 3


def test_pickling_error_in_submit_goes_to_the_future(pool):
    """An argument that cannot be pickled fails its future, not the pool."""
    import threading

    future = pool.submit(abs, threading.Lock())
    with pytest.raises(TypeError):
        future.result(timeout=60)
    assert pool.submit(abs, -4).result(timeout=60) == 4


def test_width_decisions_and_statistics_are_exposed(pool):
    """ex.width, ex.decisions and ex.statistics() describe the pool."""
    assert pool.width == 2
    assert pool.decisions[0].event == "constructed"
    stats = pool.statistics()
    assert stats.width == 2
    with pytest.raises(AttributeError):
        stats.width = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        stats.asks["x"] = stats.asks  # type: ignore[index]


def test_map_progress_bar_shows_width_and_keeps_results(host, capsys):
    """progress=True draws a bar naming the width while map's results stay in order."""
    pytest.importorskip("tqdm", reason="the progress bar needs the progress extra (tqdm)")
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB", progress=True) as ex:
        assert list(ex.map(abs, range(-6, 0))) == [6, 5, 4, 3, 2, 1]
    assert "width" in capsys.readouterr().err


def test_map_progress_off_writes_nothing(host, capsys):
    """progress=False keeps map silent."""
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB", progress=False) as ex:
        assert list(ex.map(abs, [-1, -2])) == [1, 2]
    assert capsys.readouterr().err == ""


def test_a_pool_for_three_items_starts_at_most_three_workers(host):
    """Workers start lazily: three items on a pool of eight start at most three."""
    with GpuPoolExecutor(max_workers=8, task_peak="1GiB") as pool:
        assert list(pool.map(tasks.sleep_return, range(3), [0.3] * 3)) == [0, 1, 2]
        started = pool.statistics().workers_started
    assert 1 <= started <= 3
