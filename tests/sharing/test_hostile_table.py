"""What another process, or another local user, can do to a pool through the booking table.

Real processes and real files: a process holding the table's lock, rows forged under PID 1,
under a live process that is not a pool, stale, oversized or written by another user,
directories others can write. The foreign-user cases fork a child that becomes ``nobody``
(possible as root, as in CI) and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from second_user import NOBODY, Forked, needs_nobody

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._core.bookings import (
    PoolBooking,
    TaskBooking,
    format_booking_table,
    parse_booking_table,
)
from gpupool._core.units import GiB
from gpupool._sensors.bookings import BookingTable, read_start_token

UUID = "GPU-00000000-1111-2222-3333-444444444444"
TOTAL_BYTES = 40 * GiB
#: A safety net so that a broken test fails instead of hanging; never asserted on.
PATIENCE_S = 60.0


def _row(
    pool_id: str,
    pid: int,
    workers: list[int],
    booked: int = 30 * GiB,
    *,
    updated_s: float | None = None,
    waiting: int = 0,
) -> PoolBooking:
    start = read_start_token(pid)
    assert start is not None
    return PoolBooking(
        pool_id=pool_id,
        pid=pid,
        start=start,
        label="forged",
        updated_s=time.time() if updated_s is None else updated_s,
        tasks=tuple(
            TaskBooking(worker_pid=w, key="k", booked_bytes=booked, reached_bytes=0)
            for w in workers
        ),
        waiting=waiting,
    )


def _plant(directory: Path, rows: list[PoolBooking]) -> Path:
    """Write ``rows`` into this user's private table for the card, as a forger would."""
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{UUID}.json"
    path.write_bytes(format_booking_table(UUID, rows))
    path.chmod(0o600)
    return path


