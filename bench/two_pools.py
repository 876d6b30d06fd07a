"""Two pools on one card against one pool running both workloads (side by side).

Each workload is 12 tasks that start, wait 0.3 s, then hold 6 GiB for 1 s
(``task_peak="6.5GiB"``, ``max_workers=6``) on one simulated 40 GiB card.
``one``: a single pool runs both workloads (24 tasks), in a script of its
own. ``two``: two scripts, each with its own pool and one workload, started
together; they see each other's bookings through the host-wide booking
table. Both modes time from the scripts' start to their end. Rounds are
interleaved; the report gives the median makespan of each, the ratio
two/one, the spread, and the simulated out-of-memory events::

    python bench/two_pools.py              # 3 rounds
    python bench/two_pools.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpupool.testing as gt
from gpupool import GpuPoolExecutor

TASKS = 12
WORKERS = 6
TASK_PEAK = "6.5GiB"
HOLD = "6GiB"


def task(i: int) -> int:
    time.sleep(0.3)
    with gt.hold(HOLD):
        time.sleep(1.0)
    return i


def run_pool(tasks: int, barrier: Path | None, pools: int) -> dict[str, int]:
    """One pool running ``tasks`` tasks (after ``pools`` scripts have built theirs)."""
    with GpuPoolExecutor(max_workers=WORKERS, task_peak=TASK_PEAK) as pool:
        if barrier is not None:
            (barrier / str(id(pool))).touch()
            deadline = time.monotonic() + 120
            while len(list(barrier.iterdir())) < pools and time.monotonic() < deadline:
                time.sleep(0.01)
        results = list(pool.map(task, range(tasks)))
        stats = pool.statistics()
    assert results == list(range(tasks))
    return {"out_of_memory": stats.out_of_memory, "retries": stats.retries}


def one_round(mode: str) -> tuple[float, int]:
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")], cpus=16, host_ram="256GiB") as host:
        started = time.monotonic()
        pools = 1 if mode == "one" else 2
        with tempfile.TemporaryDirectory() as barrier:
            # Each pool in a script of its own, started alike in both modes.
            scripts = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        barrier,
                        str(pools),
                        str(2 * TASKS // pools),
                    ]
                )
                for _ in range(pools)
            ]
            codes = [script.wait(timeout=600) for script in scripts]
            assert codes == [0] * pools, codes
        took = time.monotonic() - started
        ooms = len(host.out_of_memory_events)
    return took, ooms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.child:
        barrier, pools, tasks = args.child
        run_pool(int(tasks), Path(barrier), int(pools))
        return 0
    times: dict[str, list[float]] = {"one": [], "two": []}
    ooms: dict[str, int] = {"one": 0, "two": 0}
    for _ in range(args.rounds):
        for mode in ("one", "two"):
            took, oom = one_round(mode)
            times[mode].append(took)
            ooms[mode] += oom
    one, two = statistics.median(times["one"]), statistics.median(times["two"])
    report = {
        "one_pool_makespan_s": one,
        "two_pools_makespan_s": two,
        "ratio_two_over_one": two / one,
        "one_spread_s": [min(times["one"]), max(times["one"])],
        "two_spread_s": [min(times["two"]), max(times["two"])],
        "out_of_memory": ooms,
        "rounds": args.rounds,
    }
    print(
        f"one pool, both workloads: {one:.2f} s (spread {min(times['one']):.2f}-"
        f"{max(times['one']):.2f}); two pools together: {two:.2f} s (spread "
        f"{min(times['two']):.2f}-{max(times['two']):.2f}); two/one = {two / one:.2f}; "
        f"out-of-memory: one {ooms['one']}, two {ooms['two']} over {args.rounds} rounds"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
