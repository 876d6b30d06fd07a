"""What the host-wide booking table costs, per operation and per task, side by side.

Part 1 times the table's own operations on ``/dev/shm`` (tmpfs, where it
lives by default) and on the temporary directory's filesystem, with
``--pools`` pools of ``--tasks-per-pool`` running tasks each in the file:
this process's and those of ``--pools - 1`` other live processes, so that
every read checks their PIDs as a real one does. A pool calls ``exchange``
(publish its rows and read the others' in one locked step) at every start
and every finish, and a planner reads ``others`` before every start, so
``exchange + others`` is the cost of one start.

Part 2 runs the same no-op tasks through ``GpuPoolExecutor`` on a simulated
card with ``share_bookings=False``, ``True`` and ``"host"`` in turn (beside
the last, as root, another user's file of ``--foreign-rows`` rows, owned by
``nobody``), and reports the wall time per task and the ratio to ``False``
(the table's share of a pool's per-task cost). ``--against SRC`` runs part 2
for this tree and for another tree's ``src`` in turn, in one run: before and
after a change.

    python bench/bookings.py                         # both parts
    python bench/bookings.py --ops 20000 --no-pool   # the table alone
    python bench/bookings.py --against ../main/src --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpupool._core.bookings import TaskBooking
from gpupool._sensors.bookings import BookingTable

UUID = "GPU-be0c4000-0000-4000-8000-000000000000"

#: Another pool's process: publishes its rows, says so, and lives until stdin closes.
_OTHER_POOL = """
import os, sys
from gpupool._core.bookings import TaskBooking
from gpupool._sensors.bookings import BookingTable
directory, uuid, pool, count = sys.argv[1:5]
tasks = [TaskBooking(worker_pid=os.getpid(), key="bench.other", booked_bytes=6 << 30,
                     reached_bytes=i) for i in range(int(count))]
assert BookingTable(directory).publish(uuid, pool, tasks)
print("ready", flush=True)
sys.stdin.read()
"""


def noop(x: int) -> int:
    """The pool's task: nothing, so the figure is the pool's own cost."""
    return x


def _tasks(n: int) -> list[TaskBooking]:
    return [
        TaskBooking(worker_pid=os.getpid(), key="bench.task", booked_bytes=6 << 30, reached_bytes=i)
        for i in range(n)
    ]


def _per_op_us(fn: object, ops: int) -> float:
    assert callable(fn)
    start = time.perf_counter()
    for _ in range(ops):
        fn()
    return (time.perf_counter() - start) / ops * 1e6


def bench_table(base: str, pools: int, tasks_per_pool: int, ops: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory(dir=base) as root:
        directory = Path(root) / "bookings"
        table = BookingTable(directory)
        assert table.others(UUID) is not None  # creates the directory
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _OTHER_POOL,
                    str(directory),
                    UUID,
                    f"other.{n}",
                    str(tasks_per_pool),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in range(pools - 1)
        ]
        try:
            for process in processes:
                assert process.stdout is not None
                assert process.stdout.readline().strip() == "ready"
            _bench_rows(base, table, directory, pools, tasks_per_pool, ops, repeat)
        finally:
            for process in processes:
                assert process.stdin is not None and process.stdout is not None
                process.stdin.close()
                process.wait()
                process.stdout.close()


def _bench_rows(
    base: str,
    table: BookingTable,
    directory: Path,
    pools: int,
    tasks_per_pool: int,
    ops: int,
    repeat: int,
) -> None:
    writer = BookingTable(directory)  # a second pool of this process, to change the file
    mine = _tasks(tasks_per_pool)
    rows = {
        "exchange (publish + read)": lambda: table.exchange(UUID, "me.1", mine),
        "others (read)": lambda: table.others(UUID, "me.1"),
        "exchange + others (one start)": lambda: (
            table.exchange(UUID, "me.1", mine),
            table.others(UUID, "me.1"),
        ),
        "others after another pool wrote": lambda: (
            writer.exchange(UUID, "writer.1", mine),
            table.others(UUID, "me.1"),
        ),
    }
    print(f"\n{base} ({pools} pools x {tasks_per_pool} tasks in the file, {ops} ops)")
    print(f"{'operation':<34} {'median us':>10} {'min us':>8}")
    for name, fn in rows.items():
        figures = [_per_op_us(fn, ops) for _ in range(repeat)]
        print(f"{name:<34} {statistics.median(figures):>10.1f} {min(figures):>8.1f}")
    print("  (the last row includes the other pool's exchange: subtract row 1)")


MODES: tuple[bool | str, ...] = (False, True, "host")


def _plant_foreign(directory: Path, rows: int) -> None:
    """Another user's file on the card (``nobody``'s, where this runs as root), as an honest
    pool of theirs writes it: ``rows`` rows, which every step of a ``"host"`` pool reads."""
    import pwd

    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return
    if os.geteuid() != 0 or not rows:
        return
    from gpupool._sensors.simulated import simulated_uuid

    uuid = simulated_uuid(0)
    body = {
        "version": 1,
        "card_uuid": uuid,
        "pools": {
            f"{4_000_000 + n}.1": {
                "pid": 4_000_000 + n,
                "start": "1",
                "label": "other-user",
                "updated_s": time.time(),
                "waiting": 0,
                "need_bytes": 0,
                "tasks": [[4_100_000 + i, "bench.other", 1 << 30, 0] for i in range(4)],
            }
            for n in range(rows)
        },
    }
    directory.mkdir(mode=0o1777, exist_ok=True)
    directory.chmod(0o1777)
    path = directory / f"{uuid}.uid{uid}.json"
    path.write_text(json.dumps(body, separators=(",", ":")))
    os.chown(path, uid, -1)


def pool_rounds(tasks: int, workers: int, repeat: int, foreign_rows: int) -> dict[str, list[float]]:
    """Per mode of ``share_bookings``, the microseconds per task of each round (the modes
    interleaved within each round: the host's load moves)."""
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    results: dict[str, list[float]] = {repr(mode): [] for mode in MODES}
    for round_ in range(repeat):
        # Each mode takes each place in turn (the first pool of a process pays more).
        for share in MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]:
            with SimulatedHost([SimulatedDevice("256GiB")], cpus=64, host_ram="512GiB") as host:
                if share == "host":
                    _plant_foreign(Path(host.bookings_directory), foreign_rows)
                with GpuPoolExecutor(workers, task_peak="1GiB", share_bookings=share) as pool:
                    list(pool.map(noop, range(workers * 4)))  # warm-up: start every worker
                    start = time.perf_counter()
                    futures = [pool.submit(noop, i) for i in range(tasks)]
                    for future in futures:
                        future.result()
                    results[repr(share)].append((time.perf_counter() - start) / tasks * 1e6)
    return results


