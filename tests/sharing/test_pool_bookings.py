"""Pools publish their bookings to the host's table; the simulated host keeps its own table."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gpupool.testing as gt
from gpupool import ConfigurationError, GpuPoolExecutor
from gpupool._commands.cli import main
from gpupool._core.units import GiB, MiB, format_size
from gpupool._sensors.bookings import BookingTable, default_bookings_directory

CHILD = str(Path(__file__).with_name("booking_child.py"))
#: A safety net so that a broken test fails instead of hanging; never asserted on.
PATIENCE_S = 120.0


def _rows_seen_by_the_task(
    size: str,
) -> tuple[int, list[tuple[int, list[tuple[int, int, int]]]]]:
    """Run in a worker: hold ``size`` and read the simulated host's table from inside the task."""
    from gpupool._sensors.select import default_sensor

    sensor = default_sensor()
    table = BookingTable(sensor.bookings_directory)  # type: ignore[attr-defined]
    with gt.hold(size):
        seen = table.others(os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen is not None
    rows = [
        (p.pid, [(t.worker_pid, t.booked_bytes, t.reached_bytes) for t in p.tasks])
        for p in seen.pools
    ]
    return os.getpid(), rows


def _start_child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _close(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    process.wait(timeout=60)
    process.stdout.close()


def test_processes_under_one_simulated_host_share_its_table_and_no_other() -> None:
    """Two scripts in one SimulatedHost see each other's rows; another host's table is apart."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        directory = host.bookings_directory
        children = [_start_child("simulated", f"script.{n}") for n in range(2)]
        try:
            lines = [c.stdout.readline().split() for c in children]  # type: ignore[union-attr]
            assert lines == [["ready", host.bookings_directory]] * 2
            seen = BookingTable(host.bookings_directory).others(host.device_uuid(0))
            assert seen is not None
            assert sorted(p.pid for p in seen.pools) == sorted(c.pid for c in children)
            assert seen.booked_bytes == 2 * 1234
            with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as other:
                assert other.bookings_directory != host.bookings_directory
                apart = BookingTable(other.bookings_directory).others(other.device_uuid(0))
                assert apart is not None
                assert apart.pools == ()
        finally:
            for child in children:
                _close(child)
    assert not os.path.exists(directory)  # the table went with its host


def test_a_pool_books_each_task_before_it_runs_and_withdraws_at_shutdown() -> None:
    """While a task runs its worker is booked at its ask; after shutdown the pool's row is gone."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB") as pool:
            worker_pid, rows = pool.submit(_rows_seen_by_the_task, "1GiB").result()
        assert rows == [(os.getpid(), [(worker_pid, 2 * GiB, 0)])]  # no other pool: reach not read
        after = BookingTable(host.bookings_directory).others(host.device_uuid(0))
        assert after is not None
        assert after.pools == ()


def _hold_until_released(size: str, directory: str) -> None:
    """Run in a worker: hold ``size``, say so with a file, keep it until the test's file appears."""
    with gt.hold(size):
        Path(directory, "held").touch()
        deadline = time.monotonic() + PATIENCE_S
        while not Path(directory, "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists()


def test_a_finished_task_is_unbooked_before_its_result_is_given() -> None:
    """When a future has its result, the task's booking is already gone from the table."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        table = BookingTable(host.bookings_directory)
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB") as pool:
            assert pool.submit(abs, -4).result() == 4
            seen = table.others(host.device_uuid(0))
            assert seen is not None
            assert [(p.pid, p.tasks) for p in seen.pools] == [(os.getpid(), ())]


def _hold_and_return(size: str) -> int:
    """Run in a worker: hold ``size`` a moment; return the worker's PID."""
    with gt.hold(size):
        return os.getpid()


def test_a_booking_that_grew_with_its_keys_price_is_written_before_the_result(
    tmp_path: Path,
) -> None:
    """A measurement that raises a key's price books its running tasks higher: when the
    measured task's future has its result, the table shows the running one's new booking."""
    directory = str(tmp_path)
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        table = BookingTable(host.bookings_directory)
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as pool:
            tasks = pool.options(key="grows")
            first = tasks.submit(_hold_until_released, "512MiB", directory)
            _wait_for(Path(directory, "held"))
            measured_pid = tasks.submit(_hold_and_return, "6GiB").result()
            seen = table.others(host.device_uuid(0))
            Path(directory, "release").touch()
            first.result()
    assert seen is not None
    (row,) = seen.pools
    (booking,) = [t for t in row.tasks if t.worker_pid != measured_pid]
    assert booking.booked_bytes >= 6 * GiB  # was 1 GiB (the estimate) when it started


def _hold_then_raise(size: str) -> None:
    """Run in a worker: hold ``size`` a moment, then raise, naming the worker's card."""
    with gt.hold(size):
        pass
    raise ValueError(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_a_booking_that_grew_on_another_card_is_written_before_the_failure(
    tmp_path: Path,
) -> None:
    """A task that raised after holding more than its key's ask raises the key's price and
    books the key's task running on the other card higher: when the failure is given, the
    other card's table shows that task's new booking."""
    directory = str(tmp_path)
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB"), gt.SimulatedDevice("40GiB")]) as host:
        table = BookingTable(host.bookings_directory)
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as pool:
            tasks = pool.options(key="grows")
            first = tasks.submit(_hold_until_released, "512MiB", directory)
            _wait_for(Path(directory, "held"))
            with pytest.raises(ValueError, match=r".") as raised:
                tasks.submit(_hold_then_raise, "6GiB").result()
            failed_on = str(raised.value)
            (other,) = [i for i in range(2) if host.device_uuid(i) != failed_on]
            seen = table.others(host.device_uuid(other))
            Path(directory, "release").touch()
            first.result()
    assert seen is not None
    assert len(seen.pools) == 1, "the running task is on the failed task's card"
    (booking,) = seen.pools[0].tasks
    assert booking.booked_bytes >= 6 * GiB  # was 1 GiB (the estimate) when it started


def test_what_a_task_holds_is_published_while_another_pool_is_on_the_card(
    tmp_path: Path,
) -> None:
    """With another pool's row on the card, a start publishes what the running workers hold."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")], context="300MiB"):
        other = _start_child("simulated", "other.1")
        try:
            assert other.stdout is not None
            assert other.stdout.readline().startswith("ready")
            with GpuPoolExecutor(max_workers=2, task_peak="2GiB") as pool:
                first = pool.submit(_hold_until_released, "1GiB", str(tmp_path))
                _wait_for(tmp_path / "held")
                worker_pid, rows = pool.submit(_rows_seen_by_the_task, "1MiB").result()
                (tmp_path / "release").touch()
                first.result()
            mine = dict(rows)[os.getpid()]
            # Written at the second task's start: the first task's worker held 1 GiB and
            # its 300 MiB context; the second task's worker had not touched the card yet.
            by_worker = {pid: (booked, reached) for pid, booked, reached in mine}
            assert by_worker.pop(worker_pid) == (2 * GiB, 0)
            assert list(by_worker.values()) == [(2 * GiB, GiB + 300 * MiB)]
        finally:
            _close(other)


def test_share_bookings_false_writes_no_table() -> None:
    """With sharing off the pool neither writes nor creates the table."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB", share_bookings=False) as pool:
            assert pool.submit(int, 7).result() == 7
        assert not os.path.exists(host.bookings_directory)


def test_an_explicit_bookings_dir_is_used(tmp_path: Path) -> None:
    """`bookings_dir=` puts the pool's table where it says, even inside a simulated host."""
    directory = tmp_path / "mine"
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB", bookings_dir=directory) as pool:
            _pid, rows = pool.submit(_rows_seen_by_the_task, "1GiB").result()
        assert rows == []  # the task read the host's own table, which the pool did not use
        assert (directory / f"{host.device_uuid(0)}.json").exists()


def test_a_pool_whose_table_is_unreachable_runs_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unreachable table costs nothing but one warning: every task still runs."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        with caplog.at_level(logging.WARNING, logger="gpupool"):
            with GpuPoolExecutor(
                max_workers=2, task_peak="2GiB", bookings_dir=blocker / "x"
            ) as pool:
                assert list(pool.map(abs, range(-6, 0))) == [6, 5, 4, 3, 2, 1]
    said = [r for r in caplog.records if "booking table" in r.getMessage()]
    assert len(said) == 1
    assert str(blocker / "x") in said[0].getMessage()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"share_bookings": "yes"}, r"^share_bookings='yes': pass True"),
        ({"share_bookings": 1}, r"^share_bookings=1: pass True"),
        ({"bookings_dir": ""}, r"^bookings_dir='': pass a directory path"),
        ({"bookings_dir": 3}, r"^bookings_dir=3: pass a directory path"),
    ],
)
def test_sharing_options_are_validated(options: dict[str, Any], message: str) -> None:
    """A wrong share_bookings or bookings_dir is a ConfigurationError naming the value."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        with pytest.raises(ConfigurationError, match=message):
            GpuPoolExecutor(max_workers=1, **options)


_KILLED_POOL = """
import sys, time
import gpupool.testing as gt
from gpupool import GpuPoolExecutor

