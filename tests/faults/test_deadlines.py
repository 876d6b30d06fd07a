"""A task's deadline: ``options(timeout_s=...)`` and ``GPUPOOL_TASK_TIMEOUT_S`` (real processes).

Before, there was none: a hung task held its slot for good (and
``TaskTimeoutError`` did not exist).
"""

from __future__ import annotations

import math
from pathlib import Path

import deadline_tasks as tasks
import psutil
import pytest
from leakguard import exited, wait_until

from gpupool import ConfigurationError, GpuPoolExecutor, TaskTimeoutError
from gpupool._pool.environ import TASK_TIMEOUT_ENV

pytestmark = pytest.mark.faults


def _pids(path: Path) -> list[int]:
    assert wait_until(path.exists, 60)
    return [int(word) for word in path.read_text().split()]


def test_past_its_deadline_the_task_tree_ends_and_the_pool_goes_on(tmp_path: Path):
    """The task's worker and the process it started are ended; its future fails with a
    TimeoutError naming the task and its deadline; a record says so; the next task runs."""
    path = tmp_path / "pids"
    with GpuPoolExecutor(max_workers=2) as ex:
        future = ex.options(timeout_s=1).submit(tasks.child_then_wait, str(path), 120)
        worker, child = _pids(path)
        with pytest.raises(TaskTimeoutError) as caught:
            future.result(timeout=60)
        assert ex.submit(tasks.square, 7).result(timeout=60) == 49
        records = [d for d in ex.decisions if d.event == "task_timeout"]
    error = caught.value
    assert isinstance(error, TimeoutError)
    assert error.timeout_s == 1.0
    assert error.task == "deadline_tasks.child_then_wait"
    assert error.pid == worker
    assert "deadline_tasks.child_then_wait" in str(error) and "1 s" in str(error)
    assert wait_until(lambda: exited(worker) and exited(child), 10), [
        psutil.Process(p).status() for p in (worker, child) if not exited(p)
    ]
    assert len(records) == 1
    assert records[0].extra["timeout_s"] == 1.0
    assert records[0].extra["pid"] == worker
    assert ex.statistics().tasks_failed == 1


def test_a_task_deaf_to_sigterm_is_killed_after_the_grace(tmp_path: Path):
    path = tmp_path / "pid"
    with GpuPoolExecutor(max_workers=1) as ex:
        future = ex.options(timeout_s=0.5).submit(tasks.deaf_to_sigterm, str(path))
        (worker,) = _pids(path)
        with pytest.raises(TaskTimeoutError):
            future.result(timeout=60)
        assert ex.submit(tasks.square, 3).result(timeout=60) == 9
    assert wait_until(lambda: exited(worker), 10)


def test_the_deadline_counts_from_the_start_not_from_submit():
    """Three tasks of 1 s on one worker, each with a deadline of 2.5 s: all succeed (the
    last one waited 2 s in the pool before it started)."""
    with GpuPoolExecutor(max_workers=1) as ex:
        timed = ex.options(timeout_s=2.5)
        futures = [timed.submit(tasks.nap, 1.0, i) for i in range(3)]
        assert [f.result(timeout=60) for f in futures] == [0, 1, 2]


def test_the_variable_sets_every_task_s_deadline(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(TASK_TIMEOUT_ENV, "0.5")
    with GpuPoolExecutor(max_workers=1) as ex:
        with pytest.raises(TaskTimeoutError) as caught:
            ex.submit(tasks.nap, 60, 0).result(timeout=60)
        assert caught.value.timeout_s == 0.5
        # options(timeout_s=) gives a task its own.
        assert ex.options(timeout_s=30).submit(tasks.nap, 1.0, 5).result(timeout=60) == 5


@pytest.mark.parametrize("value", ["", "abc", "0", "-1", "inf", "nan", "1s"])
def test_a_bad_variable_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, value: str):
    monkeypatch.setenv(TASK_TIMEOUT_ENV, value)
    with pytest.raises(ConfigurationError, match=TASK_TIMEOUT_ENV):
        GpuPoolExecutor(max_workers=1)


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, True, "5", 10**400])
def test_a_bad_timeout_is_refused_naming_it(value: object):
    with GpuPoolExecutor(max_workers=1) as ex:
        with pytest.raises(ConfigurationError, match="timeout_s="):
            ex.options(timeout_s=value)  # type: ignore[arg-type]


def test_a_stopped_worker_past_its_deadline_is_ended():
    with GpuPoolExecutor(max_workers=1) as ex:
        future = ex.options(timeout_s=1).submit(tasks.stop_own_worker)
        with pytest.raises(TaskTimeoutError):
            future.result(timeout=60)
        assert ex.submit(tasks.square, 4).result(timeout=60) == 16


def test_sigterm_of_stopped_processes_resumes_them():
    """The deadline's SIGTERM reaches a stopped tree (SIGCONT with it): checked through the
    worker's exit by SIGTERM, not SIGKILL."""
    with GpuPoolExecutor(max_workers=1) as ex:
        future = ex.options(timeout_s=0.5).submit(tasks.stop_own_worker)
        with pytest.raises(TaskTimeoutError, match="killed by SIGTERM"):
            future.result(timeout=60)


def test_with_chunks_the_deadline_is_the_chunk_s():
    """Two calls of 1.5 s with a deadline of 2.5 s: each alone is in time, the two in one
    chunk are not."""
    with GpuPoolExecutor(max_workers=2) as ex:
        timed = ex.options(timeout_s=2.5)
        assert list(timed.map(tasks.nap, [1.5, 1.5], [0, 1])) == [0, 1]
        with pytest.raises(TaskTimeoutError):
            list(timed.map(tasks.nap, [1.5, 1.5], [0, 1], chunksize=2))
