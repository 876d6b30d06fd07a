from __future__ import annotations
import collections, threading
from concurrent.futures import Future
from pathlib import Path
import pytest, queue_tasks
from gpupool import DeviceOutOfMemoryError, GpuPoolExecutor, WorkerLostError
from gpupool.testing import SimulatedDevice, SimulatedHost
from support import wait_for


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_max_tasks(limit):
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB"), GpuPoolExecutor(max_workers=1, task_peak="1GiB", max_tasks_per_child=limit) as pool:
        pids = list(pool.map(queue_tasks.step, ["ok"] * 60))
        counts = collections.Counter(pids)
        print(limit, sorted(counts.values()), pool._dispatcher.counts)
        assert max(counts.values()) <= limit


@pytest.mark.parametrize("limit", [2, 3, None])
def test_max_tasks_oom(tmp_path, limit):
    gate = tmp_path / "g"
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB"), GpuPoolExecutor(max_workers=1, task_peak="1GiB", max_tasks_per_child=limit) as pool:
        list(pool.map(queue_tasks.step, ["ok"] * 20))
        running = pool.submit(queue_tasks.step, "oom-small", str(gate))
        qs = [pool.submit(queue_tasks.step, "ok") for _ in range(5)]
        gate.touch()
        with pytest.raises(DeviceOutOfMemoryError):
            running.result(timeout=60)
        pids = [f.result(timeout=60) for f in qs]
        print(limit, pids, pool._dispatcher.counts)


def test_callbacks_reenter(tmp_path):
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB"), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as pool:
        more: list[Future] = []
        def cb(f):
            if len(more) < 50:
                more.append(pool.submit(queue_tasks.step, "ok"))
                more[-1].add_done_callback(cb)
        for _ in range(4):
            f = pool.submit(queue_tasks.step, "ok"); f.add_done_callback(cb)
        wait_for(lambda: len(more) >= 50, timeout_s=60)
        for f in list(more):
            f.result(timeout=60)
    print(pool.statistics().tasks_completed)


def test_callback_shutdown_cancel(tmp_path):
    pool = GpuPoolExecutor(max_workers=1)
    futs = []
    def cb(f):
        pool.shutdown(wait=False, cancel_futures=True)
    list(pool.map(queue_tasks.step, ["ok"] * 20))
    first = pool.submit(queue_tasks.step, "ok"); first.add_done_callback(cb)
    futs = [pool.submit(queue_tasks.step, "ok") for _ in range(200)]
    pool.shutdown(wait=True)
    states = collections.Counter(f._state for f in futs)
    print(states)
    assert all(f.done() for f in futs)
