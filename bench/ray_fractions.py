"""Ray's ``num_gpus`` fractions against gpupool.ray, on the same simulated Ray cluster (one run).

The cluster is Ray's own (``ray.cluster_utils.Cluster``): a head without GPUs
and two GPU nodes, each with one simulated card of the incident
(``docs/demo.md``): 44.39 GiB, a serving co-tenant holding 9.54 GiB and a
16.20 GiB process beside it (the incident's parent). 36 entries each hold
6.02 GiB (plus the 300 MiB context every process is charged on its first
touch) for ``--hold-s`` seconds. Three ways to run them, one after the other
on the same nodes:

``num_gpus=0.25``
    ``@ray.remote(num_gpus=0.25, num_cpus=0)``: Ray runs 4 tasks per card
    whatever they hold (the incident's K=4).
``num_gpus=0.5``
    2 tasks per card.
``num_gpus=0.25, max_calls=0`` and ``num_gpus=0.5, max_calls=0``
    the same with Ray's workers reused: Ray's default for a GPU task is
    ``max_calls=1``, a new worker process for every task.
``gpupool``
    ``gpupool.ray.RayGpuExecutor(task_peak="9.9GiB", max_workers=4)``: one pool
    per node, tasks priced by what they were measured to hold.

For each: the makespan (submit of the first to the end of the last), the
simulated out-of-memory events, and the tasks that failed. Then the per-task
overhead: ``--overhead-tasks`` empty tasks through a plain ``@ray.remote``
function (no GPU: the executor holds the nodes' GPUs) and through the
executor, both all at once (makespan / tasks) and one at a time (submit,
wait; the median round trip). Each mode is warmed
first (its worker processes started) with a few empty tasks::

    python bench/ray_fractions.py
    python bench/ray_fractions.py --hold-s 0.5 --json

The numbers vary with the machine's load: compare the modes of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.cluster_utils import Cluster

import gpupool.ray as gr
import gpupool.testing as gt
from gpupool._commands.demo import entry

ENTRIES = 36
CARD = "44.39GiB"
CO_TENANTS = {"server": "9.54GiB", "parent": "16.20GiB"}
ENTRY = "6.02GiB"
TASK_PEAK = "9.9GiB"
OBJECT_STORE_BYTES = 80 * 2**20


def empty(i: int) -> int:
    """A task that does nothing: what the per-task overhead is measured with."""
    return i


def timed_entry(i: int, hold_s: float, size: str) -> tuple[float, float, int]:
    """An entry that says when it ran and in which process: ``(start, end, pid)``."""
    start = time.time()
    entry(i, hold_s, size)
    return start, time.time(), os.getpid()


def _spread(spans: list[tuple[float, float, int]]) -> dict[str, Any]:
    """How the entries that ran overlapped: busy seconds over the span, and the processes."""
    if not spans:
        return {"mean_running": 0.0, "processes": 0}
    busy = sum(end - start for start, end, _ in spans)
    span = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    return {
        "mean_running": busy / span if span > 0 else 0.0,
        "processes": len({p for *_, p in spans}),
    }


def _cluster(hosts: list[gt.SimulatedHost], stack: contextlib.ExitStack) -> Cluster:
    """A head and one GPU node per host, each node started inside its own simulated host
    (entered on ``stack``: a host's ledger lasts as long as it is entered)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
        },
    )
    for host in hosts:
        # The node's raylet (and every process it starts) inherits the host's ledger.
        stack.enter_context(host)
        # Four logical CPUs: Ray keeps about as many workers on a node as it has CPUs, so
        # with fewer its fractional tasks would run one at a time whatever the fraction.
        cluster.add_node(num_cpus=4, num_gpus=1, object_store_memory=OBJECT_STORE_BYTES)
    return cluster


def _events(hosts: list[gt.SimulatedHost]) -> int:
    return sum(len(host.out_of_memory_events) for host in hosts)


def _fractions(
    fraction: float, hold_s: float, hosts: list[gt.SimulatedHost], *, reuse: bool
) -> dict[str, Any]:
    # Ray's default for a GPU task is max_calls=1: a new worker process for every task.
    calls = {"max_calls": 0} if reuse else {}
    remote = ray.remote(num_gpus=fraction, num_cpus=0, max_retries=0, **calls)(timed_entry)
    ray.get([remote.remote(-1, 0.2, "1MiB") for _ in range(int(2 / fraction))])  # warm
    before = _events(hosts)
    start = time.perf_counter()
    refs = [remote.remote(i, hold_s, ENTRY) for i in range(ENTRIES)]
    failed = crashed = 0
    spans = []
    for ref in refs:
        try:
            spans.append(ray.get(ref))
        except ray.exceptions.RayTaskError:
            failed += 1
        except ray.exceptions.RayError:  # the worker process died (Ray's own crash)
            crashed += 1
    return {
        "mode": f"num_gpus={fraction:g}" + (", max_calls=0" if reuse else ""),
        "makespan_s": time.perf_counter() - start,
        "out_of_memory": _events(hosts) - before,
        "failed": failed + crashed,
        "workers_crashed": crashed,
        **_spread(spans),
    }


