"""A pool for the ``gpupool top`` tests, run as a script inside the test's SimulatedHost.

    python top_pool_script.py GATE TASKS

It builds a pool (4 workers, tasks priced 6 GiB, key "train-step"), submits TASKS tasks
that each hold 2 GiB, touch ``GATE/started-<i>`` and wait for ``GATE/go``; prints
"ready <pid>" once the pool is built, and "done" once every task has returned.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import gpupool.testing as gt
from gpupool import GpuPoolExecutor

#: A safety net so that a broken test ends instead of hanging; never waited out in a pass.
PATIENCE_S = 120.0


def step(i: int, gate: str) -> int:
    with gt.hold("2GiB"):
        Path(gate, f"started-{i}").touch()
        deadline = time.monotonic() + PATIENCE_S
        while not Path(gate, "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return i


def main(argv: list[str]) -> int:
    gate, tasks = argv
    with GpuPoolExecutor(max_workers=4, task_peak="6GiB") as pool:
        print("ready", flush=True)
        train = pool.options(key="train-step")
        futures = [train.submit(step, i, gate) for i in range(int(tasks))]
        results = [future.result() for future in futures]
    assert results == list(range(int(tasks)))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
