"""The bound at every start, on real processes and the simulated host.

Each test is one hole the planner closes: the parent growing after
construction, an out-of-memory lowering a price, a co-tenant spike failing
the backlog, host RAM not bounding the first wave, a width priced at a key
that is not there, and a fluctuating co-tenant churning records and workers.
"""

from __future__ import annotations

import random
import threading

import pytest
import tasks

from gpupool import ConfigurationError, DeviceOutOfMemoryError, GpuPoolExecutor
from gpupool._core.units import GiB, MiB
from gpupool.testing import SimulatedDevice, SimulatedHost, SimulatedOutOfMemory, hold
from support import wait_for

CONTEXT_BYTES = 300 * MiB


def test_the_parent_growing_after_construction_narrows_the_next_start():
    """The parent's own bytes are read before every start: 25 GiB held later leaves room for 3."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=8, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=4, task_peak="3.5GiB") as ex:
            # A first wave measures the task: 3.5 GiB + the 300 MiB context, plus the margin.
            assert list(ex.map(tasks.sized, range(4), ["3.5GiB"] * 4, [0.05] * 4)) == list(range(4))
            ask = ex.statistics().asks["tasks.sized"]
            assert ask.basis == "measured"
            room_after = 40 * GiB - 25 * GiB - 256 * MiB
            assert 3 * ask.ask_bytes <= room_after < 4 * ask.ask_bytes
            with hold("25GiB", device=0):
                results = list(ex.map(tasks.sized, range(8), ["3.5GiB"] * 8, [0.3] * 8))
                width_then = ex.width
            records = [d.to_dict() for d in ex.decisions]
    assert results == list(range(8))
    assert host.out_of_memory_events == []
    # Four at once would have held 25 + 4 x 3.79 GiB; three hold 25 + 3 x 3.79.
    four_at_once = 25 * GiB + 4 * (int(3.5 * GiB) + CONTEXT_BYTES)
    assert host.device_peak(0) < four_at_once
    assert width_then == 3
    own = [r for r in records if (r.get("own_high_water_bytes") or 0) >= 25 * GiB]
    assert own, "a record names the grown own high-water"
    assert own[0]["event"] == "narrowed"
    assert own[0]["width_after"] == 3


def test_an_out_of_memory_never_lowers_a_price_below_its_estimate():
    """A 7 GiB task that runs out while creating its context keeps a 7 GiB ask, not 556 MiB."""
    with SimulatedHost(
        [SimulatedDevice("40GiB", co_tenants={"job": "0.1GiB"})], cpus=8, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(max_workers=8, task_peak="7GiB", room_wait_s=60) as ex:
            host.grow("job", "39.8GiB")  # another job fills the card after the census
            future = ex.submit(tasks.sized, 1, "6GiB", 0.05)
            wait_for(
                lambda: host.out_of_memory_events, what="the out-of-memory at context creation"
            )
            wait_for(lambda: ex.statistics().out_of_memory >= 1, what="the pool to see it")
            ask = ex.statistics().asks["tasks.sized"]
            assert ask.ask_bytes >= 7 * GiB
            host.shrink("job", "39.8GiB")  # the card frees: the waiting task retries
            assert future.result(timeout=60) == 1
            results = list(ex.map(tasks.sized, range(12), ["6GiB"] * 12, [0.2] * 12))
            stats = ex.statistics()
    assert results == list(range(12))
    assert len(host.out_of_memory_events) == 1  # only the one the co-tenant caused
    assert stats.retries == 1
    assert stats.tasks_failed == 0


def test_a_brief_co_tenant_spike_does_not_fail_the_backlog():
    """While another job fills the card, a lone out-of-memory waits for room; nothing fails."""
    with SimulatedHost(
        [SimulatedDevice("20GiB", co_tenants={"spike": "0.1GiB"})], cpus=4, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(max_workers=2, task_peak="2GiB", room_wait_s=60) as ex:
            host.grow("spike", "19.5GiB")  # the card is full
            futures = [ex.submit(tasks.sized, i, "1.5GiB", 0.05) for i in range(20)]
            wait_for(lambda: ex.statistics().out_of_memory >= 1, what="the first lone OOM")
            host.shrink("spike", "19.5GiB")  # the spike ends
            results = [f.result(timeout=60) for f in futures]
            stats = ex.statistics()
            events = [d.event for d in ex.decisions]
    assert results == list(range(20))
    assert stats.tasks_failed == 0
    # The backlog waited behind the first lone out-of-memory instead of each running out.
    assert stats.out_of_memory <= 2
    assert "out_of_memory" in events


def test_host_ram_bounds_the_first_wave_before_any_child_reports():
    """host_ram=1.5GiB: until a child reports its RSS, a child is priced at the 1 GiB prior."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=8, host_ram="1.5GiB", context=0):
        with GpuPoolExecutor(max_workers=8, task_peak="1GiB") as ex:
            first = ex.decisions[0]
            assert ex.width == 1
            results = list(ex.map(tasks.sized, range(6), ["1GiB"] * 6, [0.05] * 6))
            records = [d.to_dict() for d in ex.decisions]
    assert results == list(range(6))
    assert first.ceiling is not None
    assert first.ceiling.limit == "host_ram"
    assert first.ceiling.child_rss_bytes == 1 * GiB
    # Once a child reported its real RSS (tens of MiB), the ceiling rose.
    widened = [r for r in records if r["event"] == "widened" and r["device"] is None]
    assert widened
    assert widened[0]["child_rss_bytes"] < 1 * GiB


