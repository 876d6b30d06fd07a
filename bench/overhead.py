"""Per-task overhead of GpuPoolExecutor against the standard library and loky, side by side.

Each executor runs the same no-op tasks with the same number of workers in
the same process, after a warm-up that starts its workers; the figure is
the wall time from the first submit to the last result, divided by the
number of tasks. Reported as microseconds per task and as ratios to the
standard library's ``ProcessPoolExecutor`` (spawn). gpupool runs as a
host-bounded pool (no device) and, with ``--simulated``, on a simulated
card, where every task is also priced, gated and measured by the probe.

    python bench/overhead.py --tasks 5000 --workers 2 --repeat 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def noop(x: int) -> int:
    """The task: nothing, so the figure is the executor's own cost."""
    return x


def _time_run(make: Callable[[], Any], tasks: int, workers: int) -> float:
    with make() as ex:
        # Warm-up: start every worker before timing.
        list(ex.map(noop, range(workers * 4)))
        start = time.perf_counter()
        futures = [ex.submit(noop, i) for i in range(tasks)]
        for future in futures:
            future.result()
        elapsed = time.perf_counter() - start
    return elapsed / tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs per executor; median kept")
    parser.add_argument("--simulated", action="store_true", help="also gpupool on a sim card")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)

    import loky

    from gpupool import GpuPoolExecutor

    spawn = multiprocessing.get_context("spawn")
    executors: dict[str, Callable[[], Any]] = {
        "stdlib (spawn)": lambda: concurrent.futures.ProcessPoolExecutor(
            args.workers, mp_context=spawn
        ),
        "loky": lambda: loky.ProcessPoolExecutor(args.workers),
        "gpupool (host)": lambda: GpuPoolExecutor(args.workers),
    }
    host = None
    if args.simulated:
        from gpupool.testing import SimulatedDevice, SimulatedHost

        host = SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=64, host_ram="256GiB")
        host.__enter__()
        executors["gpupool (simulated card)"] = lambda: GpuPoolExecutor(
            args.workers, task_peak="1GiB"
        )
    try:
        per_task_s: dict[str, float] = {}
        for name, make in executors.items():
            runs = [_time_run(make, args.tasks, args.workers) for _ in range(args.repeat)]
            per_task_s[name] = statistics.median(runs)
    finally:
        if host is not None:
            host.__exit__(None, None, None)

    base = per_task_s["stdlib (spawn)"]
    loky_s = per_task_s["loky"]
    print(
        f"{args.tasks} no-op tasks, {args.workers} workers, median of {args.repeat} "
        f"(Python {sys.version.split()[0]}, loky {loky.__version__})"
    )
    print(f"{'executor':<28}{'us/task':>10}{'vs stdlib':>12}{'vs loky':>10}")
    for name, value in per_task_s.items():
        print(f"{name:<28}{value * 1e6:>10.1f}{value / base:>11.2f}x{value / loky_s:>9.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "tasks": args.tasks,
                    "workers": args.workers,
                    "per_task_s": per_task_s,
                    "ratio_to_stdlib": {k: v / base for k, v in per_task_s.items()},
                    "ratio_to_loky": {k: v / loky_s for k, v in per_task_s.items()},
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
