"""Regressions from a review of the dispatcher: each pins a defect that once left a future
pending, leaked a descriptor, or logged a width the pool did not run."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import pytest
import regress_tasks as rt
from leakguard import wait_until

from gpupool import GpuPoolExecutor, InitializerError, WidthError
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = pytest.mark.faults


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_strict_oom_beside_a_neighbour_leaves_no_future_pending(tmp_path):
    """strict=True: an out-of-memory that would narrow breaks the pool, and both futures end.

    Staged with files: ``a`` holds its 6 GiB until told, ``b`` allocates only once both run,
    so ``b`` runs out beside ``a`` on every run, whatever the load (before: ``a`` could finish
    before ``b`` allocated, and ``b`` then held a result)."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        ex = GpuPoolExecutor(max_workers=2, strict=True, task_peak="4GiB", reserve=0)
        try:
            a = ex.submit(
                rt.hold_until_told, 0, "6GiB", str(tmp_path / "a-ready"), str(tmp_path / "a-go")
            )
            b = ex.submit(
                rt.hold_when_told, 1, "6GiB", str(tmp_path / "b-ready"), str(tmp_path / "b-go")
            )
            assert wait_until(
                lambda: (tmp_path / "a-ready").exists() and (tmp_path / "b-ready").exists(), 60
            )
            (tmp_path / "b-go").touch()
            assert wait_until(lambda: ex.statistics().out_of_memory >= 1, 60)
            (tmp_path / "a-go").touch()  # b's retry waits for its neighbour, then narrows
            _, not_done = concurrent.futures.wait([a, b], timeout=60)
            assert not not_done
            assert isinstance(b.exception(), WidthError)
        finally:
            (tmp_path / "a-go").touch()
            (tmp_path / "b-go").touch()
            ex.shutdown()


def test_a_worker_that_cannot_start_fails_its_task():
    """initargs that cannot be pickled when a worker starts fail the task, never hang it: no
    worker can ever start, so the pool breaks at once, naming the initializer."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB"):
        ex = GpuPoolExecutor(
            max_workers=1, task_peak="1GiB", initializer=print, initargs=(threading.Lock(),)
        )
        try:
            future = ex.submit(rt.sleep_for, 0.0)
            with pytest.raises(
                InitializerError, match=r"builtins.print or its initargs cannot be sent"
            ):
                future.result(timeout=30)
            assert isinstance(future.exception(), BrokenProcessPool)
        finally:
            ex.shutdown()


def test_a_second_shutdown_writes_nothing_into_a_reused_descriptor(tmp_path):
    """After the dispatcher closed its wake pipe, a later shutdown() never writes to that fd."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB"):
        ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
        assert ex.submit(rt.sleep_for, 0.0).result(timeout=30) == 0.0
        ex.shutdown()
        path = tmp_path / "victim.bin"
        with path.open("wb") as victim:
            ex.shutdown()
            del ex
            import gc

            gc.collect()
            victim.flush()
        assert path.read_bytes() == b""


def test_an_oom_beside_a_neighbour_that_has_since_finished_is_retried():
    """A task that ran out of memory while a neighbour ran is retried, even if the neighbour
    finished before the report arrived."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB", reserve=0) as ex:
            a = ex.submit(rt.hold_after, 0, "6GiB", 0.0, 1.0)
            b = ex.submit(rt.hold_after, 1, "6GiB", 0.3, 0.0, 1.5)
            assert a.result(timeout=30) == 0
            assert b.result(timeout=30) == 1
            assert ex.statistics().retries >= 1


def test_an_exception_whose_str_raises_reaches_its_future():
    """An exception that cannot be turned into text still reaches its future with its type."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
            with pytest.raises(rt.BadStrError):
                ex.submit(rt.raise_bad_str).result(timeout=30)
            assert ex.statistics().workers_lost == 0


def test_refused_strict_constructions_leak_no_descriptors():
    """A constructor that raises gives its descriptors back."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=16, host_ram="64GiB"):
        with pytest.raises(WidthError):  # the first opens the ledger, which stays cached
            GpuPoolExecutor(max_workers=4, task_peak="8GiB", strict=True)
        before = _fds()
        for _ in range(10):
            with pytest.raises(WidthError):
                GpuPoolExecutor(max_workers=4, task_peak="8GiB", strict=True)
        assert _fds() == before


def test_a_done_callback_that_stops_the_pool_does_not_deadlock_shutdown(tmp_path):
    """A cancelled future's callback may call terminate_workers() during shutdown(cancel)."""
    ready, release = tmp_path / "ready", tmp_path / "release"
    try:
        with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB"):
            ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
            # Runs until the callback's terminate_workers() ends it: never released.
            running = ex.submit(rt.tell_and_wait, str(ready), str(release))
            queued = ex.submit(rt.sleep_for, 0.0)
            queued.add_done_callback(lambda f: ex.terminate_workers() if f.cancelled() else None)
            assert wait_until(ready.exists, 60)
            t = threading.Thread(target=ex.shutdown, kwargs={"cancel_futures": True}, daemon=True)
            t.start()
            t.join(60)
            assert not t.is_alive()
            assert running.done()
            assert queued.cancelled()
    finally:
        release.touch()


