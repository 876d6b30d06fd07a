"""The bound, the live gate and out-of-memory retries, with real processes on simulated cards."""

from __future__ import annotations

import threading
import time

import pytest
import tasks

from gpupool import DeviceOutOfMemoryError, GpuPoolExecutor, WidthError
from gpupool._core.units import GiB
from gpupool.testing import SimulatedDevice, SimulatedHost, hold

pytestmark = pytest.mark.slow


def test_cotenant_growing_mid_run_is_held_back_by_the_live_gate():
    """A co-tenant that grows after the census makes tasks wait, and nothing runs out."""
    with SimulatedHost(
        devices=[SimulatedDevice(total="40GiB", co_tenants={"serve": "4GiB"})],
        cpus=16,
        host_ram="128GiB",
        context="0MiB",
    ) as host:
        with GpuPoolExecutor(max_workers=4, task_peak="8GiB", reserve=0) as ex:
            assert ex.width == 4
            first = [ex.submit(tasks.sized, i, "7GiB", 1.5) for i in range(2)]
            deadline = time.monotonic() + 30
            while host.used(0) < 18 * 2**30 and time.monotonic() < deadline:
                time.sleep(0.01)
            # Both hold 7 GiB; serve grows 4 -> 18 GiB, leaving 8 GiB free: the bound
            # (room 36 GiB) would admit two more 8 GiB asks, the card holds one.
            host.grow("serve", "14GiB")
            later = [ex.submit(tasks.sized, i, "7GiB", 0.2) for i in range(2, 8)]
            results = [f.result(timeout=60) for f in first + later]
            decisions = ex.decisions
        events = host.out_of_memory_events
    assert results == list(range(8))
    assert events == []
    waits = [d for d in decisions if d.event == "live_gate_wait"]
    assert waits, [d.event for d in decisions]
    assert "live_free_bytes" in waits[0].to_dict()


def test_underestimated_task_peak_is_retried_narrower_and_every_result_returns():
    """A task_peak four times too small: OOMs happen, are retried, and name the ask."""
    with (
        SimulatedHost(
            devices=[SimulatedDevice(total="44.39GiB", co_tenants={"serve": "9.54GiB"})],
            cpus=16,
            host_ram="128GiB",
        ) as host,
        hold("16.20GiB"),
    ):
        with GpuPoolExecutor(max_workers=4, task_peak="1.5GiB") as ex:
            assert ex.width == 4
            results = list(ex.map(tasks.entry, range(12), [0.5] * 12))
            decisions = ex.decisions
            stats = ex.statistics()
        events = host.out_of_memory_events
    assert results == [i * i for i in range(12)]
    ooms = [d for d in decisions if d.event == "out_of_memory"]
    assert ooms
    assert len(events) == len(ooms) == stats.out_of_memory
    assert stats.retries == len(ooms)
    first = ooms[0].to_dict()
    # The ask was the wrong term: the child needed more than it was booked at.
    assert first["task_ask_bytes"] == int(1.5 * 2**30)
    assert first["reached_bytes"] + first["requested_bytes"] > first["task_ask_bytes"]
    assert any(d.event == "narrowed" for d in decisions)
    assert stats.asks["tasks.entry"].basis == "measured"
    assert stats.asks["tasks.entry"].ask_bytes > 6 * 2**30


def test_oom_alone_on_the_card_reaches_the_future():
    """A task that runs a card out of memory alone fails with DeviceOutOfMemoryError."""
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=4, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            future = ex.submit(tasks.sized, 0, "12GiB", 0.0)
            with pytest.raises(DeviceOutOfMemoryError, match=r"^card 0: a task of tasks\.sized"):
                future.result(timeout=60)
            assert ex.submit(tasks.sized, 1, "1GiB", 0.0).result(timeout=60) == 1


def test_several_devices_a_full_card_gets_no_work():
    """With several cards, tasks go to cards with room and a full card gets none."""
    with SimulatedHost(
        devices=[
            SimulatedDevice(total="24GiB", co_tenants={"train": "23GiB"}),
            SimulatedDevice(total="24GiB", co_tenants={"serve": "8GiB"}),
            SimulatedDevice(total="24GiB"),
        ],
        cpus=16,
        host_ram="128GiB",
    ) as host:
        full = host.device_uuid(0)
        with GpuPoolExecutor(max_workers=8, task_peak="4GiB") as ex:
            results = list(ex.map(tasks.where, range(16), ["3GiB"] * 16, [0.2] * 16))
            decisions = [d for d in ex.decisions if d.event == "constructed"]
        assert host.device_peak(0) == 23 * 2**30
        events = host.out_of_memory_events
    pinned = {uuid for _, uuid in results}
    assert [i for i, _ in results] == list(range(16))
    assert full not in pinned
    assert len(pinned) == 2
    assert {d.device: d.width_after for d in decisions}[0] == 0
    assert events == []


