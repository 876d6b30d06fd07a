"""``bench/overhead.py`` run against two source trees, interleaved, in one run.

Each round runs ``overhead.py --repeat 1`` once per tree (in an order that alternates from
round to round), each in a fresh process with that tree's ``src`` first on ``PYTHONPATH``,
and keeps the gpupool executors' no-op cost per task beside that same process's
``stdlib (spawn)`` figure. Reported: per tree, the median over the rounds of the us per
task and of its ratio to stdlib in the same process (which cancels some of a shared
machine's drift), and the ratio of the two trees' medians.

On a machine loaded by others, wall time per task varies several-fold from run to run;
the CPU time the pool spends per task (its process and its workers, user and system)
varies far less. Each round therefore also runs, per tree, a pool of ``--workers`` on a
simulated card over ``--tasks`` no-op tasks in a fresh process, and reports the CPU us per
task of the pool's process and its workers (``getrusage`` and each worker's CPU times,
from the first submit, every worker started, to the last result)::

    python bench/overhead_against.py --before ../base/src --after src --rounds 6

The same rounds give the first result (construction to the first no-op's result) of each
tree's gpupool beside that process's ``stdlib (spawn)``; for that figure alone::

    python bench/overhead_against.py --before ../base/src --after src --rounds 15 \
        --tasks 100 --no-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GPUPOOL = ("gpupool (host)", "gpupool (simulated card)")


def _one(src: str, tasks: int, workers: int, compile_first: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "o.json")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "overhead.py"),
                "--repeat",
                "1",
                "--tasks",
                str(tasks),
                "--workers",
                str(workers),
                "--payload-tasks",
                "0",
                "--json",
                out,
                *(["--compile"] if compile_first else []),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(out, encoding="utf-8") as fh:
            report = json.load(fh)
    noop = report["noop_s"]["median"]
    first = report["first_result_s"]["median"]
    figures = {name: noop[name] for name in GPUPOOL}
    figures.update({f"{name} / stdlib": noop[name] / noop["stdlib (spawn)"] for name in GPUPOOL})
    # The first result, construction to the first no-op's result, beside stdlib spawn's in
    # the same process.
    figures["stdlib (spawn) first"] = first["stdlib (spawn)"]
    for name in GPUPOOL:
        figures[f"{name} first"] = first[name]
        figures[f"{name} first / stdlib"] = first[name] / first["stdlib (spawn)"]
    return figures


_CPU_SCRIPT = """
import json, resource, sys, time
import psutil
sys.path.insert(0, {bench!r})
from card_tasks import noop
from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

def cpu(workers):
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    for worker in workers:
        times = worker.cpu_times()
        total += times.user + times.system
    return total

with SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=64, host_ram="256GiB"):
    with GpuPoolExecutor({workers}, task_peak="1GiB") as ex:
        list(ex.map(noop, range({workers} * 4)))  # every worker started
        workers = [psutil.Process(pid) for pid in ex._processes]
        before_s, start = cpu(workers), time.perf_counter()
        futures = [ex.submit(noop, i) for i in range({tasks})]
        for future in futures:
            future.result()
        wall_s, cpu_s = time.perf_counter() - start, cpu(workers) - before_s
print(json.dumps({{"cpu_s": cpu_s / {tasks}, "wall_s": wall_s / {tasks}}}))
"""


def _cpu_one(src: str, tasks: int, workers: int) -> dict[str, float]:
    """CPU and wall seconds per no-op task of a pool on a simulated card (start to shutdown,
    workers included), in a fresh process importing gpupool from ``src``."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    script = _CPU_SCRIPT.format(bench=HERE, tasks=tasks, workers=workers)
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, env=env, capture_output=True, text=True
    )
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the src directory of the tree before")
    parser.add_argument("--after", required=True, help="the src directory of the tree after")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU-time figure")
    parser.add_argument("--no-cpu", action="store_true", help="no CPU-time figure")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="overhead.py --compile: each tree's package compiled to bytecode first",
    )
    args = parser.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    cpu: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for label in ("before", "after") if r % 2 == 0 else ("after", "before"):
            if not args.cpu_only:
                runs[label].append(_one(trees[label], args.tasks, args.workers, args.compile))
            if not args.no_cpu:
                cpu[label].append(_cpu_one(trees[label], args.tasks, args.workers))
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(
        f"no-op cost per task, {args.tasks} tasks, {args.workers} workers, medians of "
        f"{args.rounds} interleaved rounds (load {os.getloadavg()[0]:.1f})"
    )
    medians: dict[str, dict[str, float]] = {}
    if not args.cpu_only:
        medians = {
            label: {k: statistics.median(run[k] for run in rows) for k in rows[0]}
            for label, rows in runs.items()
        }
        print(
            f"{'overhead.py':<26}{'before us':>11}{'after us':>10}{'after/before':>14}"
            f"{'before/stdlib':>15}{'after/stdlib':>14}{'ratio of ratios':>17}"
        )
        for name in GPUPOOL:
            b, a = medians["before"], medians["after"]
            key = f"{name} / stdlib"
            print(
                f"{name:<26}{b[name] * 1e6:>11.1f}{a[name] * 1e6:>10.1f}"
                f"{a[name] / b[name]:>14.3f}{b[key]:>15.3f}{a[key]:>14.3f}"
                f"{a[key] / b[key]:>17.3f}"
            )
        print(
            f"{'first result':<26}{'before ms':>11}{'after ms':>10}{'after/before':>14}"
            f"{'before/stdlib':>15}{'after/stdlib':>14}{'ratio of ratios':>17}"
        )
        for name in ("stdlib (spawn)", *GPUPOOL):
            b, a = medians["before"], medians["after"]
            first = f"{name} first"
            if name == "stdlib (spawn)":
                print(f"{name:<26}{b[first] * 1e3:>11.1f}{a[first] * 1e3:>10.1f}")
                continue
            key = f"{name} first / stdlib"
            print(
                f"{name:<26}{b[first] * 1e3:>11.1f}{a[first] * 1e3:>10.1f}"
                f"{a[first] / b[first]:>14.3f}{b[key]:>15.3f}{a[key]:>14.3f}"
                f"{a[key] / b[key]:>17.3f}"
            )
    if args.no_cpu:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"runs": runs, "medians": medians, "args": vars(args)}, fh, indent=2)
        return 0
    cpu_medians = {
        label: {k: statistics.median(run[k] for run in rows) for k in rows[0]}
        for label, rows in cpu.items()
    }
    b, a = cpu_medians["before"], cpu_medians["after"]
    print(f"{'simulated card':<30}{'before us':>11}{'after us':>10}{'after/before':>14}")
    for figure, label in (("cpu_s", "CPU per task"), ("wall_s", "wall per task")):
        print(
            f"{label:<30}{b[figure] * 1e6:>11.1f}{a[figure] * 1e6:>10.1f}"
            f"{a[figure] / b[figure]:>14.3f}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "runs": runs,
                    "medians": medians,
                    "cpu_runs": cpu,
                    "cpu_medians": cpu_medians,
                    "args": vars(args),
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
