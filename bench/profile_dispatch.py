"""Per-task profile of the pool's dispatcher thread (cProfile in that thread only), as a table.

Each round builds a pool (by default on a simulated 80 GiB card,
``GpuPoolExecutor(2, task_peak="1GiB")``, the device path of
``bench/overhead.py``; ``--host`` for the host path), starts its workers with
a warm-up, then runs ``--tasks`` no-op tasks (3,000) submitted at once.

How the thread is profiled without touching the library: the script wraps
the dispatcher's scheduling pass (``Dispatcher._schedule``, run by the
dispatcher thread once per turn of its loop) in a function of its own. After
the warm-up, the main thread raises a flag; the dispatcher thread's next
pass enables a ``cProfile.Profile`` in that thread (on Python 3.11 and
earlier a profiler sees only the thread that enabled it); once the last
result is in, the next pass disables it. So the profile spans the timed
tasks' turns of the loop, from one pass to another, and nothing of the
construction, the warm-up or the shutdown.

Per function: calls per task and microseconds per task, cumulative (with
what it calls) and own (``tottime``), each the median over ``--rounds``
rounds (5). The table lists the functions of interest first (the booking
table's exchange, publishing the bookings, the planner's next start, width,
a task's end and the turn's settle of what the ended tasks measured, parsing
an answer, reading the cards, the waiting counts, the asks; a row for each
that was called), then the other gpupool functions by cumulative time
(``--top``, 15). The thread's own total per task is the sum of every
function's own time; the time spent waiting in ``select`` (the thread idle)
is shown apart. ``--timer cpu`` profiles the thread's CPU time instead of
wall time (then waiting on a lock or a file does not count)::

    python bench/profile_dispatch.py                   # 3,000 tasks, 5 rounds
    python bench/profile_dispatch.py --host
    python bench/profile_dispatch.py --tasks 200 --rounds 1 --json /tmp/p.json

On Python 3.12 and later cProfile is built on ``sys.monitoring``, which
reports every thread's calls to an enabled profiler: the table then also
holds the main thread's ``submit`` and ``result`` (the script says so).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import inspect
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

#: The steps the table shows first, by the end of their qualified name.
OF_INTEREST = (
    "BookingTable.exchange",
    "Dispatcher._publish_bookings",
    "Dispatcher._book_with_others",
    "Dispatcher._read_cards",
    ".next_start",
    "._width_now",
    ".finished",
    "Learning.ended",
    "Learning.settle",
    "parse_answer",
    ".waiting_count",
    ".need_bytes",
    ".ask_for",
    "Dispatcher._schedule",
    "WorkerSet._receive",
    "WorkerSet.flush",
    "CardReader.read",
    "Public.publish",
)


class _Window:
    """The flags the main thread raises, and the profile the dispatcher thread keeps."""

    def __init__(self, timer: Callable[[], float] | None) -> None:
        self.timer = timer
        self.start = threading.Event()
        self.stop = threading.Event()
        self.profile: cProfile.Profile | None = None
        self.closed = threading.Event()

    def pass_begins(self) -> None:
        """Called by the dispatcher thread at the start of each scheduling pass."""
        if self.closed.is_set():
            return
        if self.profile is None and self.start.is_set():
            self.profile = cProfile.Profile(self.timer) if self.timer else cProfile.Profile()
            self.profile.enable()
        elif self.profile is not None and self.stop.is_set():
            self.profile.disable()
            self.closed.set()


def _install(window_of: dict[str, _Window | None]) -> None:
    """Wrap ``Dispatcher._schedule`` so that each pass first lets the current window act."""
    from gpupool._pool.dispatcher import Dispatcher

    original = getattr(Dispatcher, "_schedule", None)
    if original is None:
        raise SystemExit(
            "gpupool's Dispatcher has no _schedule method (renamed?): point _install at the "
            "method its dispatcher thread runs once per turn of its loop"
        )

    def _schedule(self: Any) -> float | None:
        window = window_of["now"]
        if window is not None:
            window.pass_begins()
        return original(self)

    Dispatcher._schedule = _schedule  # type: ignore[method-assign]
    code = original.__code__
    _RENAMED[(code.co_filename, code.co_firstlineno, code.co_name)] = "Dispatcher._schedule"


#: Library functions this script replaced on their class, by their code's key.
_RENAMED: dict[tuple[str, int, str], str] = {}


def _qualnames() -> dict[tuple[str, int, str], str]:
    """(file, first line, name) of every gpupool function and method -> its qualified name."""
    names: dict[tuple[str, int, str], str] = {}

    def add(obj: Any) -> None:
        fn = inspect.unwrap(obj) if callable(obj) else obj
        code = getattr(fn, "__code__", None)
        if code is not None:
            names[(code.co_filename, code.co_firstlineno, code.co_name)] = fn.__qualname__

    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("gpupool") or module is None:
            continue
        for value in vars(module).values():
            if getattr(value, "__module__", None) != module_name:
                continue
            if inspect.isclass(value):
                for member in vars(value).values():
                    if isinstance(member, property):
                        for f in (member.fget, member.fset):
                            if f is not None:
                                add(f)
                    elif isinstance(member, (staticmethod, classmethod)):
                        add(member.__func__)
                    elif inspect.isfunction(member):
                        add(member)
            elif inspect.isfunction(value):
                add(value)
    names.update(_RENAMED)
    return names


def _one_round(args: argparse.Namespace, window_of: dict[str, _Window | None]) -> dict[str, Any]:
    import contextlib

    from card_tasks import noop
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    timer = time.thread_time if args.timer == "cpu" else None
    window = _Window(timer)
    window_of["now"] = window
    outer: Any = contextlib.nullcontext()
    if not args.host:
        outer = SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=64, host_ram="256GiB")
    with outer:
        extra = {} if args.host else {"task_peak": "1GiB"}
        with GpuPoolExecutor(args.workers, **extra) as ex:
            list(ex.map(noop, range(args.workers * 4)))  # warm-up: start every worker
            window.start.set()
            ex.submit(noop, -1).result()  # a turn after the flag: the profile is on
            started = time.perf_counter()
            futures = [ex.submit(noop, i) for i in range(args.tasks)]
            for future in futures:
                future.result()
            elapsed_s = time.perf_counter() - started
            window.stop.set()
            ex.submit(noop, -2).result()  # a turn after the flag: the profile is off
    window_of["now"] = None
    if window.profile is None:
        raise RuntimeError("the dispatcher thread never enabled the profile")
    return {"stats": pstats.Stats(window.profile).stats, "per_task_s": elapsed_s / args.tasks}


def _rows(stats: dict[Any, Any], names: dict[tuple[str, int, str], str], tasks: int) -> dict:
    """Per function: calls, cumulative and own microseconds per task.

    The window also holds the two marker tasks at its edges: two more than ``tasks``, not
    counted (0.07 % at 3,000 tasks).
    """
    rows: dict[str, dict[str, float]] = {}
    for (filename, line, name), (_cc, calls, own, cumulative, _callers) in stats.items():
        label = names.get((filename, line, name))
        if label is None:
            if "gpupool" in filename:
                label = f"{os.path.basename(filename)}:{line}({name})"
            elif filename == "~":
                label = name
            else:
                label = f"{os.path.basename(filename)}:{line}({name})"
        row = rows.setdefault(label, {"calls": 0.0, "cum_us": 0.0, "own_us": 0.0})
        row["calls"] += calls / tasks
        row["cum_us"] += cumulative * 1e6 / tasks
        row["own_us"] += own * 1e6 / tasks
        row["gpupool"] = float("gpupool" in filename and "site-packages" not in filename)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--host", action="store_true", help="the host path (no card)")
    parser.add_argument("--timer", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--top", type=int, default=15, help="other gpupool functions shown")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p
    )
    importlib.import_module("gpupool")
    window_of: dict[str, _Window | None] = {"now": None}
    _install(window_of)
    per_round = []
    per_task_s = []
    for r in range(args.rounds):
        out = _one_round(args, window_of)
        names = _qualnames()
        per_round.append(_rows(out["stats"], names, args.tasks))
        per_task_s.append(out["per_task_s"])
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    report = _report(per_round, per_task_s, args)
    _print(report, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


def _report(
    per_round: list[dict[str, dict[str, float]]], per_task_s: list[float], args: argparse.Namespace
) -> dict[str, Any]:
    labels = set().union(*per_round)
    medians: dict[str, dict[str, float]] = {}
    for label in labels:
        present = [r[label] for r in per_round if label in r]
        padded = present + [{"calls": 0.0, "cum_us": 0.0, "own_us": 0.0}] * (
            len(per_round) - len(present)
        )
        medians[label] = {
            field: statistics.median(x[field] for x in padded)
            for field in ("calls", "cum_us", "own_us")
        }
        medians[label]["gpupool"] = present[0].get("gpupool", 0.0)
    interest = [
        label
        for pattern in OF_INTEREST
        for label in sorted(medians)
        if label.endswith(pattern) and medians[label]["gpupool"]
    ]
    interest = list(dict.fromkeys(interest))
    others = sorted(
        (lb for lb in medians if medians[lb]["gpupool"] and lb not in interest),
        key=lambda lb: -medians[lb]["cum_us"],
    )
    others = others[: args.top]
    total_own_us = statistics.median(sum(x["own_us"] for x in r.values()) for r in per_round)
    select_us = statistics.median(
        sum(x["own_us"] for lb, x in r.items() if "select" in lb and "poll" in lb.lower())
        for r in per_round
    )
    return {
        "tasks": args.tasks,
        "workers": args.workers,
        "rounds": args.rounds,
        "path": "host" if args.host else "simulated card",
        "timer": args.timer,
        "python": sys.version.split()[0],
        "all_threads": sys.version_info >= (3, 12),
        "wall_per_task_us": statistics.median(per_task_s) * 1e6,
        "thread_own_per_task_us": total_own_us,
        "select_wait_per_task_us": select_us,
        "of_interest": [{"function": lb, **medians[lb]} for lb in interest],
        "top": [{"function": lb, **medians[lb]} for lb in others],
    }


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"dispatcher thread, {report['path']}: {report['tasks']} no-op tasks, "
        f"{report['workers']} workers, medians of {report['rounds']} rounds, {report['timer']} "
        f"time (Python {report['python']}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f})"
    )
    if report["all_threads"]:
        print("note: Python 3.12+ profiles every thread: the main thread's calls are in the table")
    print(
        f"wall time per task {report['wall_per_task_us']:.1f} us; the thread's time per task "
        f"{report['thread_own_per_task_us']:.1f} us, of which waiting in select "
        f"{report['select_wait_per_task_us']:.1f} us"
    )
    print(f"{'function':<58}{'calls/task':>11}{'us/task':>10}{'own us':>9}")
    for section, rows in (("steps of interest", "of_interest"), ("other gpupool", "top")):
        print(f"-- {section}")
        for row in report[rows]:
            print(
                f"{row['function'][:57]:<58}{row['calls']:>11.2f}{row['cum_us']:>10.1f}"
                f"{row['own_us']:>9.1f}"
            )


if __name__ == "__main__":
    sys.exit(main())