def bench_pool(tasks: int, workers: int, repeat: int, foreign_rows: int) -> None:
    results = pool_rounds(tasks, workers, repeat, foreign_rows)
    off = statistics.median(results["False"])
    print(f"\nGpuPoolExecutor on a simulated card, {tasks} no-op tasks, {workers} workers")
    print(f"{'share_bookings':<16} {'us/task':>8} {'vs off':>7}")
    for mode, figures in results.items():
        median = statistics.median(figures)
        print(f"{mode:<16} {median:>8.1f} {median / off:>7.2f}")


def bench_against(other_src: str, tasks: int, workers: int, repeat: int, foreign_rows: int) -> None:
    """Part 2 for this tree and for the tree at ``other_src`` (its ``src``), the two run in
    turn, one round each, ``repeat`` times: before and after a change, in one run."""
    trees = {"before": other_src, "after": str(Path(__file__).resolve().parents[1] / "src")}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    ratios: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for _ in range(repeat):
        for name, src in trees.items():
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--pool-json",
                    f"--pool-tasks={tasks}",
                    f"--workers={workers}",
                    f"--foreign-rows={foreign_rows}",
                    f"--repeat={len(MODES)}",
                ],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            run = json.loads(out.splitlines()[-1])
            off = statistics.median(run["False"])
            for mode, figures in run.items():
                results[name].setdefault(mode, []).extend(figures)
                ratios[name].setdefault(mode, []).append(statistics.median(figures) / off)
    print(
        f"\nbefore ({other_src}) and after, {tasks} no-op tasks, {workers} workers, "
        f"{repeat} runs of each tree in turn ({len(MODES)} rounds a run, the modes rotated); "
        "us/task (median of all rounds), and vs share_bookings=False (median of the runs' "
        "ratios, each within one run)"
    )
    print(f"{'share_bookings':<16} {'before':>8} {'vs off':>7} {'after':>8} {'vs off':>7}")
    for mode in results["after"]:
        row = [
            f"{statistics.median(results[name][mode]):>8.1f} "
            f"{statistics.median(ratios[name][mode]):>7.2f}"
            for name in trees
        ]
        print(f"{mode:<16} {' '.join(row)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--pools", type=int, default=3)
    parser.add_argument("--tasks-per-pool", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pool-tasks", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--foreign-rows",
        type=int,
        default=4,
        help="rows of another user's file beside a \"host\" pool (as root: nobody's)",
    )
    parser.add_argument("--no-pool", action="store_true", help="skip part 2")
    parser.add_argument("--no-table", action="store_true", help="skip part 1")
    parser.add_argument(
        "--against", metavar="SRC", help="part 2 only, this tree and the src at SRC in turn"
    )
    parser.add_argument("--pool-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pool_json:
        figures = pool_rounds(args.pool_tasks, args.workers, args.repeat, args.foreign_rows)
        print(json.dumps(figures))
        return
    if args.against:
        bench_against(args.against, args.pool_tasks, args.workers, args.repeat, args.foreign_rows)
        return
    bases = [base for base in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(base)]
    if not args.no_table:
        for base in bases:
            bench_table(base, args.pools, args.tasks_per_pool, args.ops, args.repeat)
    if not args.no_pool:
        bench_pool(args.pool_tasks, args.workers, args.repeat, args.foreign_rows)


if __name__ == "__main__":
    main()
