"""Per-task overhead of GpuPoolExecutor against the standard library and loky, side by side.

One run measures five executors with the same number of workers, in the
same process, in interleaved rounds (each round runs every executor once,
in an order rotated from round to round, so that a burst of noise on a
shared machine does not land on one executor's runs only), and reports the
median of the rounds:

* ``stdlib (spawn)`` and ``stdlib (forkserver)``: ``concurrent.futures.
  ProcessPoolExecutor`` with that start method (the forkserver process is
  started once per benchmark process, as in an application: only the first
  round's construction pays for it);
* ``loky``: ``loky.ProcessPoolExecutor`` (a fresh executor per run, not
  loky's reusable one);
* ``gpupool (host)``: a host-bounded ``GpuPoolExecutor`` (no device);
* ``gpupool (simulated card)``: the device path, ``GpuPoolExecutor(task_peak=
  "1GiB")`` inside a :class:`gpupool.testing.SimulatedHost` with one 80 GiB
  card (entered before the clock starts), where every task is priced, gated
  against the card's live reading and the host's booking table, and measured.

Three figures per executor, each also as a ratio to ``stdlib (spawn)`` and
to loky:

* no-op: ``--tasks`` no-op tasks (3,000 by default) submitted at once after
  a warm-up that starts every worker; wall time from the first submit to the
  last result, divided by the number of tasks (us per task);
* payload: ``--payload-tasks`` tasks (300) whose argument and result are
  ``--payload-mib`` MiB of bytes (1), timed the same way;
* first result: wall time from constructing the executor to the result of
  its first no-op task (ms), the cost of starting a worker and its imports;
* cold start (``--cold`` rounds, 5 by default; 0 skips it): a fresh interpreter per
  run, on a script that imports its executor at its top level, as a user's script
  does, and makes the pool under ``if __name__ == "__main__":``; wall time from
  starting the interpreter to its first no-op result (ms). It counts what the
  warm figure cannot: importing the executor's package, the first pool's own
  imports, and every spawn worker importing the script (and with it the
  executor's package) again.

The first result includes the worker's imports: where gpupool's modules have no
bytecode cache that a worker can read (an editable install beside
``PYTHONDONTWRITEBYTECODE=1``), every worker compiles them from source, which an
installed package never does; the report's header says which, and ``--compile``
compiles the package first, as ``pip install`` does.

The task functions live in ``bench/card_tasks.py`` (imported by name in every
worker), so no executor pays for sending a function by value::

    python bench/overhead.py                                  # 3,000 tasks, 7 rounds
    python bench/overhead.py --tasks 300 --payload-tasks 20 --repeat 1 --json /tmp/o.json

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
import contextlib
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

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)


def noop(x: int) -> int:
    """The task: nothing, so the figure is the executor's own cost."""
    return x


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


COMPARE_EXECUTORS = (
    "stdlib (spawn)",
    "stdlib (forkserver)",
    "loky",
    "gpupool (host)",
    "gpupool (simulated card)",
)
BASE = "stdlib (spawn)"


def _maker(name: str, workers: int) -> tuple[Any, Callable[[], Any]]:
    """A context to enter before the clock starts (the simulated host), and the executor's maker."""
    import loky

    from gpupool import GpuPoolExecutor

    if name.startswith("stdlib"):
        method = "spawn" if "spawn" in name else "forkserver"
        context = multiprocessing.get_context(method)
        return contextlib.nullcontext(), lambda: concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context
        )
    if name == "loky":
        return contextlib.nullcontext(), lambda: loky.ProcessPoolExecutor(workers)
    if name == "gpupool (host)":
        return contextlib.nullcontext(), lambda: GpuPoolExecutor(workers)
    from gpupool.testing import SimulatedDevice, SimulatedHost

    host = SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=64, host_ram="256GiB")
    return host, lambda: GpuPoolExecutor(workers, task_peak="1GiB")


def _compare_round(name: str, args: argparse.Namespace, payload: bytes) -> dict[str, float]:
    """One executor, once: first result, no-op per task and payload per task (seconds)."""
    from card_tasks import echo, noop

    outer, make = _maker(name, args.workers)
    with outer:
        started = time.perf_counter()
        with make() as ex:
            ex.submit(noop, 0).result()
            first_result_s = time.perf_counter() - started
            list(ex.map(noop, range(args.workers * 4)))  # warm-up: start every worker
            start = time.perf_counter()
            futures = [ex.submit(noop, i) for i in range(args.tasks)]
            for future in futures:
                future.result()
            noop_s = (time.perf_counter() - start) / args.tasks
            payload_s = float("nan")
            if args.payload_tasks > 0:
                list(ex.map(echo, [payload] * args.workers))  # warm the payload path
                start = time.perf_counter()
                futures = [ex.submit(echo, payload) for _ in range(args.payload_tasks)]
                for future in futures:
                    if len(future.result()) != len(payload):
                        raise RuntimeError(f"{name} returned a short payload")
                payload_s = (time.perf_counter() - start) / args.payload_tasks
    return {"noop_s": noop_s, "payload_s": payload_s, "first_result_s": first_result_s}


