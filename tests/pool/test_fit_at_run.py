"""No task starts past the card, and the log says why: the bound at the moment a task runs.

Each test is one way a start could pass the card or a record could misstate
it, on real workers and the simulated host: a worker that boots for a while
after its task was admitted, an out-of-memory cap that outlives the spike that
set it, an underestimated key that caps the card for every other key, a large
task at the head of the queue that stalls the small ones behind it, and
per-card records that leave out the tasks of another key.

Every wait is on something the test controls (a file it creates, a marker a
task leaves) and is bounded; no assertion depends on how long anything took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import fit_tasks

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost, hold
from support import wait_for

GiB = 1024**3

#: How long a test waits for tasks to run side by side before it counts what it
#: saw; a passing run gets there within seconds, a failing one reports its count.
SIDE_BY_SIDE_WAIT_S = 10.0


def _reached(count: Callable[[], int], want: int, timeout_s: float = SIDE_BY_SIDE_WAIT_S) -> int:
    """Poll ``count`` until it reaches ``want`` or ``timeout_s`` passed; return the last count."""
    deadline = time.monotonic() + timeout_s
    seen = count()
    while seen < want and time.monotonic() < deadline:
        time.sleep(0.01)
        seen = count()
    return seen


def _folder(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def test_a_task_is_admitted_against_the_parent_as_it_stands_when_its_worker_is_ready(tmp_path):
    """Workers boot until the parent has taken 9 GiB: two tasks run at once, not three; no OOM."""
    boot = _folder(tmp_path, "boot")
    meet = _folder(tmp_path, "meet")
    with SimulatedHost(
        [SimulatedDevice("30GiB", co_tenants={"trainer": "5GiB"})], cpus=8, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(
            max_workers=6,
            task_peak="6.5GiB",
            initializer=fit_tasks.boot,
            initargs=(str(boot),),
        ) as ex:
            # 24.75 GiB of room holds three at 6.5 GiB; once the parent holds 9 GiB (and its
            # 300 MiB context), 15.46 GiB holds two. Three at once would need 33.2 GiB.
            # Tasks that run at once hold their 6 GiB until three have tried to allocate (or
            # for 2 s, when no third comes): a third beside two is refused whatever the order.
            futures = [ex.submit(fit_tasks.meet, i, "6GiB", str(meet), 3, 2.0) for i in range(7)]
            wait_for(lambda: fit_tasks.count(boot, "booting-") >= 1, what="a worker booting")
            with hold("9GiB", device=0):
                (boot / "go").touch()  # the initializers end only now
                results = [f.result(timeout=60) for f in futures]
            stats = ex.statistics()
            records = [d.to_dict() for d in ex.decisions]
        events = host.out_of_memory_events
    assert results == list(range(7))
    assert events == [], (
        f"{len(events)} task(s) ran the card out of memory after the parent took 9 GiB while "
        "the workers booted; out-of-memory records: "
        + "; ".join(
            f"priced own high-water {r.get('priced_own_high_water_bytes')} B, "
            f"{r.get('running')} running"
            for r in records
            if r["event"] == "out_of_memory"
        )
    )
    assert stats.out_of_memory == 0
    assert [r for r in records if r["event"] == "out_of_memory"] == []
    # The record that prices the parent's bytes narrows card 0 to two, before any task ended.
    own = [i for i, r in enumerate(records) if (r.get("own_high_water_bytes") or 0) >= 9 * GiB]
    assert own, "no record names the parent's 9 GiB as its own high-water"
    assert records[own[0]]["device"] == 0
    assert records[own[0]]["width_after"] == 2
    measured = [i for i, r in enumerate(records) if r.get("key_ask_basis") == "measured"]
    assert measured and own[0] < measured[0]


def test_an_out_of_memory_cap_lifts_once_the_spike_is_gone(tmp_path):
    """A co-tenant spike mid-allocation caps card 0; once it is gone, five run at once again."""
    spike = _folder(tmp_path, "spike")
    later = _folder(tmp_path, "later")
    with SimulatedHost(
        [SimulatedDevice("36GiB", co_tenants={"batch": "1GiB"})], cpus=8, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(max_workers=5, task_peak="5GiB") as ex:
            # 34.75 GiB of room: max_workers=5 sets the width. Each task holds 2 GiB, then
            # 2.5 GiB more (4.8 GiB with its context, within its 5 GiB ask).
            first = [
                ex.submit(fit_tasks.two_step, i, "2GiB", "2.5GiB", str(spike)) for i in range(5)
            ]
            wait_for(lambda: fit_tasks.count(spike, "first-") == 5, what="five first steps")
            host.grow("batch", "16GiB")  # 7.5 GiB free: not all five second steps fit
            (spike / "go").touch()
            wait_for(lambda: ex.statistics().out_of_memory >= 1, what="the spike's OOM")
            host.shrink("batch", "16GiB")  # the spike is over
            (spike / "finish").touch()
            assert [f.result(timeout=60) for f in first] == list(range(5))
            ooms = ex.statistics().out_of_memory
            tasks = [
                ex.submit(fit_tasks.hold_until, i, "4GiB", str(later), "release") for i in range(5)
            ]
            try:
                at_once = _reached(lambda: fit_tasks.count(later, "held-"), 5)
            finally:
                (later / "release").touch()
            assert [f.result(timeout=60) for f in tasks] == list(range(5))
            records = [d.to_dict() for d in ex.decisions]
    caps = [r.get("oom_cap") for r in records if r["event"] == "out_of_memory"]
    assert at_once == 5, (
        f"after the spike ended only {at_once} of 5 tasks ran at once on a card with room for "
        f"all 5: the {ooms} out-of-memory record(s) set caps {caps}, never lifted"
    )
    # A record says the cap lifted, with the live reading it lifted on.
    last_oom = max(i for i, r in enumerate(records) if r["event"] == "out_of_memory")
    lifted = [
        r
        for r in records[last_oom + 1 :]
        if r["device"] == 0
        and r["event"] == "cap_lifted"
        and r.get("room_bytes") is not None
        and r.get("live_free_bytes") is not None
        and r.get("live_not_pool_bytes") is not None
    ]
    assert lifted, "no record after the spike says card 0's cap lifted, with its live reading"


def test_an_underestimated_key_raises_its_ask_and_caps_no_other_key(tmp_path):
    """task_peak=1.5GiB for tasks that hold 5 GiB: their ask rises; another key still runs 6."""
    wave = _folder(tmp_path, "wave")
    other_dir = _folder(tmp_path, "other")
    with SimulatedHost([SimulatedDevice("20GiB")], cpus=8, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=6, task_peak="1.5GiB") as ex:
            # Six fit at the 1.5 GiB estimate; 20 GiB holds three of 5.3 GiB. A task holds
            # until the test releases it, which it does once every task the pool runs has
            # tried to allocate: allocations past the third are refused.
            first = [ex.submit(fit_tasks.hold_or_refused, i, "5GiB", str(wave)) for i in range(6)]

            def every_running_task_tried() -> bool:
                tried = fit_tasks.tried(wave)
                return len(tried) >= 3 and all(
                    i in tried for i, f in enumerate(first) if f.running()
                )

            wait_for(every_running_task_tried, what="every running task to hold or be refused")
            (wave / "release").touch()
            assert [f.result(timeout=60) for f in first] == list(range(6))
            ask = ex.statistics().asks["fit_tasks.hold_or_refused"]
            other = ex.options(key="other", task_peak="1GiB")
            tasks = [
                other.submit(fit_tasks.hold_until, i, "0.8GiB", str(other_dir), "release")
                for i in range(6)
            ]
            try:
                at_once = _reached(lambda: fit_tasks.count(other_dir, "held-"), 6)
            finally:
                (other_dir / "release").touch()
            assert [f.result(timeout=60) for f in tasks] == list(range(6))
            records = [d.to_dict() for d in ex.decisions]
    blamed = [
        str(r["reason"])
        for r in records
        if r["event"] == "out_of_memory" and "something else on the card grew" in str(r["reason"])
    ]
    assert at_once == 6, (
        f"another key's 1.1 GiB tasks ran only {at_once} at once with max_workers=6 on a 20 GiB "
        f"card; out-of-memory records that blamed the card: {blamed}"
    )
    assert blamed == [], blamed
    assert ask.ask_bytes >= 5 * GiB  # the underestimate raised the key's own ask
    assert host.device_peak(0) <= 20 * GiB


def test_small_tasks_keep_starting_beside_a_large_task_while_another_large_one_waits(tmp_path):
    """A 16 GiB task waits for the one running; 24 small ones run beside it; every large runs."""
    with SimulatedHost([SimulatedDevice("30GiB")], cpus=8, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=6, task_peak="1.5GiB") as ex:
            large = ex.options(key="large", task_peak="16GiB")
            small = ex.options(key="small", task_peak="1.5GiB")
            # 29.75 GiB of room: two large (32 GiB) never fit together, even with no small
            # task running; a large and five small (23.5 GiB) do.
            first = large.submit(fit_tasks.hold_until, 1, "15GiB", str(tmp_path), "release")
            wait_for(lambda: fit_tasks.count(tmp_path, "held-1-") == 1, what="the first large")
            second = large.submit(fit_tasks.hold_until, 2, "15GiB", str(tmp_path), "release")
            smalls = [small.submit(fit_tasks.brief, i, "1GiB") for i in range(24)]
            third = large.submit(fit_tasks.hold_until, 3, "15GiB", str(tmp_path), "release")
            try:
                # The first large task holds until the test releases it: every small task
                # that ends meanwhile ran beside it.
                done = _reached(lambda: sum(f.done() for f in smalls), len(smalls))
                width = ex.width
            finally:
                (tmp_path / "release").touch()
            assert [f.result(timeout=60) for f in (first, second, third)] == [1, 2, 3]
            assert [f.result(timeout=60) for f in smalls] == list(range(24))
            records = [d.to_dict() for d in ex.decisions]
        events = host.out_of_memory_events
    assert done == len(smalls), (
        f"only {done} of {len(smalls)} small tasks ran while the first large task held the card "
        f"and the second waited for room; the rest waited behind it, room for five free "
        f"(ex.width read {width})"
    )
    assert events == []
    held_back = [
        r
        for r in records
        if str(r["event"]).endswith("_wait") and r["key"] == "large" and r.get("room_bytes")
    ]
    assert held_back, "no record names the large task held back for room, with its bound"


def test_every_record_of_a_card_counts_the_tasks_it_runs(tmp_path):
    """Card 0 (10 GiB) runs two small tasks while a large key is measured: its records say >= 2."""
    with SimulatedHost(
        [SimulatedDevice("10GiB"), SimulatedDevice("32GiB")], cpus=8, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(max_workers=6, task_peak="14GiB") as ex:
            large = ex.options(key="large", task_peak="14GiB")
            small = ex.options(key="small", task_peak="3GiB")
            # Card 0's 9.75 GiB of room holds no large task: both go to card 1 (31.75 GiB),
            # which then has less room left for a small task than card 0.
            larges = [
                large.submit(fit_tasks.hold_until, i, "13GiB", str(tmp_path), "large-go")
                for i in range(2)
            ]
            wait_for(lambda: fit_tasks.count(tmp_path, "held-") == 2, what="two large tasks")
            smalls = [
                small.submit(fit_tasks.hold_until, i, "2.5GiB", str(tmp_path), "small-go")
                for i in (20, 21)
            ]
            try:
                wait_for(lambda: fit_tasks.count(tmp_path, "held-") == 4, what="two small tasks")
                on_card_0 = fit_tasks.count(tmp_path, "held-20-0", "held-21-0")
                before = len(ex.decisions)
                # The large tasks end (their key is measured) while the small ones hold.
                (tmp_path / "large-go").touch()
                assert [f.result(timeout=60) for f in larges] == [0, 1]
                records = [d.to_dict() for d in ex.decisions]
            finally:
                (tmp_path / "large-go").touch()
                (tmp_path / "small-go").touch()
            assert [f.result(timeout=60) for f in smalls] == [20, 21]
    assert host.out_of_memory_events == []
    assert on_card_0 >= 1, "the setup needs a small task on card 0"
    # Every record from `before` on was made while the small tasks held card 0.
    understated = [
        (r["event"], r["width_after"])
        for r in records[before:]
        if r["device"] == 0 and (r["width_after"] or 0) < on_card_0
    ]
    assert understated == [], f"card 0 ran {on_card_0} task(s), yet its records say {understated}"
    # What the log says of card 0 as the large tasks ended (a plot draws its latest record).
    latest = [r for r in records if r["device"] == 0][-1]
    assert (latest["width_after"] or 0) >= on_card_0, (latest["event"], latest["width_after"])
