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
card with ``share_bookings=True`` and ``False`` in turn, and reports the
wall time per task and the ratio (the table's share of a pool's per-task cost).

    python bench/bookings.py                         # both parts
    python bench/bookings.py --ops 20000 --no-pool   # the table alone
"""

from __future__ import annotations

import argparse
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


def bench_pool(tasks: int, workers: int, repeat: int) -> None:
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        for share in (False, True):
            with SimulatedHost([SimulatedDevice("256GiB")], cpus=64, host_ram="512GiB"):
                with GpuPoolExecutor(workers, task_peak="1GiB", share_bookings=share) as pool:
                    list(pool.map(noop, range(workers * 4)))  # warm-up: start every worker
                    start = time.perf_counter()
                    futures = [pool.submit(noop, i) for i in range(tasks)]
                    for future in futures:
                        future.result()
                    results[share].append((time.perf_counter() - start) / tasks * 1e6)
    off, on = statistics.median(results[False]), statistics.median(results[True])
    print(f"\nGpuPoolExecutor on a simulated card, {tasks} no-op tasks, {workers} workers")
    print(f"{'share_bookings':<16} {'us/task':>8} {'vs off':>7}")
    print(f"{'False':<16} {off:>8.1f} {1.0:>7.2f}")
    print(f"{'True':<16} {on:>8.1f} {on / off:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--pools", type=int, default=3)
    parser.add_argument("--tasks-per-pool", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pool-tasks", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-pool", action="store_true", help="skip part 2")
    args = parser.parse_args()
    bases = [base for base in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(base)]
    for base in bases:
        bench_table(base, args.pools, args.tasks_per_pool, args.ops, args.repeat)
    if not args.no_pool:
        bench_pool(args.pool_tasks, args.workers, args.repeat)


if __name__ == "__main__":
    main()