def _bytecode(compile_first: bool) -> dict[str, Any]:
    """Whether the modules a worker imports from gpupool have bytecode caches a worker reads.

    Without one (an editable install beside ``PYTHONDONTWRITEBYTECODE=1``, or a tree the
    user cannot write), every worker compiles them from source, some 25-40 ms on a 2-core
    machine, which a wheel's install (``pip`` compiles) never pays and the standard
    library's own modules never do. ``compile_first``: compile gpupool's package first
    (``compileall``), as an install would."""
    import compileall
    import importlib
    import importlib.util

    import gpupool

    package_dir = os.path.dirname(os.path.abspath(gpupool.__file__))
    if compile_first:
        compileall.compile_dir(package_dir, quiet=1)
    for name in ("gpupool._pool.launch", "gpupool._pool.worker", "gpupool._child.probe"):
        importlib.import_module(name)
    modules = [m for n, m in sys.modules.items() if n == "gpupool" or n.startswith("gpupool.")]
    missing = []
    for module in modules:
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        cached = importlib.util.cache_from_source(source)
        if not os.path.exists(cached) or os.path.getmtime(cached) < os.path.getmtime(source):
            missing.append(module.__name__)
    return {
        "package": package_dir,
        "modules": len(modules),
        "without_bytecode": sorted(missing),
        "compiled_first": compile_first,
        "dont_write_bytecode": sys.dont_write_bytecode,
    }


def _bytecode_line(info: dict[str, Any]) -> str:
    missing = len(info["without_bytecode"])
    if not missing:
        how = "compiled by --compile" if info["compiled_first"] else "cached"
        return f"gpupool's modules: bytecode {how} ({info['modules']} loaded)"
    writes = "off (PYTHONDONTWRITEBYTECODE)" if info["dont_write_bytecode"] else "on"
    return (
        f"gpupool's modules: {missing} of {info['modules']} without bytecode, writing it "
        f"{writes}: each worker compiles them from source (--compile to compile them first)"
    )


#: The script a cold start runs, per executor: its imports at the top level, as a user's.
_COLD_IMPORTS = {
    "stdlib (spawn)": "import concurrent.futures, multiprocessing",
    "stdlib (forkserver)": "import concurrent.futures, multiprocessing",
    "loky": "import loky",
    "gpupool (host)": "from gpupool import GpuPoolExecutor",
    "gpupool (simulated card)": (
        "from gpupool import GpuPoolExecutor\n"
        "from gpupool.testing import SimulatedDevice, SimulatedHost"
    ),
}
_COLD_MAKERS = {
    "stdlib (spawn)": (
        "concurrent.futures.ProcessPoolExecutor("
        "{workers}, mp_context=multiprocessing.get_context('spawn'))"
    ),
    "stdlib (forkserver)": (
        "concurrent.futures.ProcessPoolExecutor("
        "{workers}, mp_context=multiprocessing.get_context('forkserver'))"
    ),
    "loky": "loky.ProcessPoolExecutor({workers})",
    "gpupool (host)": "GpuPoolExecutor({workers})",
    "gpupool (simulated card)": "GpuPoolExecutor({workers}, task_peak='1GiB')",
}
_COLD_SCRIPT = """\
import sys
sys.path.insert(0, {bench_dir!r})
{imports}
from card_tasks import noop
import contextlib

if __name__ == "__main__":
    outer = {outer}
    with outer:
        with {maker} as ex:
            ex.submit(noop, 0).result()
            print("first", flush=True)
"""


