"""Short GPU-like tasks: gpupool's adaptive width against the best fixed width in hindsight.

The scenario. ``--tasks`` tasks (800), each holding ``--hold`` (1 GiB) of a
simulated card for ``--hold-ms`` (10 ms), as a short inference batch does; a
task's process also keeps the host's CUDA context (300 MiB) from its first
allocation on. The card (``--card``, 6 GiB) has room for 4 such tasks: four
workers take 4 x 1.3 GiB = 5.2 GiB, a fifth would need 6.5 GiB.

What runs, each in a fresh :class:`gpupool.testing.SimulatedHost`, in
interleaved rounds (the order rotated from round to round):

* ``gpupool``: ``GpuPoolExecutor(max_workers=6)``, no ``task_peak`` (the
  first task runs alone until measured, then the width follows the measured
  peak and the learned margin): the adaptive width;
* ``stdlib k``: ``concurrent.futures.ProcessPoolExecutor`` (spawn) with ``k``
  workers, ``k`` in ``--widths`` (1-6); a task the card refuses returns a
  marker and counts as lost;
* ``gpupool width=k``: ``GpuPoolExecutor(width=k)``, fixed-width mode (a task
  the card refuses is retried by the pool).

Makespan: wall time from constructing the executor to the last result, what
a caller sees (so each executor's start-up counts, amortised over the tasks).

The best fixed width in hindsight is the standard pool's ``k`` with the
lowest median makespan among the widths that lost no task, and the headline
ratio is gpupool's median makespan over it. That is the fairer reading for
the question asked: it is what a user gets by picking the width by hand with
the executor gpupool replaces, so it charges gpupool for everything it does
per task (dispatch, pricing, gating, measuring) as well as for finding the
width. gpupool at fixed widths is reported beside it (its own best width,
and gpupool over it), which isolates what adapting the width costs from what
dispatching costs::

    python bench/short_tasks.py                     # 800 tasks, 5 rounds (~5-10 minutes)
    python bench/short_tasks.py --tasks 40 --rounds 1 --widths 3,4 --json /tmp/s.json
    python bench/short_tasks.py --rounds 1 --widths 4 --logs /tmp/short-logs   # with the logs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from card_tasks import OOM_MARKER, hold_for  # noqa: E402

ADAPTIVE = "gpupool"


def _one_run(name: str, args: argparse.Namespace, r: int = 0) -> dict[str, Any]:
    """Run every task under one executor on a fresh simulated card: makespan, losses, OOMs."""
    import gpupool.testing as gt
    from gpupool import GpuPoolExecutor

    card = gt.SimulatedDevice(args.card)
    catch = name.startswith("stdlib")
    logged: dict[str, Any] = {}
    if args.logs and not catch:
        label = name.replace(" ", "-").replace("=", "")
        logged["log_path"] = os.path.join(args.logs, f"round{r}-{label}.jsonl")
    with gt.SimulatedHost([card], cpus=16, host_ram="64GiB") as host:
        started = time.perf_counter()
        if name == ADAPTIVE:
            ex: Any = GpuPoolExecutor(
                max_workers=args.max_workers, task_peak=args.task_peak, **logged
            )
        elif catch:
            k = int(name.split()[-1])
            spawn = multiprocessing.get_context("spawn")
            ex = concurrent.futures.ProcessPoolExecutor(k, mp_context=spawn)
        else:
            ex = GpuPoolExecutor(width=int(name.split("=")[-1]), **logged)
        lost = 0
        with ex:
            futures = [
                ex.submit(hold_for, i, args.hold, args.hold_ms / 1000, catch)
                for i in range(args.tasks)
            ]
            for future in futures:
                try:
                    if future.result() == OOM_MARKER:
                        lost += 1
                except Exception:
                    lost += 1
            makespan_s = time.perf_counter() - started
            width = getattr(ex, "width", None)
        ooms = len([e for e in host.out_of_memory_events if not e.co_tenant])
    return {"makespan_s": makespan_s, "lost": lost, "ooms": ooms, "final_width": width}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hold", default="1GiB", help="device bytes a task holds")
    parser.add_argument("--hold-ms", type=float, default=10.0)
    parser.add_argument("--card", default="6GiB", help="the simulated card's total")
    parser.add_argument("--max-workers", type=int, default=6, help="gpupool's ceiling")
    parser.add_argument("--task-peak", default=None, help="gpupool's estimate (default: none)")
    parser.add_argument(
        "--widths",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2, 3, 4, 5, 6],
        help="fixed widths to try (comma-separated)",
    )
    parser.add_argument(
        "--no-gpupool-fixed", action="store_true", help="skip gpupool at fixed widths"
    )
    parser.add_argument("--logs", help="keep gpupool's decision logs in this directory")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    logging.getLogger("gpupool").setLevel(logging.ERROR)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p
    )

    names = [ADAPTIVE] + [f"stdlib {k}" for k in args.widths]
    if not args.no_gpupool_fixed:
        names += [f"gpupool width={k}" for k in args.widths]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(_one_run(name, args, r))
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = {
        n: {
            "makespan_s": statistics.median(x["makespan_s"] for x in runs[n]),
            "makespans_s": [x["makespan_s"] for x in runs[n]],
            "lost": max(x["lost"] for x in runs[n]),
            "ooms": max(x["ooms"] for x in runs[n]),
            "final_width": runs[n][-1]["final_width"],
        }
        for n in names
    }
    report = _report(rows, args)
    _print(report, rows, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


def _best(rows: dict[str, dict[str, Any]], prefix: str) -> str | None:
    """The fixed width with the lowest median makespan among those that lost nothing."""
    fair = [n for n in rows if n.startswith(prefix) and rows[n]["lost"] == 0]
    return min(fair, key=lambda n: rows[n]["makespan_s"]) if fair else None


def _report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    adaptive = rows[ADAPTIVE]["makespan_s"]
    best_stdlib = _best(rows, "stdlib ")
    best_gpupool = _best(rows, "gpupool width=")
    return {
        "tasks": args.tasks,
        "hold": args.hold,
        "hold_ms": args.hold_ms,
        "card": args.card,
        "rounds": args.rounds,
        "load_average": os.getloadavg()[0],
        "rows": rows,
        "best_stdlib": best_stdlib,
        "best_gpupool_fixed": best_gpupool,
        "ratio_to_best_stdlib": (
            adaptive / rows[best_stdlib]["makespan_s"] if best_stdlib else None
        ),
        "ratio_to_best_gpupool_fixed": (
            adaptive / rows[best_gpupool]["makespan_s"] if best_gpupool else None
        ),
    }


def _print(
    report: dict[str, Any], rows: dict[str, dict[str, Any]], args: argparse.Namespace
) -> None:
    print(
        f"{args.tasks} tasks holding {args.hold} for {args.hold_ms:g} ms on a {args.card} "
        f"simulated card; median makespan of {args.rounds} interleaved rounds "
        f"({os.cpu_count()} CPUs, load {report['load_average']:.1f})"
    )
    adaptive = rows[ADAPTIVE]["makespan_s"]
    print(
        f"{'executor':<20}{'makespan s':>11}{'gpupool/this':>14}{'lost':>6}{'OOMs':>6}{'width':>7}"
    )
    for name, row in rows.items():
        width = "" if row["final_width"] is None else row["final_width"]
        print(
            f"{name:<20}{row['makespan_s']:>11.3f}{adaptive / row['makespan_s']:>13.2f}x"
            f"{row['lost']:>6}{row['ooms']:>6}{width!s:>7}"
        )
    for label, key, ratio in (
        ("standard pool", "best_stdlib", "ratio_to_best_stdlib"),
        ("gpupool fixed", "best_gpupool_fixed", "ratio_to_best_gpupool_fixed"),
    ):
        if report[key] is None:
            print(f"best fixed width ({label}): none lost nothing")
        else:
            print(f"best fixed width ({label}): {report[key]}; gpupool / it = {report[ratio]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
