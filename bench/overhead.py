"""Per-task overhead of GpuPoolExecutor against the standard library and loky, side by side.

Each executor runs the same no-op tasks with the same number of workers in
the same process, after a warm-up that starts its workers; the figure is
the wall time from the first submit to the last result, divided by the
number of tasks. Reported as microseconds per task and as ratios to the
standard library's ``ProcessPoolExecutor`` (spawn). gpupool runs as a
host-bounded pool (no device) and, with ``--simulated``, on a simulated
card, where every task is also priced, gated and measured by the probe.

    python bench/overhead.py --tasks 5000 --workers 2 --repeat 3

With ``--scaling`` it measures how the cost grows instead: for every task
count in ``--task-counts`` (1k, 10k, 100k; counts above ``--max-tasks`` are
skipped, 10k by default) and every worker count in ``--worker-counts`` (2, 8,
32), each executor runs in a fresh Python process of its own, so that the
parent's memory figures belong to that one run. Per run it reports the wall
time per task (first submit to last result, after a warm-up that starts every
worker) and the parent's memory: the growth of its peak RSS
(``ru_maxrss``) from just before the first submit to the end of the run,
which is what holding that many futures and that much bookkeeping costs.
gpupool runs on a simulated card big enough for every width (256 GiB, 64
CPUs), so each task is priced, gated and measured; the standard library and
loky simply get ``max_workers``. A flat per-task time from 1k to 100k tasks
means the pool's decision-making does not grow with the number of tasks.

    python bench/overhead.py --scaling                      # 1k and 10k tasks
    python bench/overhead.py --scaling --max-tasks 100000   # and 100k
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
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


class _Hosted:
    """A pool made inside a simulated host, both closed together (a context manager)."""

    def __init__(self, host: Any, make: Callable[[], Any]) -> None:
        self._host = host
        self._make = make
        self._pool: Any = None

    def __enter__(self) -> Any:
        self._host.__enter__()
        self._pool = self._make()
        return self._pool.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._pool.__exit__(*exc)
        finally:
            self._host.__exit__(*exc)


SCALING_EXECUTORS = ("stdlib (spawn)", "loky", "gpupool (host)", "gpupool (simulated card)")


def _maxrss_bytes() -> int:
    """This process's peak RSS so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _one_run(name: str, tasks: int, workers: int) -> dict[str, Any]:
    """One scaling run in this (fresh) process: time per task and the parent's RSS growth."""
    import loky

    from gpupool import GpuPoolExecutor

    host = None
    if name == "stdlib (spawn)":
        spawn = multiprocessing.get_context("spawn")

        def make() -> Any:
            return concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn)
    elif name == "loky":

        def make() -> Any:
            return loky.ProcessPoolExecutor(workers)
    elif name == "gpupool (host)":

        def make() -> Any:
            return GpuPoolExecutor(workers)
    else:
        from gpupool.testing import SimulatedDevice, SimulatedHost

        host = SimulatedHost(devices=[SimulatedDevice(total="256GiB")], cpus=64, host_ram="512GiB")
        host.__enter__()

        def make() -> Any:
            return GpuPoolExecutor(workers, task_peak="1GiB")

    try:
        with make() as ex:
            list(ex.map(noop, range(workers * 4)))  # warm-up: start every worker
            rss_before = _maxrss_bytes()
            start = time.perf_counter()
            futures = [ex.submit(noop, i) for i in range(tasks)]
            for future in futures:
                future.result()
            elapsed = time.perf_counter() - start
            rss_after = _maxrss_bytes()
            width = getattr(ex, "width", workers)
    finally:
        if host is not None:
            host.__exit__(None, None, None)
    return {
        "executor": name,
        "tasks": tasks,
        "workers": workers,
        "width": width,
        "per_task_s": elapsed / tasks,
        "rss_growth_bytes": rss_after - rss_before,
        "rss_peak_bytes": rss_after,
    }


