"""gpupool.testing: a simulated GPU host shared by a parent and its real child processes."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import loky
import pytest

import gpupool
import gpupool.testing as gt
from gpupool._core.units import GiB, MiB
from gpupool._sensors.select import SIMULATOR_ENV, default_sensor
from gpupool._sensors.simulated import CO_TENANT_PID_BASE, Ledger
from gpupool._sensors.simulated_sensor import SimulatedSensor

SPAWN = multiprocessing.get_context("spawn")
# How long a child waits for a signal from the test before giving up (a
# safety net so a broken test fails instead of hanging; never asserted on).
PATIENCE_S = 60.0


# -- functions run in child processes (top level, so spawn can import them) -------------------


def _hold_until(size: str, held: Any, release: Any) -> None:
    """Hold ``size`` on the pinned device, say so through ``held``, keep it until ``release``."""
    with gt.hold(size):
        held.wait(PATIENCE_S)
        release.wait(PATIENCE_S)


def _try_hold(size: str, results: Any) -> None:
    """Try to hold ``size``; report ("held", pid, device) or ("oom", pid, error)."""
    try:
        with gt.hold(size) as device:
            results.put(("held", os.getpid(), device))
    except gt.SimulatedOutOfMemory as error:
        results.put(("oom", os.getpid(), error))


def _hold_forever(size: str, held: Any) -> None:
    """Hold ``size`` and sleep until killed."""
    with gt.hold(size):
        held.set()
        time.sleep(PATIENCE_S)


def _hold_until_file(size: str, release: str) -> int:
    """Hold ``size`` until the file ``release`` exists (a loky task); returns the PID."""
    with gt.hold(size):
        deadline = time.monotonic() + PATIENCE_S
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
    return os.getpid()


def _hold_once(size: str) -> int:
    """Hold ``size`` briefly (a loky task); returns the PID."""
    with gt.hold(size):
        return os.getpid()


def _wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _state_of(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return text[text.rfind(")") + 2]


def card(total: str = "10GiB", **kwargs: Any) -> gt.SimulatedDevice:
    return gt.SimulatedDevice(total, **kwargs)


# -- real processes -----------------------------------------------------------------------


def test_spawned_children_share_a_card_and_only_the_overflowing_allocation_fails() -> None:
    """Two spawned children hold at once; a third overflows, in itself; freed bytes get reused."""
    context = 100 * MiB
    with gt.SimulatedHost([card("10GiB")], context="100MiB") as host:
        held = SPAWN.Barrier(3)
        release = SPAWN.Event()
        results = SPAWN.Queue()
        holders = [SPAWN.Process(target=_hold_until, args=("4GiB", held, release)) for _ in "ab"]
        for process in holders:
            process.start()
        held.wait(PATIENCE_S)
        assert host.used(0) == 8 * GiB + 2 * context

        overflowing = SPAWN.Process(target=_try_hold, args=("4GiB", results))
        overflowing.start()
        outcome, pid, error = results.get(timeout=PATIENCE_S)
        overflowing.join()
        assert (outcome, pid) == ("oom", overflowing.pid)
        assert isinstance(error, gt.SimulatedOutOfMemory)
        assert (error.device, error.requested_bytes, error.total_bytes) == (0, 4 * GiB, 10 * GiB)
        assert error.used_bytes == 8 * GiB + 3 * context  # its own context was created first
        [event] = host.out_of_memory_events
        assert (event.pid, event.device, event.requested_bytes) == (overflowing.pid, 0, 4 * GiB)
        assert not event.co_tenant

        release.set()
        for process in holders:
            process.join()
        assert host.used(0) == 0

        later = SPAWN.Process(target=_try_hold, args=("4GiB", results))
        later.start()
        assert results.get(timeout=PATIENCE_S) == ("held", later.pid, 0)
        later.join()

        assert host.device_peak(0) == 8 * GiB + 3 * context
        assert [host.process_peak(p.pid) for p in holders] == [4 * GiB + context] * 2
        assert host.process_peak(overflowing.pid) == context
        assert len(host.out_of_memory_events) == 1


def test_loky_workers_share_a_card_and_the_overflow_reaches_its_future(tmp_path: Path) -> None:
    """loky workers hold concurrently; the overflowing task's future gets SimulatedOutOfMemory."""
    release = str(tmp_path / "release")
    with gt.SimulatedHost([card("8GiB")], context=0) as host:
        executor = loky.ProcessPoolExecutor(max_workers=3)
        try:
            first = [executor.submit(_hold_until_file, "3GiB", release) for _ in range(2)]
            _wait_for(lambda: host.used(0) == 6 * GiB, "two loky workers to hold 3 GiB each")
            overflow = executor.submit(_hold_once, "3GiB")
            error = overflow.exception(timeout=PATIENCE_S)
            assert isinstance(error, gt.SimulatedOutOfMemory)
            assert error.requested_bytes == 3 * GiB
            assert re.search(r"out of memory", str(error))
            Path(release).touch()
            holders = {future.result(timeout=PATIENCE_S) for future in first}
            assert executor.submit(_hold_once, "3GiB").result(timeout=PATIENCE_S) > 0
        finally:
            executor.shutdown(wait=True)
        [event] = host.out_of_memory_events
        assert event.pid not in holders
        assert host.device_peak(0) == 6 * GiB