class Sleeper:
    """A live process of this user that is no pool: it waits for its stdin to close."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "up"

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        self.process.wait(timeout=PATIENCE_S)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory that another user can reach (pytest's own are private to this user)."""
    directory = Path(tempfile.mkdtemp(prefix="gpupool-hostile-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def closing() -> Iterator[list[Sleeper | Forked]]:
    opened: list[Sleeper | Forked] = []
    yield opened
    for thing in reversed(opened):
        thing.close()


def _hold_lock_on(paths: list[Path]) -> Callable[[], None]:
    """A child's work: open each path it can and hold an exclusive flock on it."""

    def work() -> None:
        held = 0
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            held += 1
        if not held:
            raise RuntimeError("no file could be opened to lock")

    return work


# -- a process holding the table's lock -----------------------------------------------------


def test_a_process_holding_the_lock_delays_no_result_and_the_skip_is_recorded(
    tmp_path: Path, closing: list[Sleeper | Forked]
) -> None:
    """Another process of this user holds the card file's flock: the pool's results still
    arrive, the skipped steps are a `bookings_skipped` record and a statistics figure, and
    once the lock is free the pool reaches the table again (its row is withdrawn)."""
    directory = tmp_path / "bookings"
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        uuid = host.device_uuid(0)
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB", bookings_dir=directory) as pool:
            assert pool.submit(abs, -1).result(timeout=PATIENCE_S) == 1
            [path] = directory.glob("*.json")
            holder = Forked(_hold_lock_on([path]))
            closing.append(holder)
            assert holder.line == "ready"
            try:
                results = [pool.submit(abs, -n).result(timeout=PATIENCE_S) for n in range(3)]
            finally:
                holder.close()
            assert results == [0, 1, 2]
            skipped = [d for d in pool.decisions if d.event == "bookings_skipped"]
            assert skipped, [d.event for d in pool.decisions]
            assert skipped[0].extra["lock_wait_s"] > 0
            assert "lock" in skipped[0].reason
            assert pool.statistics().bookings_skipped >= 1
        after = BookingTable(directory).others(uuid)
        assert after is not None
        assert after.pools == ()  # withdrawn at shutdown: the table was reached again


@needs_nobody
def test_another_user_cannot_hold_the_shared_tables_lock(
    open_tmp: Path, closing: list[Sleeper | Forked]
) -> None:
    """With share_bookings="host", another user locks every table file it can open: the
    pool goes on with its table and skips no step."""
    directory = open_tmp / "host-table"
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        with GpuPoolExecutor(
            max_workers=1, task_peak="2GiB", share_bookings="host", bookings_dir=directory
        ) as pool:
            assert pool.submit(abs, -1).result(timeout=PATIENCE_S) == 1
            holder = Forked(_hold_lock_on(sorted(directory.iterdir())), user=NOBODY)
            closing.append(holder)
            assert holder.line == "ready"
            try:
                results = [pool.submit(abs, -n).result(timeout=PATIENCE_S) for n in range(3)]
            finally:
                holder.close()
            assert results == [0, 1, 2]
            assert [d for d in pool.decisions if d.event == "bookings_skipped"] == []
            assert pool.statistics().bookings_skipped == 0


# -- forged rows ---------------------------------------------------------------------------


def test_forged_rows_are_ignored(tmp_path: Path, closing: list[Sleeper | Forked]) -> None:
    """PID 1 with workers that are not its children, a live process that is no pool, a
    stale row, a row stamped in the future, a booking larger than the card and a row with
    too many tasks count for nothing; the honest row beside them counts."""
    sleeper = Sleeper()
    closing.append(sleeper)
    me = os.getpid()
    child = Sleeper()  # a real child of this process: a worker of the honest row
    closing.append(child)
    now = time.time()
    path = _plant(
        tmp_path / "t",
        [
            _row("1.1", 1, [me]),
            _row("1.2", 1, [], waiting=8),
            _row(f"{sleeper.process.pid}.1", sleeper.process.pid, [me]),
            _row(f"{me}.7", me, [child.process.pid], updated_s=now - 3600),
            _row(f"{me}.8", me, [child.process.pid], updated_s=now + 3600),
            _row(f"{me}.9", me, [child.process.pid], booked=TOTAL_BYTES + 1),
            _row(f"{me}.10", me, [child.process.pid] * 5000, booked=1),
            _row(f"{me}.11", me, [child.process.pid], booked=2 * GiB),
        ],
    )
    seen = BookingTable(path.parent).others(UUID, total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert [(p.pool_id, p.booked_bytes) for p in seen.pools] == [(f"{me}.11", 2 * GiB)]
    assert seen.waiting_pools == 0


def test_an_oversized_file_is_not_parsed_and_is_started_afresh(tmp_path: Path) -> None:
    """A table file past the size limit is not read (every exchange would re-parse it): its
    rows count for nothing and this user's own file is started afresh."""
    me = os.getpid()
    rows = [_row(f"{me}.{n}", me, [me], booked=1) for n in range(20_000)]
    path = _plant(tmp_path / "t", rows)
    assert path.stat().st_size > 1_000_000
    table = BookingTable(path.parent)
    seen = table.others(UUID, total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert seen.pools == ()
    assert table.publish(UUID, f"{me}.1", [])
    assert path.stat().st_size < 10_000


def test_a_pools_own_row_is_kept_fresh_by_its_reads(tmp_path: Path) -> None:
    """A pool that only reads (a long task runs, nothing starts) still refreshes its row's
    stamp, so that its booking does not expire while it lives."""
    me = os.getpid()
    table = BookingTable(tmp_path / "t")
    own = TaskBooking(worker_pid=me, key="k", booked_bytes=GiB, reached_bytes=0)
    assert table.publish(UUID, f"{me}.1", [own])
    path = tmp_path / "t" / f"{UUID}.json"
    old = _row(f"{me}.1", me, [me], booked=GiB, updated_s=time.time() - 3600)
    path.write_bytes(format_booking_table(UUID, [old]))  # as if its last write were an hour ago
    assert table.others(UUID, f"{me}.1", total_bytes=TOTAL_BYTES) is not None
    seen = BookingTable(path.parent).others(UUID, total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert [(p.pool_id, p.booked_bytes) for p in seen.pools] == [(f"{me}.1", GiB)]
    assert seen.pools[0].updated_s > time.time() - 60


# -- another user ---------------------------------------------------------------------------


@needs_nobody
def test_a_private_table_ignores_rows_of_another_users_process(
    tmp_path: Path, closing: list[Sleeper | Forked]
) -> None:
    """A row in this user's table under a live process of another user counts for nothing."""
    other = Forked(lambda: None, user=NOBODY)
    closing.append(other)
    assert other.line == "ready"
    path = _plant(tmp_path / "t", [_row(f"{other.pid}.1", other.pid, [other.pid])])
    seen = BookingTable(path.parent).others(UUID, total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert seen.pools == ()


def _forge_everywhere(directory: Path, victim: int) -> Callable[[], None]:
    """A child's work (as another user): publish its own honest row in the shared table,
    then add a row under ``victim`` (a live process of another user) to every table file
    it can write, and a file of its own holding only that row."""

    def work() -> None:
        mine = BookingTable(directory, shared=True)
        own = TaskBooking(worker_pid=os.getpid(), key="k", booked_bytes=GiB, reached_bytes=0)
        if not mine.publish(UUID, f"{os.getpid()}.1", [own]):
            raise RuntimeError(f"the shared table refused its user: {mine.unavailable_reason}")
        forged = _row(f"{victim}.66", victim, [victim])
        for path in [*directory.glob("*.json"), directory / f"{UUID}.forged.json"]:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError:
                continue
            with os.fdopen(fd, "r+b") as file:
                try:
                    rows = parse_booking_table(file.read(), card_uuid=UUID)
                except ValueError:
                    rows = {}
                rows[forged.pool_id] = forged
                file.seek(0)
                file.truncate()
                file.write(format_booking_table(UUID, list(rows.values())))

    return work


@needs_nobody
def test_another_users_rows_count_only_under_their_own_processes(
    open_tmp: Path, closing: list[Sleeper | Forked]
) -> None:
    """In the host-wide table another user's pool is seen, but a row that user wrote under
    this user's process counts for nothing."""
    directory = open_tmp / "host-table"
    directory.mkdir()
    directory.chmod(0o1777)
    forger = Forked(_forge_everywhere(directory, os.getpid()), user=NOBODY)
    closing.append(forger)
    assert forger.line == "ready"
    seen = BookingTable(directory, shared=True).others(UUID, total_bytes=TOTAL_BYTES)
    assert seen is not None
    assert [(p.pid, p.booked_bytes) for p in seen.pools] == [(forger.pid, GiB)]


# -- directories ---------------------------------------------------------------------------


def test_a_shared_table_refuses_a_directory_others_can_write_without_the_sticky_bit(
    tmp_path: Path,
) -> None:
    """share_bookings="host" in a 0777 directory (anyone could swap the files): refused, and
    the reason says what is wrong and how to fix it."""
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    table = BookingTable(directory, shared=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert table.others(UUID) is None
    reason = table.unavailable_reason
    assert reason is not None
    assert "writable by other users" in reason
    assert "sticky" in reason
    assert not any(directory.iterdir())


@needs_nobody
def test_a_shared_table_refuses_a_directory_another_user_owns(tmp_path: Path) -> None:
    """A directory owned by another user (not root) is theirs to swap: refused."""
    assert NOBODY is not None
    directory = tmp_path / "theirs"
    directory.mkdir()
    os.chown(directory, *NOBODY)
    directory.chmod(0o1777)
    table = BookingTable(directory, shared=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert table.others(UUID) is None
    reason = table.unavailable_reason
    assert reason is not None
    assert f"owner uid {NOBODY[0]}" in reason


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_directory_swapped_above_the_table_does_not_redirect_it(
    tmp_path: Path, shared: bool
) -> None:
    """The table's directory is renamed and a link to another directory put in its place (as
    anyone who can write the directory above could): the file (and lock file) of a card first
    met afterwards goes into the directory the table opened, none into the other one (before:
    created in the linked directory)."""
    above = tmp_path / "open-to-all"
    above.mkdir()
    above.chmod(0o777)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    table = BookingTable(above / "table", shared=shared)
    assert table.exchange("GPU-first", "1.1", []) is not None
    (above / "table").rename(above / "moved")
    (above / "table").symlink_to(elsewhere, target_is_directory=True)
    seen = table.exchange("GPU-second", "1.1", [])
    table.close()
    assert list(elsewhere.iterdir()) == []
    assert seen is not None
    names = sorted(p.name for p in (above / "moved").iterdir())
    assert any(name.startswith("GPU-second") and name.endswith(".json") for name in names)
    if shared:
        assert any(name.startswith("GPU-second") and name.endswith(".lock") for name in names)


# -- sharing that stops is said ------------------------------------------------------------


def test_a_table_that_cannot_be_used_is_a_record_a_statistic_and_a_warning(
    tmp_path: Path,
) -> None:
    """A private table in a directory others can write is refused: the pool runs on, and says
    so in a `bookings_unavailable` record, in statistics(), and with a RuntimeWarning."""
    directory = tmp_path / "squatted"
    directory.mkdir()
    directory.chmod(0o777)
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        with pytest.warns(RuntimeWarning, match="booking table"):
            with GpuPoolExecutor(max_workers=1, task_peak="2GiB", bookings_dir=directory) as pool:
                assert pool.submit(abs, -5).result(timeout=PATIENCE_S) == 5
    [record] = [d for d in pool.decisions if d.event == "bookings_unavailable"]
    assert str(directory) in record.reason
    assert record.extra["bookings_dir"] == str(directory)
    reason = pool.statistics().bookings_unavailable
    assert reason is not None
    assert "not private" in reason
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777


def test_a_fifo_at_the_files_name_is_refused_as_what_it_is(tmp_path: Path) -> None:
    """A FIFO where this user's file goes is refused, and the reason says it is not a regular
    file (before: "not this user's own file (owner uid <this user>)", which it was)."""
    directory = tmp_path / "table"
    directory.mkdir(mode=0o700)
    os.mkfifo(directory / "GPU-fifo.json", 0o600)
    table = BookingTable(directory)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert table.exchange("GPU-fifo", "1.1", []) is None
    reason = table.unavailable_reason
    assert reason is not None
    assert "not a regular file" in reason and "prw-------" in reason
    assert "own file" not in reason
