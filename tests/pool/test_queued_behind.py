"""A short task queued behind a busy worker: it runs there, or, where it no longer can, elsewhere.

One worker, one key: after a warm-up its tasks are short, so the next tasks of
the key (as many as ``queue_depth`` says for it) wait in the busy worker's socket (their
futures RUNNING, as a standard pool's queued calls are). Each test then takes
that worker's run away another way (the worker dies, the run runs out of
memory, the caller cancels) and checks the queued tasks are never lost and
never left pending. The test waits on
files it creates and on the futures' own states; nothing depends on timing.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import queue_tasks

from gpupool import DeviceOutOfMemoryError, GpuPoolExecutor, WorkerLostError
from gpupool._pool.dispatcher import callable_name
from gpupool.testing import SimulatedDevice, SimulatedHost
from support import wait_for

WARM_UP = 20
#: A safety net so that a broken test fails instead of hanging; never asserted on.
WARM_UP_ROUNDS = 50


def _warm_up(pool: GpuPoolExecutor) -> int:
    """Run the key's ``ok`` tasks on the one worker until the planner finds the key short
    (on a loaded machine a task can take long, and the key is not short for the next ones);
    returns how many of its tasks may then wait behind a run (it holds while none ends)."""
    key = callable_name(queue_tasks.step)
    for _ in range(WARM_UP_ROUNDS):
        assert len(set(pool.map(queue_tasks.step, ["ok"] * WARM_UP))) == 1
        if pool._dispatcher.planner.durations.short(key):
            return pool._dispatcher.planner.durations.queue_depth(key)
    pytest.fail(f"{key} was not found short after {WARM_UP_ROUNDS * WARM_UP} tasks")


def _busy_with_queued(
    pool: GpuPoolExecutor, action: str, gate: Path
) -> tuple[Future[int], list[Future[int]], Future[int]]:
    """Warm the key up, start ``action`` on the one worker, and wait until the next tasks
    (``ok``, as many as may wait) are queued behind it; the one after stays pending."""
    depth = _warm_up(pool)
    running = pool.submit(queue_tasks.step, action, str(gate))
    queued = [pool.submit(queue_tasks.step, "ok") for _ in range(depth)]
    pending = pool.submit(queue_tasks.step, "ok")
    # With one worker busy, the only way for the next futures to be RUNNING is to be queued.
    for future in queued:
        wait_for(future.running, what="the next tasks queued behind the busy worker")
    return running, queued, pending


def _two_behind_one(
    pool: GpuPoolExecutor, gate: Path, after_run: Path, last_action: str, answered: Path
) -> tuple[Future[int], Future[int], Future[int]]:
    """Warm the key up, start a run that waits for ``gate`` on the one worker, and queue two
    behind it: one that waits for ``after_run``, then ``last_action`` (which marks
    ``answered``); returns the three once both are queued."""
    _warm_up(pool)
    running = pool.submit(queue_tasks.step, "wait", str(gate))
    first = pool.submit(queue_tasks.step, "wait", str(after_run))
    last = pool.submit(queue_tasks.step, last_action, str(answered))
    for future in (first, last):
        wait_for(future.running, what="the next tasks queued behind the busy worker")
    return running, first, last


def _card() -> Any:
    return SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB")


def _assert_the_queued_tasks_run_on_a_new_worker(
    tmp_path: Path, action: str, error: type[BaseException]
) -> None:
    """The busy worker's run of ``action`` fails with ``error`` and the worker goes: the task
    queued behind it, and the pending one, run on the worker started in its place."""
    gate = tmp_path / action
    with _card(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        first_pid = pool.submit(queue_tasks.step, "ok").result()
        running, queued, pending = _busy_with_queued(pool, action, gate)
        gate.touch()
        with pytest.raises(error):
            running.result(timeout=60)
        for future in (*queued, pending):
            assert future.result(timeout=60) != first_pid


def test_a_task_queued_behind_a_worker_that_dies_runs_on_another(tmp_path: Path) -> None:
    # The queued task is run again, by the new worker.
    _assert_the_queued_tasks_run_on_a_new_worker(tmp_path, "die", WorkerLostError)


def test_a_task_queued_behind_one_that_runs_out_of_memory_still_runs(tmp_path: Path) -> None:
    gate = tmp_path / "oom"
    with _card() as host, GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        running, queued, pending = _busy_with_queued(pool, "oom", gate)
        gate.touch()
        with pytest.raises(DeviceOutOfMemoryError):
            running.result(timeout=60)
        # Declined by the worker, they start again checked against the bound, and run.
        assert all(future.result(timeout=60) > 0 for future in queued)
        try:
            pending.result(timeout=60)
        except DeviceOutOfMemoryError:
            pass  # priced past the card now: refused, not left pending
        assert pending.done()
        assert host.device_peak(0) <= host.devices[0].total_bytes


def test_a_declined_task_runs_once_a_checked_start_lets_it(tmp_path: Path) -> None:
    gate = tmp_path / "oom"
    with _card(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        depth = _warm_up(pool)
        running = pool.submit(queue_tasks.step, "oom-small", str(gate))
        queued = [pool.submit(queue_tasks.step, "ok") for _ in range(depth)]
        for future in queued:
            wait_for(future.running, what="the next tasks queued behind the busy worker")
        gate.touch()
        with pytest.raises(DeviceOutOfMemoryError):
            running.result(timeout=60)
        # The worker declined them (queued at a booking made before the out-of-memory): back
        # at the head of the queue, not failed and not left pending, they run after starts
        # checked against the key's new price.
        assert all(future.result(timeout=60) > 0 for future in queued)
        assert pool._dispatcher.outcomes.counts["queued_declined"] == depth
        assert pool.statistics().tasks_failed == 1


def test_a_task_queued_behind_an_oom_whose_worker_then_exits_runs_again(tmp_path: Path) -> None:
    # The queued task never ran (its worker exited before reading it): not lost, it runs on
    # another.
    _assert_the_queued_tasks_run_on_a_new_worker(tmp_path, "oom-then-exit", DeviceOutOfMemoryError)


def test_a_queued_task_is_not_cancelled_and_a_pending_one_is(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    with _card(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        running, queued, pending = _busy_with_queued(pool, "wait", gate)
        assert not any(f.cancel() for f in queued)  # RUNNING: handed to its worker, as in
        pool.shutdown(wait=False, cancel_futures=True)  # the standard pool
        # Nothing can start while the gate is shut (one worker, its queue full): the pending
        # one is cancelled, and only then may the worker's tasks end.
        wait_for(pending.cancelled, what="the pending task cancelled by the shutdown")
        gate.touch()
        pid = running.result(timeout=60)
        assert [f.result(timeout=60) for f in queued] == [pid] * len(queued)  # the same worker


def test_a_queued_task_on_the_host_runs_after_its_worker_is_killed(tmp_path: Path) -> None:
    gate = tmp_path / "never"
    pool = GpuPoolExecutor(max_workers=1)
    try:
        running, queued, pending = _busy_with_queued(pool, "wait", gate)
        pool.kill_workers()
        for future in (running, *queued):
            with pytest.raises(WorkerLostError):
                future.result(timeout=60)
        assert pending.cancelled()
    finally:
        pool.shutdown()


def test_a_done_callback_that_crashes_the_dispatcher_leaves_the_turns_other_results_delivered(
    tmp_path: Path,
) -> None:
    """A turn's results are set together at its end. The first one's done-callback raises
    ``SystemExit`` on the dispatcher thread, which breaks the pool: the result read in the
    same turn after it is still delivered, not failed as lost."""
    gate, after_run, answered = tmp_path / "go", tmp_path / "after-run", tmp_path / "answered"
    with _card():
        pool = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
        try:
            running, first, last = _two_behind_one(
                pool, gate, after_run, "mark-after-answer", answered
            )

            def after(_future: Future[int]) -> None:
                # On the dispatcher thread, once ``running``'s result is set (the queued ones
                # cannot have ended yet): let them run, and wait until the worker has
                # answered both, so that the next turn reads the two answers together.
                after_run.touch()
                wait_for(answered.exists, timeout_s=60, what="both queued tasks answered")

            running.add_done_callback(after)
            first.add_done_callback(lambda _f: _exit())
            gate.touch()
            pid = running.result(timeout=60)
            assert first.result(timeout=60) == pid
            assert last.result(timeout=60) == pid  # delivered, not lost with the crash
        finally:
            pool.shutdown()


def _exit() -> None:
    raise SystemExit("a done-callback exits")


def test_no_worker_is_started_beside_one_that_has_yet_to_decline_its_queue(
    tmp_path: Path,
) -> None:
    """After the run before them ran out of memory, the tasks queued behind it are yet to be
    declined: their worker is about to be idle, so a pool of one worker starts no second
    one for the task pending behind them (max_workers processes at most)."""
    gate = tmp_path / "oom"
    release = tmp_path / "oom-release"
    with _card(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        running, queued, pending = _busy_with_queued(pool, "oom-then-hold", gate)
        gate.touch()
        with pytest.raises(DeviceOutOfMemoryError):
            running.result(timeout=60)
        # The worker holds its declines. A task of another key, submitted now, is seen by a
        # scheduling pass after the out-of-memory (the statistics name its key once one
        # ended), which would have started a second worker for ``pending``.
        other = pool.options(key="other").submit(queue_tasks.step, "ok")
        wait_for(lambda: "other" in pool.statistics().widths_by_key, what="a pass after it")
        release.touch()
        pid = queued[0].result(timeout=60)
        assert [f.result(timeout=60) for f in (*queued, pending, other)] == [pid] * (
            len(queued) + 2
        )
        assert pool.statistics().workers_started == 1


def test_futures_are_done_in_the_order_their_tasks_answered_a_failure_included(
    tmp_path: Path,
) -> None:
    """One worker runs its tasks one after another: a task that fails after one that
    returned is done after it, even when both answers are read in one turn (a result is set
    at the turn's end; a failure must not overtake it)."""
    gate, after_run, answered = tmp_path / "go", tmp_path / "after-run", tmp_path / "answered"
    order: list[str] = []
    with _card(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        running, first, last = _two_behind_one(pool, gate, after_run, "raise-then-mark", answered)

        def after(_future: Future[int]) -> None:
            # On the dispatcher thread, once ``running``'s result is set: the queued tasks
            # run, and both answer before the next turn reads them.
            order.append("running")
            after_run.touch()
            wait_for(answered.exists, timeout_s=60, what="both queued tasks answered")

        running.add_done_callback(after)
        first.add_done_callback(lambda _f: order.append("first"))
        last.add_done_callback(lambda _f: order.append("last"))
        gate.touch()
        with pytest.raises(ValueError, match="raise-then-mark"):
            last.result(timeout=60)
        assert first.result(timeout=60) == running.result(timeout=60)
    assert order == ["running", "first", "last"]


def test_tasks_a_shutdown_cancelled_are_not_counted_as_queued(tmp_path: Path) -> None:
    """``shutdown(cancel_futures=True)`` while the worker's queue is full: the pending tasks
    it cancels are withdrawn when its queue has room again (its last queued task still runs),
    never counted as tasks queued behind a run (``queued_behind`` counts tasks handed to a
    worker)."""
    gate, last_gate = tmp_path / "go", tmp_path / "last"
    with _card(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
        depth = _warm_up(pool)
        running = pool.submit(queue_tasks.step, "wait", str(gate))
        queued = [pool.submit(queue_tasks.step, "ok") for _ in range(depth - 1)]
        queued.append(pool.submit(queue_tasks.step, "wait", str(last_gate)))
        for future in queued:
            wait_for(future.running, what="the next tasks queued behind the busy worker")
        # Published before the queued futures were made RUNNING: they are counted in it.
        before = pool._dispatcher.public.snapshot.counts.get("queued_behind", 0)
        pending = [pool.submit(queue_tasks.step, "ok") for _ in range(20)]
        pool.shutdown(wait=False, cancel_futures=True)
        for future in pending:
            wait_for(future.cancelled, what="the pending tasks cancelled by the shutdown")
        gate.touch()
        # The worker runs its last queued task while the cancelled ones are withdrawn.
        wait_for(
            lambda: pool.statistics().tasks_cancelled == len(pending),
            what="the cancelled tasks withdrawn",
        )
        last_gate.touch()
        pool.shutdown(wait=True)
    assert [f.result() for f in queued] == [running.result()] * len(queued)
    assert pool._dispatcher.public.snapshot.counts.get("queued_behind", 0) == before