def test_a_large_key_does_not_serialise_a_small_one_and_the_width_says_so():
    """A 20 GiB key and a 1 GiB key: one large and three small run at once, and width says 4."""
    with SimulatedHost([SimulatedDevice("24GiB")], cpus=8, host_ram="64GiB", context=0) as host:
        with GpuPoolExecutor(max_workers=4, task_peak="1GiB", reserve=0) as ex:
            large = ex.options(key="large", task_peak="20GiB")
            small = ex.options(key="small", task_peak="1GiB")
            big = large.submit(tasks.sized, 0, "19GiB", 1.0)
            wait_for(big.running, what="the large task to start")
            smalls = [small.submit(tasks.sized, i, "0.9GiB", 1.0) for i in range(3)]
            wait_for(lambda: all(f.running() for f in smalls), what="three small beside it")
            width = ex.width
            by_key = ex.statistics().widths_by_key
            assert big.result(timeout=60) == 0
            assert [f.result(timeout=60) for f in smalls] == [0, 1, 2]
    assert width == 4
    assert by_key["small"] >= 3
    assert host.out_of_memory_events == []


def test_a_fluctuating_co_tenant_does_not_churn_records_or_workers():
    """1,000 short tasks beside a co-tenant that comes and goes: bounded records, warm workers."""
    stop = threading.Event()
    with SimulatedHost(
        [SimulatedDevice("40GiB", co_tenants={"noisy": "1GiB"})], cpus=4, host_ram="64GiB"
    ) as host:

        def fluctuate() -> None:
            rng = random.Random(7)
            held = 0
            while not stop.is_set():
                step = rng.choice([-1, 1]) * rng.randint(1, 6) * GiB
                step = max(-held, min(step, 30 * GiB - held))
                try:
                    if step > 0:
                        host.grow("noisy", step)
                    elif step < 0:
                        host.shrink("noisy", -step)
                except SimulatedOutOfMemory:
                    step = 0  # the card could not hold the growth now: the pool's tasks did
                held += step
                stop.wait(0.01)

        thread = threading.Thread(target=fluctuate)
        thread.start()
        try:
            with GpuPoolExecutor(max_workers=4, task_peak="1GiB") as ex:
                results = list(ex.map(tasks.sized, range(1000), ["0.5GiB"] * 1000, [0.0] * 1000))
                stats = ex.statistics()
                records = len(ex.decisions)
        finally:
            stop.set()
            thread.join()
    assert results == list(range(1000))
    assert stats.tasks_failed == 0
    assert records < 120, records
    assert stats.workers_started <= 16, stats.workers_started


def test_the_width_follows_a_hinted_key_as_soon_as_its_tasks_are_held():
    """A key hinted at 6 GiB in a pool priced at 1 GiB: ex.width says what runs (4), not 8."""
    with SimulatedHost(
        [SimulatedDevice("40GiB", co_tenants={"srv": "10GiB"})], cpus=8, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(task_peak="1GiB") as ex:
            hinted = ex.options(key="k", task_peak="6GiB")
            futures = [hinted.submit(tasks.sized, i, "6GiB", 0.5) for i in range(10)]
            wait_for(lambda: sum(f.running() for f in futures) >= 4, what="four running")
            width = ex.width
            by_key = ex.statistics().widths_by_key
            assert [f.result(timeout=60) for f in futures] == list(range(10))
    assert width == 4
    assert by_key["k"] == 4
    assert host.out_of_memory_events == []


def test_a_fixed_width_wider_than_max_workers_is_refused():
    """width=4 with max_workers=2 contradict each other: refused, naming both."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=8, host_ram="64GiB"):
        with pytest.raises(ConfigurationError, match=r"^width=4 is more than max_workers=2"):
            GpuPoolExecutor(max_workers=2, width=4)


def test_shutdown_with_cancel_futures_does_not_wait_out_a_task_waiting_for_room():
    """A task waiting for room after a lone OOM fails at shutdown(cancel_futures=True) at once."""
    with SimulatedHost(
        [SimulatedDevice("40GiB", co_tenants={"srv": "10GiB"})], cpus=8, host_ram="64GiB"
    ) as host:
        ex = GpuPoolExecutor(task_peak="6GiB", room_wait_s=600)
        try:
            assert ex.submit(tasks.sized, 0, "6GiB", 0.0).result(timeout=60) == 0
            host.grow("srv", "27GiB")  # the card is full: the next task runs out alone
            waiting = ex.submit(tasks.sized, 1, "6GiB", 0.0)
            queued = ex.submit(tasks.sized, 2, "6GiB", 0.0)
            wait_for(lambda: ex.statistics().out_of_memory >= 1, what="the lone OOM")
        finally:
            ex.shutdown(wait=True, cancel_futures=True)  # would block for room_wait_s before
    error = waiting.exception(timeout=0)
    assert isinstance(error, DeviceOutOfMemoryError)
    assert "waiting for room when the pool was shut down" in str(error)
    assert queued.cancelled()
