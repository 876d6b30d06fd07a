"""Soak: 50,000 tasks through one pool with injected faults; every future checked, leaks counted.

Not a speed benchmark: a check too long for the test suite (several minutes
on 2 cores), run by hand (``python bench/soak.py``; ``--tasks`` to change the
count). Faults, one task in 100 by default, shuffled:

* ``raise``: the task raises (its future holds the exception);
* ``unpicklable_result``: the task returns a lock (TypeError in its future);
* ``unpicklable_argument``: the call holds a lock (TypeError, pickled when sent);
* ``exit``, ``kill``, ``segfault``: the worker dies (``os._exit(3)``, SIGKILL,
  SIGSEGV): WorkerLostError naming the exit code or signal;
* ``large``: a 1 MiB argument echoed back as a 1 MiB result (both directions
  at once, with a second task queued behind the worker).

Meanwhile a thread grows and shrinks a co-tenant on the simulated card
(0 GiB, then 39 GiB of 40, switching every 20 ms), so the live gate opens and shuts.
The parent's RSS and open descriptors are read after each batch of tasks
(after the first, which warms up imports and loky's resource trackers); at
the end, no child process of this one may be left. Exits 1 on any wrong
result, a pending future, growth, or a process left.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
import soak_tasks
from gpupool import GpuPoolExecutor, WorkerLostError
from gpupool.testing import SimulatedDevice, SimulatedHost

#: Of each 100 faults: the process-killing ones cost a new worker (~0.2 s) each.
FAULTS = (
    ["raise"] * 20
    + ["unpicklable_result"] * 15
    + ["unpicklable_argument"] * 15
    + ["large"] * 20
    + ["exit"] * 10
    + ["kill"] * 10
    + ["segfault"] * 10
)

BATCH = 5_000
LARGE_BYTES = 1024 * 1024


def _check(i: int, fault: str, future: concurrent.futures.Future[object], big: bytes) -> str:
    """``""`` when the future holds what ``fault`` should give, else what is wrong."""
    error = future.exception()
    if fault in {"", "large"}:
        if error is not None:
            return f"{fault or 'good'}: {error!r}"
        want = (i * 3, big if fault == "large" else b"")
        return "" if future.result() == want else f"{fault or 'good'}: wrong result"
    expected: dict[str, tuple[type[BaseException], object]] = {
        "raise": (soak_tasks.SoakError, None),
        "unpicklable_result": (TypeError, None),
        "unpicklable_argument": (TypeError, None),
        "exit": (WorkerLostError, 3),
        "kill": (WorkerLostError, -signal.SIGKILL),
        "segfault": (WorkerLostError, -signal.SIGSEGV),
    }
    cls, code = expected[fault]
    if not isinstance(error, cls):
        return f"{fault}: {error!r}"
    if code is not None and getattr(error, "exitcode", None) != code:
        return f"{fault}: exit code {getattr(error, 'exitcode', None)}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--fault-every", type=int, default=100)
    args = parser.parse_args()
    rng = random.Random(14)
    n_faults = args.tasks // args.fault_every
    faults = [FAULTS[i % len(FAULTS)] for i in range(n_faults)]
    rng.shuffle(faults)
    plan = [""] * args.tasks
    for slot, fault in zip(rng.sample(range(args.tasks), n_faults), faults, strict=True):
        plan[slot] = fault
    big = os.urandom(LARGE_BYTES)
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    wrong: list[tuple[int, str]] = []
    samples: list[tuple[int, int, int]] = []
    started_s = time.monotonic()
    stop = threading.Event()
    with SimulatedHost(
        devices=[SimulatedDevice(total="40GiB", co_tenants={"serve": "0GiB"})],
        cpus=2,
        host_ram="64GiB",
    ) as host:

        def churn() -> None:
            while not stop.wait(0.02):
                host.grow("serve", "39GiB")
                if stop.wait(0.02):
                    break
                host.shrink("serve", "39GiB")

        churner = threading.Thread(target=churn, daemon=True)
        churner.start()
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            for start in range(0, args.tasks, BATCH):
                batch = range(start, min(args.tasks, start + BATCH))
                futures = []
                for i in batch:
                    fault = plan[i]
                    if fault == "unpicklable_argument":
                        futures.append(ex.submit(soak_tasks.soak, i, "", threading.Lock()))
                    elif fault == "large":
                        futures.append(ex.submit(soak_tasks.soak, i, "", big))
                    else:
                        futures.append(ex.submit(soak_tasks.soak, i, fault))
                _, not_done = concurrent.futures.wait(futures, timeout=600)
                if not_done:
                    print(f"{len(not_done)} futures pending after 600 s", file=sys.stderr)
                    return 1
                for i, future in zip(batch, futures, strict=True):
                    problem = _check(i, plan[i], future, big)
                    if problem:
                        wrong.append((i, problem))
                del futures
                samples.append((batch.stop, me.memory_info().rss, len(os.listdir("/proc/self/fd"))))
                print(
                    f"{batch.stop:>7} tasks  {time.monotonic() - started_s:7.1f} s  "
                    f"rss {samples[-1][1] / 2**20:7.1f} MiB  fds {samples[-1][2]}",
                    flush=True,
                )
            stats = ex.statistics()
        stop.set()
        churner.join()
    elapsed_s = time.monotonic() - started_s
    time.sleep(0.5)  # let the kernel finish reaping before children are listed
    left = [p for p in me.children(recursive=True) if p.pid not in children_before]
    # loky's and multiprocessing's resource trackers live as long as this process.
    left = [
        p
        for p in left
        if p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE
        and not any("resource_tracker" in part for part in p.cmdline())
    ]
    rss_growth = samples[-1][1] - samples[0][1]
    fd_growth = samples[-1][2] - samples[0][2]
    counts = {f: plan.count(f) for f in sorted(set(plan) - {""})}
    print(f"tasks: {args.tasks}, faults: {n_faults} {counts}, {elapsed_s:.1f} s")
    print(
        f"statistics: submitted {stats.tasks_submitted}, completed {stats.tasks_completed}, "
        f"failed {stats.tasks_failed}, workers started {stats.workers_started}, "
        f"lost {stats.workers_lost}, live-gate waits {stats.live_gate_waits}"
    )
    print(
        f"parent RSS {samples[0][1] / 2**20:.1f} -> {samples[-1][1] / 2**20:.1f} MiB "
        f"(after batch 1 -> last), fds {samples[0][2]} -> {samples[-1][2]}"
    )
    print(f"wrong futures: {len(wrong)} {wrong[:10]}; processes left: {[p.pid for p in left]}")
    bad = (
        wrong
        or left
        or fd_growth > 0
        or rss_growth > 64 * 2**20
        or stats.tasks_submitted != args.tasks
        or stats.tasks_completed + stats.tasks_failed != args.tasks
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