def _scaling(args: argparse.Namespace) -> int:
    import loky

    counts = [n for n in args.task_counts if n <= args.max_tasks]
    skipped = [n for n in args.task_counts if n > args.max_tasks]
    rows: list[dict[str, Any]] = []
    for workers in args.worker_counts:
        for tasks in counts:
            for name in SCALING_EXECUTORS:
                runs = []
                for _ in range(args.repeat):
                    out = subprocess.run(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--one",
                            name,
                            str(tasks),
                            str(workers),
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                row = dict(runs[0])
                row["per_task_s"] = statistics.median(r["per_task_s"] for r in runs)
                row["rss_growth_bytes"] = statistics.median(r["rss_growth_bytes"] for r in runs)
                row["rss_peak_bytes"] = statistics.median(r["rss_peak_bytes"] for r in runs)
                rows.append(row)
                print(
                    f"  ran {name} tasks={tasks} workers={workers}: "
                    f"{row['per_task_s'] * 1e6:.1f} us/task",
                    file=sys.stderr,
                    flush=True,
                )

    def get(name: str, tasks: int, workers: int) -> dict[str, Any]:
        return next(
            r for r in rows if (r["executor"], r["tasks"], r["workers"]) == (name, tasks, workers)
        )

    print(
        f"scaling: no-op tasks, median of {args.repeat} per cell, each run in a fresh process "
        f"(Python {sys.version.split()[0]}, loky {loky.__version__}, {os.cpu_count()} CPUs)"
    )
    if skipped:
        print(f"skipped task counts above --max-tasks={args.max_tasks}: {skipped}")
    print(
        f"{'workers':>7} {'tasks':>7} {'executor':<26}{'us/task':>9}{'vs stdlib':>11}"
        f"{'vs loky':>9}{'RSS +MiB':>10}{'B/task':>8}"
    )
    for workers in args.worker_counts:
        for tasks in counts:
            base = get("stdlib (spawn)", tasks, workers)
            lk = get("loky", tasks, workers)
            for name in SCALING_EXECUTORS:
                r = get(name, tasks, workers)
                print(
                    f"{workers:>7} {tasks:>7} {name:<26}{r['per_task_s'] * 1e6:>9.1f}"
                    f"{r['per_task_s'] / base['per_task_s']:>10.2f}x"
                    f"{r['per_task_s'] / lk['per_task_s']:>8.2f}x"
                    f"{r['rss_growth_bytes'] / 2**20:>10.1f}"
                    f"{r['rss_growth_bytes'] / tasks:>8.0f}"
                )
    print("\nper-task time by task count (flat = decision cost does not grow with tasks):")
    print(f"{'executor':<26}{'workers':>8}" + "".join(f"{n:>10}" for n in counts))
    for name in SCALING_EXECUTORS:
        for workers in args.worker_counts:
            cells = "".join(f"{get(name, n, workers)['per_task_s'] * 1e6:>8.1f}us" for n in counts)
            print(f"{name:<26}{workers:>8}{cells}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {"mode": "scaling", "repeat": args.repeat, "skipped": skipped, "rows": rows},
                fh,
                indent=2,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs per executor; median kept")
    parser.add_argument("--simulated", action="store_true", help="also gpupool on a sim card")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument("--scaling", action="store_true", help="tasks x workers matrix")
    parser.add_argument(
        "--task-counts",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1000, 10000, 100000],
    )
    parser.add_argument(
        "--worker-counts", type=lambda v: [int(x) for x in v.split(",")], default=[2, 8, 32]
    )
    parser.add_argument(
        "--max-tasks", type=int, default=10000, help="skip larger task counts in --scaling"
    )
    parser.add_argument(
        "--one", nargs=3, metavar=("EXECUTOR", "TASKS", "WORKERS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.one:
        name, tasks, workers = args.one
        print(json.dumps(_one_run(name, int(tasks), int(workers))))
        return 0
    if args.scaling:
        if "--repeat" not in (argv if argv is not None else sys.argv):
            args.repeat = 1
        return _scaling(args)

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
    if args.simulated:
        from gpupool.testing import SimulatedDevice, SimulatedHost

        def on_simulated_card() -> Any:
            # The host is entered around this run only: inside it every gpupool
            # pool reads the simulated card, the host-bounded one included.
            host = SimulatedHost(
                devices=[SimulatedDevice(total="80GiB")], cpus=64, host_ram="256GiB"
            )
            pool = _Hosted(host, lambda: GpuPoolExecutor(args.workers, task_peak="1GiB"))
            return pool

        executors["gpupool (simulated card)"] = on_simulated_card
    # Interleave the executors over the repeats, so that a burst of noise on
    # this shared machine does not land on one executor's runs only.
    runs: dict[str, list[float]] = {name: [] for name in executors}
    for _ in range(args.repeat):
        for name, make in executors.items():
            runs[name].append(_time_run(make, args.tasks, args.workers))
    per_task_s = {name: statistics.median(values) for name, values in runs.items()}

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
