"""A stopped worker, and task frames another reader takes (real processes).

Before: a task that SIGSTOPs its own worker left its future pending and
``shutdown()`` never returned, and a thread a task started that reads the
worker's inherited socket left 246 of 300 futures pending. Both tests here
hang on that code (they import nothing it lacks, so they can be run on it).
"""

from __future__ import annotations

import concurrent.futures

import deadline_tasks as tasks
import pytest

from gpupool import GpuPoolExecutor, WorkerLostError

pytestmark = pytest.mark.faults


def test_a_stopped_worker_fails_its_task_and_shutdown_returns():
    """A task SIGSTOPs its own worker: it is noticed, killed after STOPPED_LOST_S, only its
    task fails, and the with block (shutdown) ends."""
    with GpuPoolExecutor(max_workers=2) as ex:
        stopped = ex.submit(tasks.stop_own_worker)
        others = [ex.submit(tasks.square, i) for i in range(10)]
        with pytest.raises(WorkerLostError, match="stopped"):
            stopped.result(timeout=120)
        assert [f.result(timeout=60) for f in others] == [i * i for i in range(10)]
        lost = [d for d in ex.decisions if d.event == "worker_lost"]
    assert lost and lost[0].extra["stopped_s"] > 0


def test_frames_another_reader_takes_leave_no_future_pending():
    """A task starts a thread that reads its worker's socket (taking whole task frames): the
    worker does not acknowledge them, so it is killed and the tasks run on other workers.
    Before: 246 of 300 futures pending after 15 s."""
    ex = GpuPoolExecutor(max_workers=2)
    pending: set[concurrent.futures.Future[int]] = set()
    try:
        thief = ex.submit(tasks.steal_frames)
        futures = [ex.submit(tasks.square, i) for i in range(300)]
        _, pending = concurrent.futures.wait([thief, *futures], timeout=120)
        assert len(pending) == 0
        assert thief.result() >= 1
        assert [f.result() for f in futures] == [i * i for i in range(300)]
        unread = [d for d in ex.decisions if d.extra.get("frame_unread")]
        assert unread, "no worker was found not reading its frames"
    finally:
        if pending:  # the code before: a worker that never answers; do not wait for it
            ex.kill_workers()
        ex.shutdown(wait=not pending, cancel_futures=True)
