"""Four pools sharing one card for a fixed time, one of them with a key whose peaks are spread.

The scenario. Four scripts, each with its own ``GpuPoolExecutor(max_workers=3)``
(separate processes, seeing each other through the host's booking table),
share one 24 GiB simulated card for ``--duration`` seconds (120). Three pools
run a steady key (each task holds ``--steady`` GiB, 3, for ``--task-s``, 1 s;
``task_peak="3.5GiB"``); the fourth runs the spread key of
``bench/spread_peaks.py`` (peaks 0.5, 4.0, 1.0 GiB, then again;
``task_peak="4.2GiB"``). Each script keeps ``--in-flight`` tasks (3, its
``max_workers``) submitted: when one finishes it submits the next, until the
duration is over; then it cancels what has not started and lets the running
tasks finish. The scripts build their pools, wait for one another (a barrier
directory), then start together.

Reported per pool: tasks run (completed), the longest wait of a task and the
median wait (submit to start: the parent's ``time.time()`` at submit to the
task's own ``time.time()`` on entry, the attempt that delivered; a task still
unstarted at the end counts with the time it had waited by then, so a pool
kept off the card cannot hide its wait), out-of-memory events, serial
starts and worker processes started (``pool.statistics()``), and from each
pool's JSON Lines decision log the count of ``share_wait`` and
``serial_start`` records, the longest ``head_waiting_s``, and the spread
key's largest ask. Overall: the least
tasks run over the most (the fairness ratio) and the longest wait of any
task. ``--rounds`` repeats the whole run; the figures are medians over
rounds, with each round's row kept in the JSON.

The decision log holds decisions, not one record per task, so the waits come
from the tasks' own timestamps (every process reads the same wall clock)::

    python bench/four_pools.py                         # 120 s, 1 round
    python bench/four_pools.py --rounds 3
    python bench/four_pools.py --duration 4 --task-s 0.2 --json /tmp/f.json   # quick
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from card_tasks import spread  # noqa: E402
from spread_peaks import key_asks, read_log  # noqa: E402

GiB = 1024**3
POOLS = 4
WORKERS = 3
SPREAD_PEAKS_GIB = (0.5, 4.0, 1.0)


def _kind_terms(kind: str, args: argparse.Namespace) -> tuple[tuple[int, ...], str]:
    if kind == "spread":
        return tuple(int(p * GiB) for p in SPREAD_PEAKS_GIB), args.spread_task_peak
    return (int(args.steady * GiB),), args.steady_task_peak


def run_pool(args: argparse.Namespace) -> dict[str, Any]:
    """One pool (in a script of its own): keep ``in_flight`` tasks submitted for the duration."""
    from gpupool import GpuPoolExecutor

    index, kind, barrier, log_path = args.child
    peaks_bytes, task_peak = _kind_terms(kind, args)
    extra = {} if args.room_wait_s is None else {"room_wait_s": args.room_wait_s}
    waits_s: list[float] = []
    unstarted_waits_s: list[float] = []
    completed = failed = 0
    with GpuPoolExecutor(
        max_workers=WORKERS, task_peak=task_peak, log_path=log_path, **extra
    ) as ex:
        (Path(barrier) / f"ready-{index}").touch()
        deadline = time.monotonic() + 120
        while len(list(Path(barrier).iterdir())) < POOLS and time.monotonic() < deadline:
            time.sleep(0.01)
        end = time.time() + args.duration
        submitted: dict[concurrent.futures.Future[Any], float] = {}
        i = 0
        while True:
            while time.time() < end and len(submitted) < args.in_flight:
                submitted[ex.submit(spread, i, peaks_bytes, args.task_s)] = time.time()
                i += 1
            if not submitted:
                break
            timeout = max(0.0, end - time.time()) if time.time() < end else None
            done, _ = concurrent.futures.wait(
                submitted, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if not done and time.time() >= end:
                now = time.time()
                for future, at in submitted.items():
                    if future.cancel():
                        unstarted_waits_s.append(now - at)
                done = set(submitted)
                concurrent.futures.wait(done)
            for future in done:
                at = submitted.pop(future)
                if future.cancelled():
                    continue
                if future.exception() is not None:
                    failed += 1
                    continue
                _, start, _ = future.result()
                waits_s.append(start - at)
                completed += 1
        stats = ex.statistics()
    return {
        "pool": int(index),
        "kind": kind,
        "completed": completed,
        "failed": failed,
        "waits_s": waits_s,
        "unstarted_waits_s": unstarted_waits_s,
        "out_of_memory": stats.out_of_memory,
        "serial_starts": stats.serial_starts,
        "retries": stats.retries,
        "workers_started": stats.workers_started,
    }


def _from_log(path: str) -> dict[str, Any]:
    records = read_log(path)
    heads = [r["head_waiting_s"] for r in records if r.get("head_waiting_s") is not None]
    asks = [m["ask_bytes"] for m in key_asks(records)]
    return {
        "share_wait_records": sum(r.get("event") == "share_wait" for r in records),
        "serial_start_records": sum(r.get("event") == "serial_start" for r in records),
        "longest_head_waiting_s": max(heads, default=None),
        "max_key_ask_bytes": max(asks, default=None),
    }


def one_round(args: argparse.Namespace, log_dir: str, r: int) -> dict[str, Any]:
    import gpupool.testing as gt

    kinds = ["steady"] * (POOLS - 1) + ["spread"]
    with gt.SimulatedHost([gt.SimulatedDevice(args.card)], cpus=16, host_ram="128GiB") as host:
        with tempfile.TemporaryDirectory() as barrier:
            children = []
            for index, kind in enumerate(kinds):
                log_path = os.path.join(log_dir, f"round{r}-pool{index}-{kind}.jsonl")
                out = os.path.join(log_dir, f"round{r}-pool{index}.json")
                command = [sys.executable, __file__, *_child_args(args)]
                command += ["--child", str(index), kind, barrier, log_path, "--child-out", out]
                children.append((subprocess.Popen(command), out, log_path))
            limit_s = args.duration + 300 + (args.room_wait_s or 120)
            codes = [child.wait(timeout=limit_s) for child, _, _ in children]
            if codes != [0] * POOLS:
                raise RuntimeError(f"a pool's script failed: exit codes {codes}")
        ooms = len([e for e in host.out_of_memory_events if not e.co_tenant])
    pools = []
    for _, out, log_path in children:
        row = json.loads(Path(out).read_text())
        row.update(_from_log(log_path))
        row["longest_wait_s"] = max(row["waits_s"] + row["unstarted_waits_s"], default=0.0)
        row["median_wait_s"] = statistics.median(row["waits_s"]) if row["waits_s"] else None
        pools.append(row)
    counts = [p["completed"] for p in pools]
    return {
        "pools": pools,
        "tasks_run": counts,
        "least_over_most": min(counts) / max(counts) if max(counts) else 0.0,
        "longest_wait_s": max(p["longest_wait_s"] for p in pools),
        "card_out_of_memory_events": ooms,
    }


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ["--duration", str(args.duration), "--task-s", str(args.task_s)]
    out += ["--steady", str(args.steady), "--steady-task-peak", args.steady_task_peak]
    out += ["--spread-task-peak", args.spread_task_peak, "--in-flight", str(args.in_flight)]
    if args.room_wait_s is not None:
        out += ["--room-wait-s", str(args.room_wait_s)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds the pools run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--task-s", type=float, default=1.0, help="how long a task holds")
    parser.add_argument("--steady", type=float, default=3.0, help="GiB a steady task holds")
    parser.add_argument("--steady-task-peak", default="3.5GiB")
    parser.add_argument("--spread-task-peak", default="4.2GiB")
    parser.add_argument("--card", default="24GiB")
    parser.add_argument("--in-flight", type=int, default=WORKERS, help="tasks kept submitted")
    parser.add_argument("--room-wait-s", type=float, default=None, help="the pools' room_wait_s")
    parser.add_argument("--logs", help="keep the decision logs in this directory")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.getLogger("gpupool").setLevel(logging.ERROR)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p
    )
    if args.child:
        Path(args.child_out).write_text(json.dumps(run_pool(args)))
        return 0
    log_dir = args.logs or tempfile.mkdtemp(prefix="gpupool-four-pools-")
    os.makedirs(log_dir, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(args, log_dir, r))
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    report = {
        "duration_s": args.duration,
        "task_s": args.task_s,
        "card": args.card,
        "pools": POOLS,
        "workers": WORKERS,
        "rounds": rounds,
        "median_least_over_most": statistics.median(x["least_over_most"] for x in rounds),
        "median_longest_wait_s": statistics.median(x["longest_wait_s"] for x in rounds),
        "log_dir": log_dir,
    }
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict[str, Any]) -> None:
    print(
        f"{report['pools']} pools x {report['workers']} workers on a {report['card']} card for "
        f"{report['duration_s']:g} s, tasks of {report['task_s']:g} s; "
        f"{len(report['rounds'])} round(s) (load {os.getloadavg()[0]:.1f})"
    )
    print(
        f"{'round':>5}{'pool':>5} {'kind':<7}{'tasks':>7}{'longest wait s':>16}{'median':>8}"
        f"{'OOMs':>6}{'serial':>8}{'share_wait':>12}{'max ask GiB':>13}{'workers':>9}"
    )
    for r, x in enumerate(report["rounds"]):
        for p in x["pools"]:
            ask = p["max_key_ask_bytes"]
            median = "-" if p["median_wait_s"] is None else f"{p['median_wait_s']:.2f}"
            print(
                f"{r + 1:>5}{p['pool']:>5} {p['kind']:<7}{p['completed']:>7}"
                f"{p['longest_wait_s']:>16.2f}{median:>8}{p['out_of_memory']:>6}"
                f"{p['serial_starts']:>8}{p['share_wait_records']:>12}"
                f"{'-' if ask is None else f'{ask / GiB:.2f}':>13}"
                f"{p.get('workers_started', '-'):>9}"
            )
        print(
            f"      least/most tasks {x['least_over_most']:.2f}, longest wait "
            f"{x['longest_wait_s']:.2f} s, card OOM events {x['card_out_of_memory_events']}"
        )
    print(
        f"median over rounds: least/most {report['median_least_over_most']:.2f}, longest wait "
        f"{report['median_longest_wait_s']:.2f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
