"""One pipeline of the several-pools scenarios, run as a script inside the test's SimulatedHost.

    python pool_script.py BARRIER_DIR NAME POOLS MAX_WORKERS TASK_PEAK HOLD TASKS OUT \
        [WAIT_S HOLD_S [warm]]

It builds its pool (with ``warm``, it also starts its MAX_WORKERS workers), waits
until all POOLS scripts have built theirs (files in BARRIER_DIR), submits TASKS
tasks that each start, wait WAIT_S (0.3 s), then hold HOLD for HOLD_S (1 s), and
writes what happened to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import gpupool.testing as gt
from gpupool import GpuPoolExecutor

PATIENCE_S = 120.0


def task(i: int, size: str, wait_s: float = 0.3, hold_s: float = 1.0) -> int:
    time.sleep(wait_s)  # the workload: start, then allocate a moment later
    with gt.hold(size):
        time.sleep(hold_s)
    return i


def _barrier(directory: str, name: str, count: str) -> None:
    """Leave ``name`` in ``directory``, then wait until ``count`` names are there."""
    Path(directory, name).touch()
    deadline = time.monotonic() + PATIENCE_S
    while len(list(Path(directory).iterdir())) < int(count) and time.monotonic() < deadline:
        time.sleep(0.01)


def _meet(directory: str, count: str) -> None:
    Path(directory).mkdir(exist_ok=True)
    _barrier(directory, str(os.getpid()), count)


def main(argv: list[str]) -> int:
    barrier, name, pools, max_workers, task_peak, size, tasks, out = argv[:8]
    wait_s, hold_s = (float(argv[8]), float(argv[9])) if len(argv) > 8 else (0.3, 1.0)
    log = Path(out).with_suffix(".jsonl")
    with GpuPoolExecutor(max_workers=int(max_workers), task_peak=task_peak, log_path=log) as pool:
        if argv[10:] == ["warm"]:
            # As many tasks as workers, each until all have started: every worker is up.
            meet = pool.options(key="meet", task_peak="64MiB")
            count = int(max_workers)
            list(meet.map(_meet, [barrier + f".{name}"] * count, [max_workers] * count))
        _barrier(barrier, name, pools)
        futures = [pool.submit(task, i, size, wait_s, hold_s) for i in range(int(tasks))]
        results, errors = [], []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        stats = pool.statistics()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    Path(out).write_text(
        json.dumps(
            {
                "results": results,
                "errors": errors,
                "out_of_memory": stats.out_of_memory,
                "retries": stats.retries,
                "widths": [width for _t, width in stats.widths],
                "events": [r["event"] for r in records],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