def test_the_reported_width_never_passes_an_out_of_memory_cap(tmp_path):
    """After an out-of-memory capped a card, a later measurement cannot report it wider.

    Staged with files, not delays: the out-of-memory happens on every run."""
    with SimulatedHost(
        [SimulatedDevice("16GiB", co_tenants={"serve": "0GiB"})],
        cpus=8,
        host_ram="64GiB",
        context="0MiB",
    ) as host:
        with GpuPoolExecutor(max_workers=4, task_peak="3GiB", reserve=0) as ex:
            a = ex.submit(
                rt.hold_when_told, 0, "2GiB", str(tmp_path / "a-ready"), str(tmp_path / "a-go")
            )
            b = ex.options(key="b").submit(
                rt.hold_until_told, 1, "512MiB", str(tmp_path / "b-ready"), str(tmp_path / "b-go")
            )
            assert wait_until(
                lambda: (tmp_path / "a-ready").exists() and (tmp_path / "b-ready").exists(), 60
            )
            host.grow("serve", "14GiB")  # 14 + 0.5 held by b: a's 2 GiB cannot fit
            (tmp_path / "a-go").touch()
            assert wait_until(lambda: ex.statistics().out_of_memory >= 1, 60)
            host.shrink("serve", "14GiB")
            (tmp_path / "b-go").touch()
            assert a.result(timeout=60) == 0  # retried once b was done, alone
            assert b.result(timeout=60) == 1
            cap = ex._dispatcher.planner.state.cards[0].cap.oom_cap
            assert cap is not None
            after_s = max(d.time_s for d in ex.decisions if d.event == "out_of_memory")
            futures = [ex.options(key="b").submit(rt.sleep_for, 0.0) for _ in range(4)]
            concurrent.futures.wait(futures, timeout=30)
            assert ex.width <= cap
            assert all(
                d.width_after is None or d.width_after <= cap
                for d in ex.decisions
                if d.device == 0 and d.event in {"widened", "narrowed"} and d.time_s >= after_s
            )


def test_strict_oom_without_narrowing_keeps_the_pool():
    """strict=True with the width set by max_workers: an out-of-memory retry that does not
    narrow below that width does not break the pool."""
    with SimulatedHost(
        [SimulatedDevice("20GiB", co_tenants={"serve": "0GiB"})],
        cpus=2,
        host_ram="64GiB",
        context="0MiB",
    ) as host:
        ex = GpuPoolExecutor(max_workers=2, strict=True, task_peak="4GiB", reserve=0)
        try:
            assert ex.width == 2
            a = ex.submit(rt.hold_after, 0, "5GiB", 0.0, 1.5)
            b = ex.submit(rt.hold_after, 1, "5GiB", 0.5, 0.0)
            time.sleep(0.2)
            host.grow("serve", "12GiB")
            concurrent.futures.wait([a, b], timeout=30)
            host.shrink("serve", "12GiB")
            assert a.result() == 0
            assert not ex._broken
            assert ex.submit(rt.sleep_for, 0.0).result(timeout=30) == 0.0
        finally:
            ex.shutdown()


def test_fixed_width_oom_retries_wait_for_the_neighbour():
    """Fixed width: a retried task waits for its neighbour instead of re-running out at once."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        with GpuPoolExecutor(width=2, task_peak="4GiB", reserve=0) as ex:
            a = ex.submit(rt.hold_after, 0, "6GiB", 0.0, 2.0)
            b = ex.submit(rt.hold_after, 1, "6GiB", 0.3, 0.0)
            assert (a.result(timeout=30), b.result(timeout=30)) == (0, 1)
            stats = ex.statistics()
            assert stats.out_of_memory == 1
            assert stats.retries == 1
            assert ex.width == 2


def test_kill_workers_after_terminate_workers_still_sends_sigkill(tmp_path):
    """kill_workers() after terminate_workers() sends SIGKILL to a worker that outlived
    SIGTERM (its task notes the SIGTERM in a file and goes on: no sleep stands in for it)."""
    try:
        with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB"):
            ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
            future = ex.submit(rt.survive_sigterm, str(tmp_path))
            assert wait_until((tmp_path / "ready").exists, 60)  # its handler is in place
            ex.terminate_workers()
            assert wait_until((tmp_path / "sigterm").exists, 60)  # heard, and lived on
            ex.kill_workers()
            error = future.exception(timeout=60)
            assert getattr(error, "signal_name", None) == "SIGKILL"
            ex.shutdown()
    finally:
        (tmp_path / "release").touch()
