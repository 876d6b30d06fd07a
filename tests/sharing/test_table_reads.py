"""Reading the booking table again: what is reused while the file's text is unchanged, and
what is never reused (the file's text itself, each row's process and stamp, the card total).

Real files and real processes; rows are written with ``format_booking_table`` where a test
needs text of an exact length.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool._core.bookings import PoolBooking, TaskBooking, format_booking_table
from gpupool._core.units import GiB
from gpupool._sensors.booking_rows import FUTURE_SLACK_S, STALE_AFTER_S, RowChecks
from gpupool._sensors.bookings import BookingTable, read_start_token

UUID = "GPU-00000000-1111-2222-3333-444444444444"
TOTAL_BYTES = 80 * GiB


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this user (another pool's process, as far as the table can tell)."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=60)
    assert process.stdin is not None
    process.stdin.close()


def _row(pid: int, pool_id: str, booked: int, stamp_s: float) -> PoolBooking:
    start = read_start_token(pid)
    assert start is not None
    return PoolBooking(
        pool_id=pool_id,
        pid=pid,
        start=start,
        label="reads",
        updated_s=stamp_s,
        tasks=(TaskBooking(worker_pid=pid, key="k", booked_bytes=booked, reached_bytes=0),),
    )


def _write(path: Path, rows: list[PoolBooking]) -> bytes:
    """Write the card's file as another pool would (in place), and return its text."""
    data = format_booking_table(UUID, rows)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
    return data


def test_a_row_rewritten_to_text_of_the_same_length_and_time_is_read_anew(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """Another pool's new booking is heard even when its file keeps its length and its
    modification time: the text is compared, not the file's size or timestamps."""
    table = BookingTable(tmp_path / "bookings")
    assert table.publish(UUID, "mine.1", [])  # creates the directory and the file
    path = table.directory / f"{UUID}.json"
    stamp_s = float(int(time.time()))
    mine = _row(os.getpid(), "mine.1", 0, stamp_s)
    before = _write(path, [mine, _row(sleeper.pid, "other.1", 1 * GiB, stamp_s)])
    seen = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert seen.booked_bytes == 1 * GiB
    times = os.stat(path)
    after = _write(path, [mine, _row(sleeper.pid, "other.1", 2 * GiB, stamp_s)])
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert len(after) == len(before)
    assert after != before
    assert os.stat(path).st_mtime_ns == times.st_mtime_ns
    again = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    assert again is not None
    assert again.booked_bytes == 2 * GiB


def test_an_unchanged_table_gives_the_same_answer_and_a_change_a_new_one(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """Two reads of an unchanged file answer one and the same value; a row written between
    them gives a new answer holding it."""
    table = BookingTable(tmp_path / "bookings")
    assert table.publish(UUID, "mine.1", [])
    path = table.directory / f"{UUID}.json"
    mine = _row(os.getpid(), "mine.1", 0, time.time())
    _write(path, [mine, _row(sleeper.pid, "other.1", 3 * GiB, time.time())])
    first = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    second = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    assert first is not None
    assert second is first
    assert [pool.pool_id for pool in first.pools] == ["other.1"]
    _write(path, [mine, _row(sleeper.pid, "other.1", 5 * GiB, time.time())])
    third = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    assert third is not None
    assert third is not first
    assert third.booked_bytes == 5 * GiB


def test_a_killed_pools_row_is_dropped_though_the_text_did_not_change(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """Rows reused from an unchanged file are checked again at every read: a pool killed
    between two reads (it could not withdraw its row) counts for nothing at the second."""
    table = BookingTable(tmp_path / "bookings")
    assert table.publish(UUID, "mine.1", [])
    path = table.directory / f"{UUID}.json"
    mine = _row(os.getpid(), "mine.1", 0, time.time())
    text = _write(path, [mine, _row(sleeper.pid, "other.1", 4 * GiB, time.time())])
    seen = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert [pool.pid for pool in seen.pools] == [sleeper.pid]
    sleeper.send_signal(signal.SIGKILL)
    sleeper.wait(timeout=60)
    assert path.read_bytes() == text
    after = table.others(UUID, "mine.1", total_bytes=TOTAL_BYTES)
    assert after is not None
    assert after.pools == ()
    assert str(sleeper.pid) not in path.read_text()  # the drop was written back


def test_a_row_met_again_is_held_to_its_stamp_its_process_and_the_card_total(
    sleeper: subprocess.Popen[bytes],
) -> None:
    """The checks remember a row object whose workers they found, and nothing else: the same
    object is dropped once its stamp is stale or in the future, once its process is gone,
    and where the card's total is below its booking."""
    now_s = time.time()
    row = _row(sleeper.pid, "other.1", 6 * GiB, now_s)
    alive: dict[int, str | None] = {sleeper.pid: row.start}
    own_start = read_start_token(os.getpid())
    assert own_start is not None
    checks = RowChecks(start_token=alive.get, own_pid=os.getpid(), own_start=own_start)

    def kept(at_s: float, total_bytes: int | None = TOTAL_BYTES) -> bool:
        pools = {row.pool_id: row}
        checks.keep(pools, owner_uid=os.geteuid(), now_s=at_s, total_bytes=total_bytes)
        return row.pool_id in pools

    assert kept(now_s)
    assert kept(now_s)  # met again
    assert not kept(now_s + STALE_AFTER_S + 1)
    assert not kept(now_s - FUTURE_SLACK_S - 1)
    assert not kept(now_s, total_bytes=4 * GiB)
    assert kept(now_s, total_bytes=None)
    alive[sleeper.pid] = None  # exited
    assert not kept(now_s)


def test_this_processs_rows_count_under_the_user_its_checks_were_built_for() -> None:
    """This process's own rows are owned by the user the checks were built with (no lookup
    of its own process at every read): in a file of that user they count, in another's not."""
    own_start = read_start_token(os.getpid())
    assert own_start is not None
    row = _row(os.getpid(), "mine.1", GiB, time.time())
    checks = RowChecks(start_token={}.get, own_pid=os.getpid(), own_start=own_start, own_uid=4321)
    for owner_uid, counts in ((4321, True), (os.geteuid(), False)):
        pools = {row.pool_id: row}
        checks.keep(pools, owner_uid=owner_uid, now_s=time.time(), total_bytes=TOTAL_BYTES)
        assert (row.pool_id in pools) is counts