def test_unreadable_device_runs_at_width_one_with_its_reason():
    """An unreadable card gets width 1 and a recorded reason, never an assumed empty card."""
    with (
        SimulatedHost(
            devices=[SimulatedDevice(total="80GiB", readable=False)], cpus=16, host_ram="64GiB"
        ),
        GpuPoolExecutor(max_workers=4, task_peak="1GiB") as ex,
    ):
        assert ex.width == 1
        assert list(ex.map(tasks.sleep_return, range(3), [0.0] * 3)) == [0, 1, 2]
        constructed = ex.decisions[0]
    assert constructed.event == "constructed"
    assert constructed.limit == "unreadable"
    assert constructed.bound is not None and constructed.bound.room_bytes is None
    assert "unreadable" in constructed.reason


def test_no_driver_is_a_host_bounded_pool_that_says_so(monkeypatch):
    """Without a driver the pool is bounded by the host only, and its first record says so."""
    monkeypatch.delenv("GPUPOOL_SIMULATOR", raising=False)
    with SimulatedHost(devices=[], cpus=3, host_ram="64GiB", driver=False):
        with GpuPoolExecutor() as ex:
            assert ex.census.cards == ()
            assert ex.census.driver is False
            assert ex.width == 3
            assert ex.submit(tasks.sleep_return, 5, 0.0).result(timeout=60) == 5
            first = ex.decisions[0]
    assert first.event == "constructed"
    assert "host-bounded" in first.reason
    assert first.limit == "max_workers"  # the default max_workers is the usable CPUs


def test_an_explicit_max_workers_is_not_capped_by_the_cpus(monkeypatch):
    """max_workers=8 on 3 usable CPUs runs 8 at once, as ProcessPoolExecutor(8) does."""
    monkeypatch.delenv("GPUPOOL_SIMULATOR", raising=False)
    with SimulatedHost(devices=[], cpus=3, host_ram="64GiB", driver=False):
        with GpuPoolExecutor(max_workers=8) as ex:
            assert ex.width == 8
            first = ex.decisions[0]
    assert first.limit == "max_workers"
    assert "max_workers=8 is more than the 3 usable CPUs" in first.reason


def test_fixed_width_keeps_the_width_and_logs_when_over_the_bound():
    """width=3 runs three at once on a card that holds one, with a diagnostic."""
    with SimulatedHost(
        devices=[SimulatedDevice(total="40GiB")], cpus=16, host_ram="64GiB", context="0MiB"
    ) as host:
        with GpuPoolExecutor(task_peak="30GiB", width=3) as ex:
            assert ex.width == 3
            barrier_results = list(ex.map(tasks.sized, range(3), ["2GiB"] * 3, [0.8] * 3))
            decisions = ex.decisions
        peak = host.device_peak(0)
    assert barrier_results == [0, 1, 2]
    assert peak == 6 * 2**30
    assert any(d.event == "fixed_width_over_bound" for d in decisions)


def test_strict_mode_refuses_to_narrow_at_construction():
    """strict=True raises WidthError, with every term, when the bound is below max_workers."""
    with (
        SimulatedHost(
            devices=[SimulatedDevice(total="44.39GiB", co_tenants={"serve": "9.54GiB"})],
            cpus=16,
            host_ram="128GiB",
        ),
        hold("16.20GiB"),
    ):
        with pytest.raises(WidthError, match=r"^strict mode: the bound gives width 1") as info:
            GpuPoolExecutor(max_workers=4, task_peak="9.9GiB", strict=True)
    assert info.value.decision is not None
    assert info.value.decision["ask_bytes"] == int(9.9 * 2**30)


def test_strict_mode_runs_when_the_bound_holds_the_width():
    """strict=True with room for max_workers runs normally."""
    with SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=16, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB", strict=True) as ex:
            assert list(ex.map(tasks.sized, range(4), ["2GiB"] * 4, [0.0] * 4)) == [0, 1, 2, 3]


def test_strict_mode_is_not_capped_by_the_cpus():
    """strict=True with max_workers=4 on two usable CPUs: width 4, as without strict (an
    explicit max_workers is not capped by the CPU count)."""
    with SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="4GiB", strict=True) as ex:
            assert ex.width == 4
            first = ex.decisions[0]
    assert first.limit == "max_workers"
    assert "max_workers=4 is more than the 2 usable CPUs" in first.reason