def _cold_round(name: str, workers: int, directory: str) -> float:
    """One cold start of ``name``: seconds from starting a fresh interpreter on its script to
    the line it prints at its first result."""
    card = name == "gpupool (simulated card)"
    outer = (
        "SimulatedHost(devices=[SimulatedDevice(total='80GiB')], cpus=64, host_ram='256GiB')"
        if card
        else "contextlib.nullcontext()"
    )
    path = os.path.join(directory, "cold_" + "".join(c for c in name if c.isalnum()) + ".py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(
            _COLD_SCRIPT.format(
                bench_dir=BENCH_DIR,
                imports=_COLD_IMPORTS[name],
                outer=outer,
                maker=_COLD_MAKERS[name].format(workers=workers),
            )
        )
    started = time.perf_counter()
    with subprocess.Popen(
        [sys.executable, path], stdout=subprocess.PIPE, text=True, cwd=directory
    ) as child:
        assert child.stdout is not None
        line = child.stdout.readline()
        elapsed_s = time.perf_counter() - started
        child.stdout.read()
    if line.strip() != "first" or child.returncode != 0:
        raise RuntimeError(f"{name}'s cold start failed (exit {child.returncode}): {line!r}")
    return elapsed_s


def _compare(args: argparse.Namespace) -> int:
    import tempfile

    import loky

    bytecode = _bytecode(args.compile)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p
    )
    payload = os.urandom(int(args.payload_mib * 2**20))
    names = list(COMPARE_EXECUTORS)
    runs: dict[str, dict[str, list[float]]] = {
        n: {"noop_s": [], "payload_s": [], "first_result_s": []} for n in names
    }
    for r in range(args.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for figure, value in _compare_round(name, args, payload).items():
                runs[name][figure].append(value)
        print(f"  round {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    for n in names:
        runs[n]["cold_start_s"] = []
    with tempfile.TemporaryDirectory() as directory:
        for r in range(args.cold):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name]["cold_start_s"].append(_cold_round(name, args.workers, directory))
            print(f"  cold round {r + 1}/{args.cold} done", file=sys.stderr, flush=True)
    figures: dict[str, dict[str, Any]] = {}
    for figure in ("noop_s", "payload_s", "first_result_s", "cold_start_s"):
        if not runs[BASE][figure]:
            continue
        median = {n: statistics.median(runs[n][figure]) for n in names}
        figures[figure] = {
            "median": median,
            "ratio_to_stdlib_spawn": {n: median[n] / median[BASE] for n in names},
            "ratio_to_loky": {n: median[n] / median["loky"] for n in names},
            "runs": {n: runs[n][figure] for n in names},
        }
    print(
        f"{args.workers} workers, medians of {args.repeat} interleaved rounds; no-op: "
        f"{args.tasks} tasks; payload: {args.payload_tasks} tasks of {args.payload_mib:g} MiB "
        f"each way (Python {sys.version.split()[0]}, loky {loky.__version__}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})"
    )
    print(_bytecode_line(bytecode))
    print(
        f"{'executor':<26}{'no-op us':>10}{'x spawn':>9}{'x loky':>8}"
        f"{'payload us':>12}{'x spawn':>9}{'x loky':>8}{'1st ms':>9}{'x spawn':>9}"
        + (f"{'cold ms':>9}{'x spawn':>9}" if "cold_start_s" in figures else "")
    )
    for n in names:
        cells = ""
        for figure, scale, width in (("noop_s", 1e6, 10), ("payload_s", 1e6, 12)):
            f = figures[figure]
            cells += (
                f"{f['median'][n] * scale:>{width}.1f}{f['ratio_to_stdlib_spawn'][n]:>8.2f}x"
                f"{f['ratio_to_loky'][n]:>7.2f}x"
            )
        for figure in ("first_result_s", "cold_start_s"):
            if figure in figures:
                f = figures[figure]
                cells += f"{f['median'][n] * 1e3:>9.1f}{f['ratio_to_stdlib_spawn'][n]:>8.2f}x"
        print(f"{n:<26}{cells}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "mode": "compare",
                    "tasks": args.tasks,
                    "payload_tasks": args.payload_tasks,
                    "payload_bytes": len(payload),
                    "workers": args.workers,
                    "rounds": args.repeat,
                    "cold_rounds": args.cold,
                    "executors": names,
                    "load_average": os.getloadavg()[0],
                    "gpupool_bytecode": bytecode,
                    **figures,
                },
                fh,
                indent=2,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000, help="no-op tasks per run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--repeat", type=int, default=7, help="interleaved rounds (scaling: runs per cell)"
    )
    parser.add_argument("--payload-tasks", type=int, default=300, help="0: no payload figure")
    parser.add_argument("--payload-mib", type=float, default=1.0)
    parser.add_argument(
        "--simulated", action="store_true", help="kept for old command lines: always measured"
    )
    parser.add_argument(
        "--cold", type=int, default=5, help="cold-start rounds, a fresh interpreter each (0: none)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile gpupool's package to bytecode first, as an install does",
    )
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

    return _compare(args)


if __name__ == "__main__":
    sys.exit(main())
