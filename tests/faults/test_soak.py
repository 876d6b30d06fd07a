"""A soak: 10,000 tasks, one in a hundred faulty, through one pool on a simulated card."""

from __future__ import annotations

import concurrent.futures
import random
import signal
from concurrent.futures.process import BrokenProcessPool

import faulty
import pytest
from leakguard import LeakGuard

from gpupool import GpuPoolExecutor, WorkerLostError
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = [pytest.mark.faults, pytest.mark.slow]

TASKS = 10_000

#: One fault per hundred tasks. The process-killing faults cost a new worker
#: (a fork+exec and gpupool's imports, ~0.1-0.3 s on 2 cores) each, so they
#: are weighted lower: 30 of the 100 faults (the whole soak takes ~10 s).
FAULTS = ["raise"] * 40 + ["unpicklable"] * 30 + ["exit"] * 15 + ["kill"] * 15

EXPECTED: dict[str, type[BaseException]] = {
    "raise": faulty.SoakError,
    "unpicklable": TypeError,
    "exit": WorkerLostError,
    "kill": WorkerLostError,
}


def test_soak_ten_thousand_tasks_one_fault_per_hundred(guard: LeakGuard):
    """Every good result is right, every fault has its exception, statistics() agrees."""
    rng = random.Random(7)
    faults = list(FAULTS)
    rng.shuffle(faults)
    plan = [faults[i // 100] if i % 100 == 37 else "" for i in range(TASKS)]
    with SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            futures = [ex.submit(faulty.soak, i, fault) for i, fault in enumerate(plan)]
            _, not_done = concurrent.futures.wait(futures, timeout=240)
            guard.watch(ex)
            stats = ex.statistics()
            lost = [d.to_dict() for d in ex.decisions if d.event == "worker_lost"]
    assert not not_done, f"{len(not_done)} futures still pending"
    pids: set[int] = set()
    wrong = []
    for i, (fault, future) in enumerate(zip(plan, futures, strict=True)):
        error = future.exception()
        if not fault:
            if error is not None or future.result()[0] != i * 3:
                wrong.append((i, fault, error))
            else:
                pids.add(future.result()[1])
        elif not isinstance(error, EXPECTED[fault]):
            wrong.append((i, fault, error))
        elif fault == "kill":
            assert error.signal_name == "SIGKILL" and error.exitcode == -signal.SIGKILL
        elif fault == "exit":
            assert isinstance(error, BrokenProcessPool) and error.exitcode == 3
    assert wrong == []
    killers = sum(1 for fault in plan if fault in {"exit", "kill"})
    assert stats.tasks_submitted == TASKS
    assert stats.tasks_completed + stats.tasks_failed == TASKS
    assert stats.tasks_failed == len(FAULTS)
    assert stats.workers_lost == killers == len(lost)
    assert sorted((str(d["signal"]), d["exitcode"]) for d in lost) == sorted(
        [("SIGKILL", -signal.SIGKILL)] * 15 + [("None", 3)] * 15
    )
    guard.add(pids)
    guard.assert_clean()