def task(i):
    with gt.hold("2GiB"):
        time.sleep(600)

pool = GpuPoolExecutor(max_workers=2, task_peak="3GiB")
futures = [pool.submit(task, i) for i in range(2)]
print("submitted", flush=True)
sys.stdin.read()
"""


def test_a_sigkilled_pool_stops_counting_at_the_next_read() -> None:
    """A pool killed mid-run (SIGKILL, no shutdown) leaves no booking once its process is gone."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        table = BookingTable(host.bookings_directory)
        uuid = host.device_uuid(0)
        script = subprocess.Popen(
            [sys.executable, "-c", _KILLED_POOL],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        workers: list[int] = []
        try:
            assert script.stdout is not None
            assert script.stdout.readline().strip() == "submitted"
            deadline = time.monotonic() + PATIENCE_S
            while time.monotonic() < deadline:  # both tasks booked (the pool's own pace)
                seen = table.others(uuid)
                assert seen is not None
                if seen.tasks == 2:
                    break
                time.sleep(0.02)
            assert [(p.pid, p.booked_bytes) for p in seen.pools] == [(script.pid, 6 * GiB)]
            workers = [t.worker_pid for t in seen.pools[0].tasks]
            script.send_signal(signal.SIGKILL)
            script.wait(timeout=60)
            after = table.others(uuid)
            assert after is not None
            assert after.pools == ()
        finally:
            if script.poll() is None:
                script.kill()
                script.wait(timeout=60)
            for pid in workers:  # orphaned by the kill: they would sleep on
                assert pid > 0  # never kill(0) or kill(-1): this test's own group, or all
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for stream in (script.stdin, script.stdout):
                if stream is not None:
                    stream.close()


# -- gpupool census ------------------------------------------------------------------------


def test_census_lists_the_pools_booked_on_each_card(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpupool census` (text and --json) shows every live pool on a card with its bookings."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        child = _start_child("simulated", "script.1")
        try:
            assert child.stdout is not None
            assert child.stdout.readline().startswith("ready")
            capsys.readouterr()
            assert main(["census", "--json"]) == 0
            device = json.loads(capsys.readouterr().out)["devices"][0]
            assert device["bookings_table"] == host.bookings_directory
            assert device["sources"]["pools"] == f"booking table in {host.bookings_directory}"
            (pool,) = device["pools"]
            assert pool["pool_id"] == "script.1"
            assert pool["pid"] == child.pid
            assert pool["label"] == "booking_child.py"
            assert (pool["booked_bytes"], pool["reached_bytes"], pool["unreached_bytes"]) == (
                1234,
                0,
                1234,
            )
            assert pool["tasks"] == [
                {"worker_pid": child.pid, "key": "child", "booked_bytes": 1234, "reached_bytes": 0}
            ]
            assert main(["census"]) == 0
            text = capsys.readouterr().out
            assert f"  pools            1 pool, {format_size(1234)} booked, 0 B reached (" in text
            assert f"    pool script.1     pid {child.pid:<8} booking_child.py" in text
        finally:
            _close(child)
        assert main(["census"]) == 0
        assert "  pools            none booked (booking table in" in capsys.readouterr().out


def test_census_says_when_the_bookings_are_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    """Where the table cannot be reached, the census says the pools are unknown, and why."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        Path(host.bookings_directory).write_text("")  # a file where the directory would be
        assert main(["census", "--json"]) == 0
        device = json.loads(capsys.readouterr().out)["devices"][0]
        assert device["pools"] is None
        assert device["sources"]["pools"].startswith("unknown: the booking table path")
        assert main(["census"]) == 0
        assert "  pools            unknown: the booking table path" in capsys.readouterr().out


def test_the_default_table_is_not_touched_by_simulated_pools() -> None:
    """Simulated cards never reach the real host's table (their UUIDs are shared by every test)."""
    default = default_bookings_directory()
    sim_uuid = "GPU-51a1a7ed-0000-4000-8000-000000000000"
    before = (default / f"{sim_uuid}.json").exists()
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as pool:
            assert pool.submit(int, 3).result() == 3
    assert (default / f"{sim_uuid}.json").exists() == before