def test_a_sigkilled_child_releases_its_bytes_even_before_it_is_reaped() -> None:
    """SIGKILL frees a child's bytes and context, already while it is an unreaped zombie."""
    with gt.SimulatedHost([card("10GiB", co_tenants={"server": "1GiB"})]) as host:
        held = SPAWN.Event()
        child = SPAWN.Process(target=_hold_forever, args=("2GiB", held))
        child.start()
        assert held.wait(PATIENCE_S)
        assert host.used(0) == 3 * GiB + 300 * MiB
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        _wait_for(lambda: _state_of(child.pid) == "Z", "the killed child to become a zombie")
        assert host.used(0) == 1 * GiB
        child.join()
        assert host.used(0) == 1 * GiB
        assert host.process_peak(child.pid) == 2 * GiB + 300 * MiB


def test_pinned_children_hold_on_their_device_and_unpinned_on_device_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child with CUDA_VISIBLE_DEVICES=<uuid> holds on that device; one without, on device 0."""
    with gt.SimulatedHost([card("10GiB"), card("10GiB")], context=0) as host:
        results = SPAWN.Queue()
        unpinned = SPAWN.Process(target=_try_hold, args=("1GiB", results))
        unpinned.start()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", host.device_uuid(1))
        pinned = SPAWN.Process(target=_try_hold, args=("2GiB", results))
        pinned.start()
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        outcomes = {results.get(timeout=PATIENCE_S) for _ in range(2)}
        unpinned.join()
        pinned.join()
        assert outcomes == {("held", unpinned.pid, 0), ("held", pinned.pid, 1)}
        assert (host.device_peak(0), host.device_peak(1)) == (1 * GiB, 2 * GiB)
        assert host.process_peak(pinned.pid, device=1) == 2 * GiB
        assert host.process_peak(pinned.pid, device=0) == 0


DOCS = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def test_the_doc_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example in docs/testing.md runs: a spawn ProcessPoolExecutor on a card, no OOM."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [example] = [block for block in blocks if block.startswith("# test_embed.py")]
    module_name = f"gpupool_doc_example_{os.getpid()}"
    (tmp_path / f"{module_name}.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers import it by name too
    module = importlib.import_module(module_name)
    try:
        module.test_two_workers_fit_beside_the_inference_server()
    finally:
        sys.modules.pop(module_name, None)


def test_the_gpupool_doc_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GpuPoolExecutor example in docs/testing.md runs: width 1, then 2, no OOM."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [example] = [block for block in blocks if block.startswith("# test_mint.py")]
    module_name = f"gpupool_doc_mint_{os.getpid()}"
    (tmp_path / f"{module_name}.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(module_name)
    try:
        module.test_the_pool_never_widens_past_the_card()
    finally:
        sys.modules.pop(module_name, None)


# -- allocation in this process -----------------------------------------------------------


def test_hold_charges_a_context_once_and_keeps_it_until_the_process_dies() -> None:
    """The first hold charges the context; it stays after release; later holds do not repeat it."""
    with gt.SimulatedHost([card()], context="300MiB") as host:
        with gt.hold("1GiB") as device:
            assert device == 0
            assert host.used(0) == 1 * GiB + 300 * MiB
            with gt.hold("512MiB"):
                assert host.used(0) == 1536 * MiB + 300 * MiB
        assert host.used(0) == 300 * MiB
        with gt.hold(0):
            assert host.used(0) == 300 * MiB
        assert host.process_peak(os.getpid()) == 1536 * MiB + 300 * MiB


def test_a_zero_context_charges_nothing() -> None:
    """context=0 charges only the bytes held."""
    with gt.SimulatedHost([card()], context=0) as host:
        with gt.hold("1GiB"):
            assert host.used(0) == 1 * GiB
        assert host.used(0) == 0


def test_an_overflowing_hold_raises_charges_nothing_and_is_recorded() -> None:
    """A hold past the total raises SimulatedOutOfMemory with the figures; nothing is charged."""
    with gt.SimulatedHost([card("10GiB", co_tenants={"server": "4GiB"})], context=0) as host:
        with gt.hold("5GiB"):
            with pytest.raises(gt.SimulatedOutOfMemory) as caught, gt.hold("2GiB"):
                pytest.fail("the hold should not have been entered")
            assert host.used(0) == 9 * GiB
        error = caught.value
        assert isinstance(error, RuntimeError)
        assert str(error) == (
            "simulated device 0 out of memory: "
            "tried to allocate 2.00 GiB; 1.00 GiB free of 10.00 GiB"
        )
        assert (error.device, error.requested_bytes, error.used_bytes, error.total_bytes) == (
            0,
            2 * GiB,
            9 * GiB,
            10 * GiB,
        )
        [event] = host.out_of_memory_events
        assert event == gt.OutOfMemoryEvent(
            pid=os.getpid(),
            device=0,
            requested_bytes=2 * GiB,
            used_bytes=9 * GiB,
            total_bytes=10 * GiB,
            time_s=event.time_s,
        )
        assert host.device_peak(0) == 9 * GiB
        with gt.hold("6GiB"):  # the refused allocation left nothing behind
            pass


def test_a_context_that_does_not_fit_is_itself_the_refused_allocation() -> None:
    """On a card too full for a context, the first touch fails with the context's size."""
    with gt.SimulatedHost([card("1GiB", co_tenants={"server": "900MiB"})]) as host:
        with pytest.raises(gt.SimulatedOutOfMemory) as caught, gt.hold(0):
            pass
        assert caught.value.requested_bytes == 300 * MiB
        assert host.used(0) == 900 * MiB