def test_strict_mode_runs_narrower_where_host_ram_holds_fewer():
    """strict=True: the host-RAM term still caps the width (at a 1 GiB RSS prior per child,
    2 GiB of host RAM hold two), and that is no WidthError."""
    with SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=16, host_ram="2GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="4GiB", strict=True) as ex:
            assert ex.width == 2
            first = ex.decisions[0]
    assert first.limit == "host_ram"


def test_per_key_hints_price_mixed_tasks_by_their_own_asks():
    """Two keys with their own hints share a card by bytes: small ones pack beside big ones."""
    with SimulatedHost(
        devices=[SimulatedDevice(total="40GiB")], cpus=16, host_ram="64GiB", context="0MiB"
    ) as host:
        with GpuPoolExecutor(max_workers=8, task_peak="1GiB", reserve=0) as ex:
            big = ex.options(key="big", task_peak="20GiB")
            small = ex.options(key="small", task_peak="2GiB")
            futures = [big.submit(tasks.sized, i, "18GiB", 0.3) for i in range(2)]
            futures += [small.submit(tasks.sized, i, "1.5GiB", 0.3) for i in range(2, 8)]
            assert [f.result(timeout=60) for f in futures] == list(range(8))
            stats = ex.statistics()
        events = host.out_of_memory_events
    assert events == []
    assert set(stats.asks) == {"big", "small"}
    assert stats.asks["big"].basis == "measured"


def test_serial_path_is_never_blocked_by_the_live_gate():
    """When nothing of the pool runs, a task starts even though the live gate is shut."""
    with (
        SimulatedHost(
            devices=[SimulatedDevice(total="20GiB", co_tenants={"serve": "2GiB"})],
            cpus=4,
            host_ram="64GiB",
            context="0MiB",
        ) as host,
        GpuPoolExecutor(max_workers=2, task_peak="4GiB", reserve=0) as ex,
    ):
        host.grow("serve", "15GiB")  # 3 GiB left: less than one ask
        assert ex.submit(tasks.sized, 7, "1GiB", 0.0).result(timeout=60) == 7
        decisions = ex.decisions
    assert any(d.event == "serial_start" for d in decisions)


def test_waiting_tasks_stay_pending_and_can_be_cancelled(tmp_path):
    """A task held back for memory is PENDING, so cancel() works on it.

    The first task runs until the test releases it, so the second is held back for as long
    as the test looks at it, whatever the load."""
    started, release = tmp_path / "started", tmp_path / "release"
    with (
        SimulatedHost(
            devices=[SimulatedDevice(total="10GiB")], cpus=4, host_ram="64GiB", context="0MiB"
        ),
        GpuPoolExecutor(max_workers=4, task_peak="8GiB", reserve=0) as ex,
    ):
        try:
            assert ex.width == 1
            running = ex.submit(tasks.touch_and_wait, str(started), str(release))
            waiting = ex.submit(tasks.sized, 1, "1GiB", 0.0)
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert started.exists()
            assert not waiting.running()
            assert waiting.cancel()
        finally:
            release.touch()
        assert running.result(timeout=60) == 0
        assert waiting.cancelled()


def test_submit_from_many_threads_loses_nothing():
    """Concurrent submitters: every future completes with its own result."""
    with SimulatedHost(devices=[SimulatedDevice(total="80GiB")], cpus=4, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            futures: list = []
            lock = threading.Lock()

            def submit_some(base: int) -> None:
                for i in range(base, base + 50):
                    f = ex.submit(tasks.sleep_return, i, 0.0)
                    with lock:
                        futures.append((i, f))

            threads = [threading.Thread(target=submit_some, args=(b,)) for b in (0, 50, 100)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(f.result(timeout=60) for _, f in futures) == list(range(150))
            assert all(f.result() == i for i, f in futures)


def test_unified_memory_prices_a_childs_device_bytes_and_rss_in_one_budget():
    """On a unified card (GB10, Jetson) a task's device bytes and its child's RSS come out of
    one MemAvailable: 16 GiB at 3 GiB + 1 GiB RSS holds 4, where a discrete card holds 5."""
    widths = {}
    for unified in (False, True):
        with (
            SimulatedHost([SimulatedDevice("16GiB", unified=unified)], cpus=16, host_ram="16GiB"),
            GpuPoolExecutor(max_workers=8, task_peak="3GiB", reserve=0) as ex,
        ):
            constructed = ex.decisions[0]
        assert constructed.event == "constructed"
        assert constructed.bound is not None
        widths[unified] = (constructed.width_after, constructed.bound.host_per_task_bytes)
    assert widths == {False: (5, 0), True: (4, GiB)}
