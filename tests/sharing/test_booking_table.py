"""The host-wide booking table: rows per pool, pruned when their process dies, flock'd, private."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpupool.testing as gt
from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking, format_booking_table
from gpupool._core.units import GiB
from gpupool._sensors.base import Sensor
from gpupool._sensors.bookings import (
    BOOKINGS_ENV,
    BookingTable,
    default_bookings_directory,
    open_booking_table,
    read_start_token,
)

CHILD = str(Path(__file__).with_name("booking_child.py"))
UUID = "GPU-00000000-1111-2222-3333-444444444444"


def _task(booked: int, reached: int = 0, pid: int | None = None) -> TaskBooking:
    return TaskBooking(
        worker_pid=os.getpid() if pid is None else pid,
        key="k",
        booked_bytes=booked,
        reached_bytes=reached,
    )


class Child:
    """A real process running booking_child.py; it keeps its rows alive until closed."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.line = self.process.stdout.readline().strip()

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        if child.process.poll() is None:
            child.kill()
        for stream in (child.process.stdin, child.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def table(tmp_path: Path) -> BookingTable:
    return BookingTable(tmp_path / "bookings")


# -- rows and sums ---------------------------------------------------------------------------


def test_others_sums_the_other_pools_rows_only(table: BookingTable) -> None:
    """`others` sums booked, reached and max(0, booked - reached) over every pool but the caller."""
    assert table.publish(UUID, "a.1", [_task(6 * GiB, 2 * GiB), _task(GiB, 3 * GiB)])
    assert table.publish(UUID, "b.1", [_task(4 * GiB, 0)])
    seen = table.others(UUID, "b.1")
    assert seen is not None
    assert [pool.pool_id for pool in seen.pools] == ["a.1"]
    assert seen.booked_bytes == 7 * GiB
    assert seen.reached_bytes == 5 * GiB
    assert seen.unreached_bytes == 4 * GiB  # 6-2, and 0 (not -2) for the task past its booking
    everyone = table.others(UUID)
    assert everyone is not None
    assert sorted(pool.pool_id for pool in everyone.pools) == ["a.1", "b.1"]
    assert everyone.booked_bytes == 11 * GiB


def test_publish_replaces_and_withdraw_removes_a_pools_row(table: BookingTable) -> None:
    """A pool has one row per card: publishing replaces it, withdrawing removes it."""
    table.publish(UUID, "a.1", [_task(GiB), _task(GiB)])
    table.publish(UUID, "a.1", [_task(3 * GiB)])
    seen = table.others(UUID, "z.9")
    assert seen is not None
    assert seen.booked_bytes == 3 * GiB
    assert len(seen.pools) == 1
    assert table.withdraw(UUID, "a.1")
    assert table.others(UUID) == type(seen)(card_uuid=UUID, pools=())


def test_cards_have_separate_tables(table: BookingTable) -> None:
    """A booking on one card does not count on another."""
    table.publish(UUID, "a.1", [_task(GiB)])
    other_card = "MIG-GPU-aaaa/1/0"  # old-style MIG names hold slashes
    assert table.others(other_card) is not None
    assert table.others(other_card).booked_bytes == 0  # type: ignore[union-attr]
    table.publish(other_card, "a.1", [_task(5 * GiB)])
    assert sorted(p.name for p in table.directory.iterdir()) == [
        f"{UUID}.json",
        "MIG-GPU-aaaa_1_0.json",
    ]
    assert table.others(UUID).booked_bytes == GiB  # type: ignore[union-attr]
    assert table.others(other_card).booked_bytes == 5 * GiB  # type: ignore[union-attr]


def test_unreached_given_takes_each_workers_live_reading() -> None:
    """A reader's own per-process reading overrides a task's published reach."""
    row = PoolBooking(
        pool_id="a.1",
        pid=100,
        start="s",
        label="x",
        updated_s=1.0,
        tasks=(_task(6 * GiB, 0, pid=101), _task(6 * GiB, GiB, pid=102)),
    )
    seen = OtherPools(card_uuid=UUID, pools=(row,))
    assert seen.unreached_bytes == 11 * GiB
    assert seen.unreached_given({101: 5 * GiB}) == 6 * GiB  # 1 + 5: 102 keeps its published reach
    assert seen.unreached_given({101: None, 102: 7 * GiB}) == 6 * GiB  # None: no reading


# -- dead processes --------------------------------------------------------------------------


def test_a_row_of_an_exited_process_is_pruned_on_the_next_read(
    table: BookingTable, children: list[Child]
) -> None:
    """A pool whose process exited stops counting at the next read by anyone."""
    child = Child("publish", str(table.directory), UUID, "child.1", str(5 * GiB))
    children.append(child)
    assert child.line == "ready"
    seen = table.others(UUID, "me")
    assert seen is not None
    assert [(pool.pid, pool.booked_bytes) for pool in seen.pools] == [(child.pid, 5 * GiB)]
    assert child.close() == 0
    assert table.others(UUID, "me").pools == ()  # type: ignore[union-attr]


def test_a_sigkilled_writers_row_is_gone_and_the_file_still_reads(
    table: BookingTable, children: list[Child]
) -> None:
    """A writer SIGKILLed in the middle of its writes leaves a readable table, without its row."""
    table.publish(UUID, "mine.1", [_task(GiB)])
    child = Child("spin", str(table.directory), UUID, "spin.1")
    children.append(child)
    assert child.line == "ready"
    during = table.others(UUID, "mine.1")
    assert during is not None
    assert [pool.pid for pool in during.pools] == [child.pid]
    child.kill()
    after = table.others(UUID)
    assert after is not None
    assert [pool.pool_id for pool in after.pools] == ["mine.1"]  # ours kept, the dead one gone
    assert table.unavailable_reason is None


def test_a_zombie_counts_as_dead(table: BookingTable, children: list[Child]) -> None:
    """An exited process not yet reaped (a zombie) holds nothing on the card: its row is pruned."""
    child = Child("publish", str(table.directory), UUID, "z.1", str(GiB))
    children.append(child)
    assert child.process.stdin is not None
    child.process.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    assert Path(f"/proc/{child.pid}").exists()
    assert table.others(UUID).pools == ()  # type: ignore[union-attr]


def test_a_reused_pid_is_told_apart_by_its_start_time(table: BookingTable) -> None:
    """A row whose PID now names another process (another start time) is pruned."""
    token = read_start_token(os.getpid())
    assert token is not None
    rows = [
        PoolBooking(
            pool_id=f"{os.getpid()}.{n}",
            pid=os.getpid(),
            start=start,
            label="x",
            updated_s=time.time(),
            tasks=(_task(GiB),),
        )
        for n, start in ((1, token), (2, str(int(token) + 1)))
    ]
    table.directory.mkdir(mode=0o700)
    path = table.directory / f"{UUID}.json"
    path.write_bytes(format_booking_table(UUID, rows))
    path.chmod(0o600)
    seen = table.others(UUID)
    assert seen is not None
    assert [pool.pool_id for pool in seen.pools] == [f"{os.getpid()}.1"]
    assert f"{os.getpid()}.2" not in path.read_text()  # the prune was written back


# -- concurrent writers ----------------------------------------------------------------------


def test_concurrent_writers_lose_no_update(table: BookingTable, children: list[Child]) -> None:
    """Four processes each exchanging 300 times under the flock: every final row is there, exact."""
    count = 300
    writers = [Child("hammer", str(table.directory), UUID, f"w.{n}", str(count)) for n in range(4)]
    children.extend(writers)
    assert [w.line for w in writers] == ["done"] * 4
    seen = table.others(UUID)
    assert seen is not None
    rows = {pool.pool_id: pool for pool in seen.pools}
    assert sorted(rows) == [f"w.{n}" for n in range(4)]
    assert all(rows[f"w.{n}"].pid == writers[n].pid for n in range(4))
    assert all(pool.booked_bytes == count for pool in rows.values())


# -- permissions and where it lives ----------------------------------------------------------


def test_a_private_table_is_0600_in_a_0700_directory(table: BookingTable) -> None:
    """By default the table is private to the user: directory 0700, files 0600."""
    table.publish(UUID, "a.1", [_task(GiB)])
    assert stat.S_IMODE(table.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((table.directory / f"{UUID}.json").stat().st_mode) == 0o600


def test_a_shared_table_gives_each_user_a_file_only_that_user_writes(tmp_path: Path) -> None:
    """`shared=True` makes the directory 1777 (sticky) whatever the umask; each user writes
    its own file per card (0644: read by every user) and locks a file only it can open."""
    shared = BookingTable(tmp_path / "shared", shared=True)
    old = os.umask(0o022)
    try:
        assert shared.publish(UUID, "a.1", [_task(GiB)])
    finally:
        os.umask(old)
    assert stat.S_IMODE(shared.directory.stat().st_mode) == 0o1777
    uid = os.geteuid()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in shared.directory.iterdir()}
    assert modes == {f"{UUID}.uid{uid}.json": 0o644, f"{UUID}.uid{uid}.lock": 0o600}


def test_a_private_table_refuses_a_directory_others_can_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A private table in a directory that others can write is not used (rows could be planted)."""
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    table = BookingTable(directory)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        assert table.others(UUID) is None
    assert table.unavailable_reason is not None
    assert "not private to this user" in table.unavailable_reason
    assert not any(directory.iterdir())


def test_default_directory_is_under_dev_shm_per_user() -> None:
    """Unless told, the table lives in /dev/shm/gpupool-<uid> (/dev/shm/gpupool when shared)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("this host has no /dev/shm")
    assert default_bookings_directory() == Path(f"/dev/shm/gpupool-{os.geteuid()}")
    assert default_bookings_directory(shared=True) == Path("/dev/shm/gpupool")


def test_without_dev_shm_the_table_goes_to_the_users_runtime_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is no /dev/shm, a private table lives in $XDG_RUNTIME_DIR/gpupool."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    missing = tmp_path / "no-shm"
    assert default_bookings_directory(shm=missing) == tmp_path / "gpupool"
    assert default_bookings_directory(shm=missing, shared=True) == missing / "gpupool"


def test_a_private_table_refuses_a_file_others_can_read(
    table: BookingTable, caplog: pytest.LogCaptureFixture
) -> None:
    """A table file that other users can read or write is not used by a private table."""
    table.directory.mkdir(mode=0o700)
    path = table.directory / f"{UUID}.json"
    path.write_bytes(b"")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        assert table.publish(UUID, "a.1", [_task(GiB)]) is False
    assert table.unavailable_reason is not None
    assert "is not private to this user" in table.unavailable_reason
    assert path.read_bytes() == b""


def test_where_a_pools_table_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory given wins; then GPUPOOL_BOOKINGS; then the default; False: no table."""
    sensor = Sensor()
    monkeypatch.setenv(BOOKINGS_ENV, str(tmp_path / "env"))
    given = open_booking_table(share=True, directory=tmp_path / "given", sensor=sensor)
    assert given is not None
    assert given.directory == tmp_path / "given"
    from_env = open_booking_table(share="host", directory=None, sensor=sensor)
    assert from_env is not None
    assert (from_env.directory, from_env.shared) == (tmp_path / "env", True)
    monkeypatch.delenv(BOOKINGS_ENV)
    default = open_booking_table(share=True, directory=None, sensor=sensor)
    assert default is not None
    assert default.directory == default_bookings_directory()
    assert open_booking_table(share=False, directory=tmp_path, sensor=sensor) is None


def test_inside_a_simulated_host_any_sensor_books_in_the_hosts_table() -> None:
    """A sensor that wraps the simulator's still books in the simulated host's own table."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        table = open_booking_table(share=True, directory=None, sensor=Sensor())
        assert table is not None
        assert str(table.directory) == host.bookings_directory


# -- unreachable: said once, never raised ------------------------------------------------------


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_an_unreachable_table_answers_unknown_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Where the directory cannot be made, every call answers None/False; one warning says why."""
    if where == "under a file":
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        directory = blocker / "bookings"
    else:
        directory = Path("/proc/gpupool-cannot-be-here") / str(os.getpid())
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        for table in (BookingTable(directory), BookingTable(directory)):
            assert table.publish(UUID, "a.1", [_task(GiB)]) is False
            assert table.others(UUID, "a.1") is None
            assert table.exchange(UUID, "a.1", []) is None
            assert table.withdraw(UUID, "a.1") is False
    warnings = [r for r in caplog.records if r.name == "gpupool"]
    assert len(warnings) == 1
    assert str(directory) in warnings[0].getMessage()
    assert "share_bookings=False" in warnings[0].getMessage()


def test_a_damaged_table_file_is_started_afresh(
    table: BookingTable, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that does not parse (another version, damage) is said once and rewritten."""
    table.directory.mkdir(mode=0o700)
    path = table.directory / f"{UUID}.json"
    path.write_bytes(b'{"version": 99}')
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        assert table.others(UUID) is not None
        assert table.publish(UUID, "a.1", [_task(GiB)])
        assert table.others(UUID).booked_bytes == GiB  # type: ignore[union-attr]
    assert ["version 99" in r.getMessage() for r in caplog.records] == [True]