def _gpupool(hold_s: float, hosts: list[gt.SimulatedHost]) -> dict[str, Any]:
    with gr.RayGpuExecutor(task_peak=TASK_PEAK, max_workers=4) as ex:
        # Warmed under a key of its own: the entries' key is measured by the entries.
        warm = ex.options(key="warm")
        list(warm.map(timed_entry, [-1] * 8, [0.2] * 8, ["1MiB"] * 8))
        before = _events(hosts)
        start = time.perf_counter()
        futures = [ex.submit(timed_entry, i, hold_s, ENTRY) for i in range(ENTRIES)]
        failed = sum(1 for f in futures if f.exception() is not None)
        makespan = time.perf_counter() - start
        spans = [f.result() for f in futures if f.exception() is None]
        widths = {
            name: max(d.get("width_after") or 0 for d in r["decisions"])
            for name, r in ex.reports().items()
        }
    return {
        "mode": "gpupool",
        "makespan_s": makespan,
        "out_of_memory": _events(hosts) - before,
        "failed": failed,
        "max_widths": widths,
        **_spread(spans),
    }


def _overhead(tasks: int, rounds: int) -> dict[str, Any]:
    # No GPU: the executor holds every GPU of its nodes, so a GPU task would wait for ever.
    plain = ray.remote(num_cpus=0)(empty)

    def ray_batch() -> float:
        start = time.perf_counter()
        ray.get([plain.remote(i) for i in range(tasks)])
        return time.perf_counter() - start

    def ray_one() -> float:
        start = time.perf_counter()
        ray.get(plain.remote(0))
        return time.perf_counter() - start

    ray.get([plain.remote(i) for i in range(8)])  # warm
    out: dict[str, Any] = {}
    with gr.RayGpuExecutor(task_peak="1GiB", max_workers=4) as ex:
        list(ex.map(empty, range(8)))  # warm

        def pool_batch() -> float:
            start = time.perf_counter()
            list(ex.map(empty, range(tasks)))
            return time.perf_counter() - start

        def pool_one() -> float:
            start = time.perf_counter()
            ex.submit(empty, 0).result()
            return time.perf_counter() - start

        # Interleaved, so a change in the machine's load touches both alike.
        batches: dict[str, list[float]] = {"ray": [], "gpupool": []}
        ones: dict[str, list[float]] = {"ray": [], "gpupool": []}
        runs: list[tuple[str, Callable[[], float], Callable[[], float]]] = [
            ("ray", ray_batch, ray_one),
            ("gpupool", pool_batch, pool_one),
        ]
        for _ in range(rounds):
            for name, batch, one in runs:
                batches[name].append(batch() / tasks)
                ones[name].extend(one() for _ in range(10))
    for name in ("ray", "gpupool"):
        out[name] = {
            "per_task_in_batch_ms": 1000 * statistics.median(batches[name]),
            "round_trip_ms": 1000 * statistics.median(ones[name]),
        }
    out["ratio_in_batch"] = (
        out["gpupool"]["per_task_in_batch_ms"] / out["ray"]["per_task_in_batch_ms"]
    )
    out["ratio_round_trip"] = out["gpupool"]["round_trip_ms"] / out["ray"]["round_trip_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-s", type=float, default=0.5, help="seconds each entry holds")
    parser.add_argument("--overhead-tasks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="overhead rounds (interleaved)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    hosts = [
        gt.SimulatedHost([gt.SimulatedDevice(CARD, co_tenants=CO_TENANTS)], cpus=2)
        for _ in range(2)
    ]
    with contextlib.ExitStack() as stack:
        cluster = _cluster(hosts, stack)
        try:
            ray.init(address=cluster.address, log_to_driver=False)
            runs = [
                _fractions(0.25, args.hold_s, hosts, reuse=False),
                _fractions(0.5, args.hold_s, hosts, reuse=False),
                _fractions(0.25, args.hold_s, hosts, reuse=True),
                _fractions(0.5, args.hold_s, hosts, reuse=True),
                _gpupool(args.hold_s, hosts),
            ]
            overhead = _overhead(args.overhead_tasks, args.rounds)
        finally:
            ray.shutdown()
            cluster.shutdown()
    result = {
        "cluster": f"2 nodes, each one {CARD} card beside {CO_TENANTS}",
        "entries": ENTRIES,
        "entry_bytes": ENTRY,
        "hold_s": args.hold_s,
        "runs": runs,
        "overhead": overhead,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{ENTRIES} entries of {ENTRY} for {args.hold_s:g} s on {result['cluster']}")
    for run in runs:
        print(
            f"  {run['mode']:<27} makespan {run['makespan_s']:6.2f} s, "
            f"{run['out_of_memory']:3d} out-of-memory, {run['failed']:3d} failed, "
            f"{run['mean_running']:.1f} running on average in {run['processes']} processes"
        )
    for name in ("ray", "gpupool"):
        o = overhead[name]
        print(
            f"  overhead {name:<8} {o['per_task_in_batch_ms']:7.2f} ms/task in a batch of "
            f"{args.overhead_tasks}, {o['round_trip_ms']:7.2f} ms round trip"
        )
    print(
        f"  gpupool/ray: {overhead['ratio_in_batch']:.2f}x in a batch, "
        f"{overhead['ratio_round_trip']:.2f}x round trip"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