def test_simulated_out_of_memory_pickles_intact() -> None:
    """SimulatedOutOfMemory survives pickling with its message and attributes."""
    error = gt.SimulatedOutOfMemory(
        device=1, requested_bytes=6 * GiB, used_bytes=40 * GiB, total_bytes=44 * GiB
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is gt.SimulatedOutOfMemory
    assert str(copy) == str(error)
    assert "out of memory" in str(copy)
    assert (copy.device, copy.requested_bytes, copy.used_bytes, copy.total_bytes) == (
        1,
        6 * GiB,
        40 * GiB,
        44 * GiB,
    )


def test_hold_outside_a_simulated_host_says_how_to_install_one() -> None:
    """hold() with no SimulatedHost raises a RuntimeError naming SimulatedHost."""
    assert SIMULATOR_ENV not in os.environ
    with (
        pytest.raises(RuntimeError, match=r"^no simulated host is installed .*SimulatedHost"),
        gt.hold("1GiB"),
    ):
        pass


def test_hold_follows_cuda_visible_devices_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A UUID or an index in CUDA_VISIBLE_DEVICES picks the device; an unknown one is refused."""
    with gt.SimulatedHost([card(), card()], context=0) as host:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", host.device_uuid(1))
        with gt.hold("1GiB") as device:
            assert device == 1
            assert (host.used(0), host.used(1)) == (0, 1 * GiB)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        with gt.hold("1GiB") as device:
            assert device == 1
        with gt.hold("1GiB", device=0) as device:
            assert device == 0
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(RuntimeError, match=r"^CUDA_VISIBLE_DEVICES='GPU-0+-"), gt.hold(1):
            pass


def test_holds_from_many_threads_stay_consistent() -> None:
    """Concurrent holds from threads of one process never lose or double an update."""
    with gt.SimulatedHost([card("100GiB")], context="1MiB") as host:

        def churn() -> None:
            for _ in range(100):
                with gt.hold("1MiB"):
                    pass

        threads = [threading.Thread(target=churn) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert host.used(0) == 1 * MiB
        assert 2 * MiB <= host.device_peak(0) <= 5 * MiB


# -- co-tenants ---------------------------------------------------------------------------


def test_co_tenants_grow_and_shrink_and_the_sensor_sees_them() -> None:
    """grow/shrink (and a negative grow) change the co-tenant rows and the card's free bytes."""
    with gt.SimulatedHost([card("10GiB", co_tenants={"server": "2GiB"})]) as host:
        sensor = host.sensor()
        [device] = sensor.read_devices()
        host.grow("server", "1GiB")
        host.grow("trainer", 3 * GiB)
        rows = sensor.read_processes(device)
        assert rows is not None
        assert {(row.name, row.used_bytes) for row in rows} == {
            ("server", 3 * GiB),
            ("trainer", 3 * GiB),
        }
        assert all(row.pid >= CO_TENANT_PID_BASE for row in rows)
        assert sensor.read_memory(device).free_bytes == 4 * GiB
        host.shrink("server", "2GiB")
        host.grow("trainer", "-1GiB")
        assert sensor.read_memory(device).free_bytes == 7 * GiB
        host.shrink("trainer", "2GiB")
        rows = sensor.read_processes(device)
        assert rows is not None
        assert [row.name for row in rows] == ["server"]  # at 0 bytes it left the card
        assert host.device_peak(0) == 6 * GiB
        with pytest.raises(ValueError, match="holds"):
            host.shrink("server", "2GiB")
        with pytest.raises(ValueError, match="no co-tenant named 'nobody'"):
            host.shrink("nobody", 1)


def test_a_co_tenant_outgrowing_its_card_raises_in_the_caller_and_is_recorded() -> None:
    """A grow past the total raises the simulated OOM, records a co-tenant event, adds nothing."""
    with gt.SimulatedHost([card("10GiB", co_tenants={"server": "8GiB"})]) as host:
        with pytest.raises(gt.SimulatedOutOfMemory, match="out of memory"):
            host.grow("server", "3GiB")
        assert host.used(0) == 8 * GiB
        [event] = host.out_of_memory_events
        assert event.co_tenant
        assert (event.requested_bytes, event.used_bytes) == (3 * GiB, 8 * GiB)


# -- the sensor's modes -------------------------------------------------------------------


def test_the_sensor_reads_a_discrete_card() -> None:
    """read_devices/read_memory/read_processes report the simulated card as NVML would."""
    with gt.SimulatedHost([card("44GiB", co_tenants={"server": "9GiB"})]) as host:
        sensor = default_sensor()
        assert isinstance(sensor, SimulatedSensor)
        assert sensor.name == "simulator"
        [device] = sensor.read_devices()
        assert (device.index, device.uuid, device.name) == (
            0,
            "GPU-51a1a7ed-0000-4000-8000-000000000000",
            "Simulated GPU",
        )
        with gt.hold("1GiB"):
            reading = sensor.read_memory(device)
            rows = sensor.read_processes(device)
            own = sensor.read_process_bytes(device, os.getpid())
        assert reading.total_bytes == 44 * GiB
        assert reading.used_bytes == 10 * GiB + 300 * MiB
        assert reading.free_bytes == reading.total_bytes - reading.used_bytes
        assert (reading.reserved_bytes, reading.unified, reading.source) == (
            None,
            False,
            "simulator",
        )
        assert rows is not None
        assert {row.pid for row in rows} == {CO_TENANT_PID_BASE, os.getpid()}
        assert own == 1 * GiB + 300 * MiB
        assert host.sensor().read_memory(device).used_bytes == 9 * GiB + 300 * MiB


def test_process_peak_window_resets_and_tracks_the_high_water() -> None:
    """read_process_peak_bytes is the exact high-water since reset_process_peak."""
    with gt.SimulatedHost([card()], context="100MiB") as host:
        sensor = host.sensor()
        [device] = sensor.read_devices()
        pid = os.getpid()
        assert sensor.read_process_peak_bytes(device, pid) == 0
        with gt.hold("2GiB"):
            pass
        assert sensor.read_process_peak_bytes(device, pid) == 2 * GiB + 100 * MiB
        sensor.reset_process_peak(device, pid)
        assert sensor.read_process_peak_bytes(device, pid) == 100 * MiB
        with gt.hold("1GiB"), gt.hold("512MiB"):
            pass
        assert sensor.read_process_peak_bytes(device, pid) == 1536 * MiB + 100 * MiB
        assert host.process_peak(pid) == 2 * GiB + 100 * MiB


def test_a_unified_device_reads_as_meminfo() -> None:
    """unified=True reports source "meminfo", unified, no reserved term, total as MemTotal."""
    with gt.SimulatedHost([card("128GiB", unified=True, co_tenants={"desktop": "8GiB"})]) as host:
        sensor = host.sensor()
        [device] = sensor.read_devices()
        reading = sensor.read_memory(device)
        assert (reading.source, reading.unified, reading.reserved_bytes) == ("meminfo", True, None)
        assert (reading.total_bytes, reading.free_bytes) == (128 * GiB, 120 * GiB)


def test_an_unreadable_device_raises_but_still_allocates() -> None:
    """readable=False makes read_memory raise DeviceUnreadableError; hold still works."""
    with gt.SimulatedHost([card(readable=False)], context=0) as host:
        sensor = host.sensor()
        [device] = sensor.read_devices()
        with pytest.raises(gpupool.DeviceUnreadableError, match="unreadable"):
            sensor.read_memory(device)
        assert sensor.read_processes(device) is None
        with gt.hold("1GiB"):
            assert host.used(0) == 1 * GiB


def test_no_driver_means_no_device() -> None:
    """driver=False makes the sensor raise NoDriverError and hold() refuse."""
    with gt.SimulatedHost([card()], driver=False) as host:
        with pytest.raises(gpupool.NoDriverError):
            host.sensor().read_devices()
        with pytest.raises(RuntimeError, match="no driver"), gt.hold("1GiB"):
            pass


def test_a_container_lists_only_co_tenant_rows() -> None:
    """container=True omits this host's processes from the rows, and, as a real card in a
    container, nothing answers a process's exact peak: the worker must sample."""
    with gt.SimulatedHost([card(co_tenants={"server": "1GiB"})], container=True) as host:
        sensor = host.sensor()
        [device] = sensor.read_devices()
        with gt.hold("1GiB"):
            rows = sensor.read_processes(device)
            assert rows is not None
            assert [row.name for row in rows] == ["server"]
            assert sensor.read_process_bytes(device, os.getpid()) is None
            assert sensor.read_memory(device).used_bytes == 2 * GiB + 300 * MiB
            assert sensor.read_process_peak_bytes(device, os.getpid()) is None
            assert sensor.start_tree_window(device, os.getpid()) is None
            assert sensor.read_tree_peak_bytes(device, os.getpid()) is None


@pytest.mark.parametrize(("rows", "figure"), [("zero", 0), ("unavailable", None)])
def test_rows_of_zero_and_without_a_figure_are_listed_as_such(
    rows: str, figure: int | None
) -> None:
    """rows='zero' lists this host's processes at 0 bytes (drivers 535.113 to 560 in a
    container), rows='unavailable' without a figure (a MIG instance); neither self-reports."""
    with gt.SimulatedHost([card(co_tenants={"server": "1GiB"})], rows=rows) as host:
        sensor = host.sensor()
        [device] = sensor.read_devices()
        with gt.hold("1GiB"):
            listed = {row.pid: row.used_bytes for row in sensor.read_processes(device) or ()}
            assert listed[os.getpid()] == figure
            assert sensor.read_process_peak_bytes(device, os.getpid()) is None
            assert sensor.read_memory(device).used_bytes == 2 * GiB + 300 * MiB


def test_a_rows_mode_is_checked() -> None:
    """An unknown rows mode, or one that contradicts container=True, is refused by name."""
    with pytest.raises(ValueError, match="rows='none' must be one of listed, hidden, zero"):
        gt.SimulatedHost([card()], rows="none")
    with pytest.raises(ValueError, match="container=True hides the rows"):
        gt.SimulatedHost([card()], container=True, rows="zero")


def test_host_cpus_and_ram_are_given_or_the_real_hosts() -> None:
    """cpus and host_ram are reported as given; None falls back to the real host's figures."""
    with gt.SimulatedHost([card()], cpus=16, host_ram="128GiB") as host:
        given = host.sensor().read_host()
    assert (given.cpus, given.available_ram_bytes) == (16, 128 * GiB)
    with gt.SimulatedHost([card()]) as host:
        real = host.sensor().read_host()
    assert real.cpus >= 1
    assert real.available_ram_bytes is None or real.available_ram_bytes > 0


# -- the block ----------------------------------------------------------------------------


def test_exit_restores_the_environment_and_removes_the_ledger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leaving the block removes the ledger directory and restores GPUPOOL_SIMULATOR."""
    monkeypatch.setenv(SIMULATOR_ENV, "/previous/ledger.json")
    with gt.SimulatedHost([card()]) as host:
        path = host.ledger_path
        assert os.environ[SIMULATOR_ENV] == path
        assert os.path.exists(path)
    assert os.environ[SIMULATOR_ENV] == "/previous/ledger.json"
    assert not os.path.exists(os.path.dirname(path))
    monkeypatch.delenv(SIMULATOR_ENV)
    with gt.SimulatedHost([card()]):
        pass
    assert SIMULATOR_ENV not in os.environ


def test_figures_stay_readable_after_the_block_and_the_host_cannot_change() -> None:
    """Peaks and events remain for assertions after exit; grow and re-entry are refused."""
    with gt.SimulatedHost([card("1GiB")], context=0) as host:
        with gt.hold("512MiB"):
            pass
        with pytest.raises(gt.SimulatedOutOfMemory):
            host.grow("x", "2GiB")
    assert host.device_peak(0) == 512 * MiB
    assert host.used(0) == 0
    assert len(host.out_of_memory_events) == 1
    with pytest.raises(RuntimeError, match="not entered"):
        host.grow("x", "1MiB")
    with pytest.raises(RuntimeError, match="has exited"):
        host.__enter__()


def test_two_hosts_in_sequence_share_nothing() -> None:
    """A second host starts clean: no processes, peaks or events of the first."""
    with gt.SimulatedHost([card("4GiB")]) as first:
        first_ledger = first.ledger_path
        with gt.hold("1GiB"):
            pass
        with pytest.raises(gt.SimulatedOutOfMemory), gt.hold("8GiB"):
            pass
    with gt.SimulatedHost([card("4GiB")]) as second:
        assert second.ledger_path != first_ledger
        sensor = second.sensor()
        [device] = sensor.read_devices()
        assert sensor.read_processes(device) == ()
        assert second.used(0) == 0
        assert second.device_peak(0) == 0
        assert second.out_of_memory_events == []
    assert first.device_peak(0) == 1 * GiB + 300 * MiB


def test_sizes_and_options_are_validated() -> None:
    """Bad sizes raise InvalidSizeError; bad cpus or devices raise ValueError."""
    with pytest.raises(gpupool.InvalidSizeError):
        gt.SimulatedDevice("lots")
    with pytest.raises(gpupool.InvalidSizeError):
        gt.SimulatedHost([card()], context="-1GiB")
    with pytest.raises(ValueError, match="cpus"):
        gt.SimulatedHost([card()], cpus=0)
    with pytest.raises(ValueError, match="SimulatedDevice"):
        gt.SimulatedHost(["10GiB"])  # type: ignore[list-item]
    with pytest.raises(gpupool.InvalidSizeError):
        gt.hold("-1GiB")


# -- the public surface -------------------------------------------------------------------


def test_public_names_are_sorted_and_exported() -> None:
    """gpupool.testing's __all__ is sorted and every name in it exists."""
    assert gt.__all__ == sorted(gt.__all__)
    assert all(hasattr(gt, name) for name in gt.__all__)


def test_import_gpupool_does_not_import_the_testing_module() -> None:
    """A fresh `import gpupool` leaves gpupool.testing and the simulator unimported."""
    code = (
        "import sys, gpupool; "
        "print(sorted(m for m in sys.modules if m in "
        "('gpupool.testing', 'gpupool._sensors.simulated')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_census_command_prints_the_simulated_devices_and_their_co_tenants(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gpupool census --json` inside a SimulatedHost reads the simulated cards and co-tenants."""
    from gpupool._commands.cli import main

    devices = [card("44GiB", co_tenants={"server": "9GiB", "trainer": "1GiB"}), card("8GiB")]
    with gt.SimulatedHost(devices, cpus=16, host_ram="128GiB") as host:
        assert main(["census", "--json"]) == 0
        sensor = host.sensor()
        rows = sensor.read_processes(sensor.read_devices()[0])
    assert rows is not None
    pid_of = {row.name: row.pid for row in rows}
    census = json.loads(capsys.readouterr().out)
    assert census["sensor"] == "simulator"
    assert [d["uuid"] for d in census["devices"]] == [host.device_uuid(0), host.device_uuid(1)]
    assert {d["name"] for d in census["devices"]} == {"Simulated GPU"}
    first, second = census["devices"]
    assert (first["total_bytes"], first["co_tenant_bytes"]) == (44 * GiB, 10 * GiB)
    assert {(p["pid"], p["used_bytes"]) for p in first["processes"]} == {
        (pid_of["server"], 9 * GiB),
        (pid_of["trainer"], 1 * GiB),
    }
    assert (second["total_bytes"], second["co_tenant_bytes"], second["processes"]) == (
        8 * GiB,
        0,
        [],
    )
    assert (census["host"]["cpus"], census["host"]["available_ram_bytes"]) == (16, 128 * GiB)


def test_a_ledger_left_open_after_the_block_reads_as_gone() -> None:
    """After exit, a sensor or a ledger still held open raises SensorError, never stale figures."""
    with gt.SimulatedHost([card()]) as host:
        sensor = host.sensor()
        held_open = Ledger(host.ledger_path)
        held_open.snapshot()
    with pytest.raises(gpupool.SensorError, match="is gone"):
        held_open.snapshot()
    with pytest.raises(gpupool.SensorError, match="is gone"):
        sensor.read_devices()
    held_open.close()


def test_forked_children_lose_no_ledger_update() -> None:
    """A child forked after the parent opened the ledger gets its own lock: no update is lost."""
    children, each = 3, 100
    with gt.SimulatedHost([gt.SimulatedDevice("80GiB", co_tenants={"t": 0})]) as host:
        host.grow("t", 1)  # the parent opens (and caches) the ledger before forking
        pids = []
        for _ in range(children):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    for _ in range(each):
                        host.grow("t", 1)
                finally:
                    os._exit(0)
            pids.append(pid)
        for _ in range(each):
            host.grow("t", 1)
        for pid in pids:
            os.waitpid(pid, 0)
        [(name, size)] = host._state()["devices"][0]["tenants"].items()
    assert (name, size[1]) == ("t", 1 + (children + 1) * each)


def test_hosts_exited_out_of_order_leave_no_stale_variable() -> None:
    """Entering A then B and exiting A first never leaves the variable naming a gone ledger."""
    saved = os.environ.get(SIMULATOR_ENV)
    a = gt.SimulatedHost([card()])
    b = gt.SimulatedHost([card()])
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert os.environ.get(SIMULATOR_ENV) == b.ledger_path
    path_b = b.ledger_path
    b.__exit__(None, None, None)
    assert os.environ.get(SIMULATOR_ENV) != path_b
    assert os.environ.get(SIMULATOR_ENV) == saved


def test_a_mig_instance_is_named_so_and_lists_rows_without_a_figure() -> None:
    """SimulatedDevice(mig=True) is a MIG instance to the sensor, and its rows have no figure
    (NVML's "not available") on a host whose other cards list theirs."""
    with gt.SimulatedHost([card(), gt.SimulatedDevice("10GiB", mig=True)]) as host:
        sensor = host.sensor()
        plain, instance = sensor.read_devices()
        assert (plain.mig, instance.mig, instance.mig_index) == (False, True, 0)
        with gt.hold("1GiB", device=1):
            listed = {row.pid: row.used_bytes for row in sensor.read_processes(instance) or ()}
            assert listed == {os.getpid(): None}
            assert sensor.read_process_peak_bytes(instance, os.getpid()) is None


_A_FORK_LEAVES_THE_HOST = """
import os
import sys

from gpupool.testing import SimulatedDevice, SimulatedHost, hold

with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB") as host:
    ledger = os.environ["GPUPOOL_SIMULATOR"]
    pid = os.fork()
    if pid == 0:
        try:
            host.__exit__(None, None, None)  # as a child unwinding through the block does
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print("ledger kept:", os.path.exists(ledger), flush=True)
    with hold("1GiB"):
        print("still a card", flush=True)
print("removed at the end:", not os.path.exists(ledger), flush=True)
"""


def test_a_forked_child_leaving_the_block_leaves_the_host_to_its_parent(tmp_path: Path) -> None:
    """The host is the process's that entered the block: a forked child that leaves it
    removes nothing, and the parent's card goes on; the parent's exit removes the ledger."""
    script = tmp_path / "script.py"
    script.write_text(_A_FORK_LEAVES_THE_HOST)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "ledger kept: True",
        "still a card",
        "removed at the end: True",
    ], done.stderr
