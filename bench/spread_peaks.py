"""One key whose peaks are spread (0.5, 4.0, 1.0 GiB): what the pool asks for it, and how many run.

The scenario. ``--tasks`` tasks (30) of one key (``card_tasks.spread``), task
``i`` holding ``--peaks[i % 3]`` of a simulated card for ``--hold-s`` (0.5 s):
a function whose inputs vary, so that its measured peaks are 0.5, 4.0 and
1.0 GiB (plus the host's 300 MiB context), then again. The pool is told
``task_peak="4.2GiB"``, ``max_workers=6``, and the card is 24 GiB.

Reported, per round and as medians over ``--rounds`` (each in a fresh
:class:`gpupool.testing.SimulatedHost`):

* the key's ask after the samples: ``key_ask_bytes`` of the last decision
  record about the key in the pool's JSON Lines decision log, the ask once
  one cycle of peaks was measured (the first record with ``samples`` >= 3),
  the largest ask seen, and the card's room (``room_bytes``) on the last
  record that states it; whether the ask at the end, and the largest, stay within the room;
* the asks as they moved: each record where the key's ask changed (event,
  ``time_s``, ask, basis, and ``samples`` where the record carries it);
* the most tasks at once: the largest number of tasks whose hold windows
  (``time.time()`` on entry and on release, returned by each task) overlap;
* makespan, and out-of-memory events.

::

    python bench/spread_peaks.py                       # 30 tasks, 1 round
    python bench/spread_peaks.py --tasks 6 --hold-s 0.1 --json /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from card_tasks import spread  # noqa: E402

GiB = 1024**3
KEY_SUFFIX = "spread"


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines decision log (an absent file: none)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def key_asks(records: list[dict[str, Any]], key_suffix: str = KEY_SUFFIX) -> list[dict[str, Any]]:
    """Each record about the key whose ask differs from the one before: the ask as it moved."""
    moves: list[dict[str, Any]] = []
    for rec in records:
        key = rec.get("key") or ""
        ask = rec.get("key_ask_bytes")
        if not key.endswith(key_suffix) or ask is None:
            continue
        if moves and moves[-1]["ask_bytes"] == ask:
            continue
        moves.append(
            {
                "event": rec.get("event"),
                "time_s": rec.get("time_s"),
                "ask_bytes": ask,
                "basis": rec.get("key_ask_basis"),
                "samples": rec.get("samples"),
                "room_bytes": rec.get("room_bytes"),
            }
        )
    return moves


def most_at_once(windows: list[tuple[float, float]]) -> int:
    """The largest number of ``(start, end)`` windows that overlap at one instant."""
    edges = sorted([(s, 1) for s, _ in windows] + [(e, -1) for _, e in windows])
    now = best = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        now += step
        best = max(best, now)
    return best


def _one_round(args: argparse.Namespace, log_dir: str, r: int) -> dict[str, Any]:
    import gpupool.testing as gt
    from gpupool import GpuPoolExecutor

    peaks_bytes = tuple(int(p * GiB) for p in args.peaks)
    log_path = os.path.join(log_dir, f"spread-{r}.jsonl")
    with gt.SimulatedHost([gt.SimulatedDevice(args.card)], cpus=16, host_ram="64GiB") as host:
        started = time.perf_counter()
        with GpuPoolExecutor(
            max_workers=args.max_workers, task_peak=args.task_peak, log_path=log_path
        ) as ex:
            results = list(
                ex.map(
                    spread,
                    range(args.tasks),
                    [peaks_bytes] * args.tasks,
                    [args.hold_s] * args.tasks,
                )
            )
        makespan_s = time.perf_counter() - started
        ooms = len([e for e in host.out_of_memory_events if not e.co_tenant])
    moves = key_asks(read_log(log_path))
    last = moves[-1] if moves else {}
    cycle = next((m for m in moves if (m["samples"] or 0) >= len(peaks_bytes)), {})
    return {
        "makespan_s": makespan_s,
        "most_at_once": most_at_once([(s, e) for _, s, e in results]),
        "final_ask_bytes": last.get("ask_bytes"),
        "ask_after_one_cycle_bytes": cycle.get("ask_bytes"),
        "max_ask_bytes": max((m["ask_bytes"] for m in moves), default=None),
        "room_bytes": next(
            (m["room_bytes"] for m in reversed(moves) if m["room_bytes"] is not None), None
        ),
        "ooms": ooms,
        "ask_moves": moves,
        "log_path": log_path,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hold-s", type=float, default=0.5)
    parser.add_argument(
        "--peaks",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.5, 4.0, 1.0],
        help="GiB held by task i %% len, comma-separated",
    )
    parser.add_argument("--task-peak", default="4.2GiB")
    parser.add_argument("--card", default="24GiB")
    parser.add_argument("--max-workers", type=int, default=6)
    parser.add_argument("--logs", help="keep the decision logs in this directory")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    logging.getLogger("gpupool").setLevel(logging.ERROR)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p
    )
    log_dir = args.logs or tempfile.mkdtemp(prefix="gpupool-spread-")
    os.makedirs(log_dir, exist_ok=True)
    rounds = [_one_round(args, log_dir, r) for r in range(args.rounds)]

    def med(field: str) -> float | None:
        values = [x[field] for x in rounds if x[field] is not None]
        return statistics.median(values) if values else None

    report = {
        "tasks": args.tasks,
        "peaks_gib": args.peaks,
        "task_peak": args.task_peak,
        "card": args.card,
        "max_workers": args.max_workers,
        "rounds": rounds,
        "median_final_ask_bytes": med("final_ask_bytes"),
        "median_most_at_once": med("most_at_once"),
        "median_makespan_s": med("makespan_s"),
        "median_ask_after_one_cycle_bytes": med("ask_after_one_cycle_bytes"),
        "median_max_ask_bytes": med("max_ask_bytes"),
        "ask_within_room": all(_within(x, "final_ask_bytes") for x in rounds),
        "max_ask_within_room": all(_within(x, "max_ask_bytes") for x in rounds),
    }
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _within(x: dict[str, Any], field: str) -> bool:
    return x[field] is not None and x["room_bytes"] is not None and x[field] <= x["room_bytes"]


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def _print(report: dict[str, Any]) -> None:
    print(
        f"{report['tasks']} tasks of one key, peaks {report['peaks_gib']} GiB, "
        f"task_peak={report['task_peak']}, {report['card']} card, "
        f"max_workers={report['max_workers']}"
    )
    print(
        f"{'round':>5}{'ask GiB':>9}{'3rd ask':>9}{'max ask':>9}{'room GiB':>10}{'at once':>9}"
        f"{'makespan s':>12}{'OOMs':>6}"
    )
    for i, x in enumerate(report["rounds"]):
        print(
            f"{i + 1:>5}{_gib(x['final_ask_bytes']):>9}"
            f"{_gib(x['ask_after_one_cycle_bytes']):>9}{_gib(x['max_ask_bytes']):>9}"
            f"{_gib(x['room_bytes']):>10}{x['most_at_once']:>9}{x['makespan_s']:>12.2f}"
            f"{x['ooms']:>6}"
        )
    print("the key's ask as it moved (round 1):")
    for m in report["rounds"][0]["ask_moves"]:
        print(
            f"  {m['time_s']:>7.2f} s  {m['event']:<16} ask {_gib(m['ask_bytes'])} GiB "
            f"({m['basis']}, samples {m['samples']})"
        )
    print(
        f"median ask at the end {_gib(report['median_final_ask_bytes'])} GiB, after one cycle "
        f"of peaks {_gib(report['median_ask_after_one_cycle_bytes'])} GiB, at most "
        f"{_gib(report['median_max_ask_bytes'])} GiB; within the room: at the end "
        f"{report['ask_within_room']}, always {report['max_ask_within_room']}; median most at "
        f"once: {report['median_most_at_once']}"
    )


if __name__ == "__main__":
    sys.exit(main())
