"""A second local user attacks a pool through the shared booking table (``share_bookings="host"``).

The attacker is a real second user: a forked child that becomes ``nobody`` (the suite runs as
root in CI; elsewhere these tests are skipped with the reason). Each attack is made while a
victim pool runs; each must leave the victim's results arriving, its pricing unmoved by rows
that fail validation, and nothing created outside the table's directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from second_user import NOBODY, Forked, needs_nobody
from sharing_tasks import delayed_hold

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._core.bookings import PoolBooking, TaskBooking, format_booking_table
from gpupool._core.units import GiB
from gpupool._sensors.booking_foreign import MAX_DIRECTORY_ENTRIES
from gpupool._sensors.bookings import BookingTable, read_start_token
from gpupool._sensors.simulated import simulated_uuid

pytestmark = needs_nobody

CARD = simulated_uuid(0)
TOTAL_BYTES = 40 * GiB
#: A safety net so that a broken test fails instead of hanging; never asserted on.
PATIENCE_S = 60.0


@pytest.fixture
def root() -> Iterator[Path]:
    """A directory another user can reach (pytest's are private), holding the table."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-attack-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _table(root: Path) -> Path:
    directory = root / "table"
    directory.mkdir()
    directory.chmod(0o1777)
    return directory


def _own_file(directory: Path, uuid: str = CARD) -> Path:
    """The attacker's own file for the card (the one name a pool of theirs writes)."""
    return directory / f"{uuid}.uid{os.getuid()}.json"


def _row(pool_id: str, pid: int, start: str, workers: list[int], booked: int) -> PoolBooking:
    return PoolBooking(
        pool_id=pool_id,
        pid=pid,
        start=start,
        label="forged",
        updated_s=time.time(),
        tasks=tuple(
            TaskBooking(worker_pid=w, key="k", booked_bytes=booked, reached_bytes=0)
            for w in workers
        ),
    )


def _run_victim(
    directory: Path, tasks: int = 10, devices: int = 1
) -> tuple[GpuPoolExecutor, list[int], list[str]]:
    """The victim: a shared-mode pool on a simulated card; its results and warnings."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB") for _ in range(devices)]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with GpuPoolExecutor(
                max_workers=2, task_peak="2GiB", share_bookings="host", bookings_dir=directory
            ) as pool:
                futures = [pool.submit(abs, -n) for n in range(tasks)]
                results = [f.result(timeout=PATIENCE_S) for f in futures]
    return pool, results, [str(w.message) for w in caught]


def _priced_others(pool: GpuPoolExecutor) -> set[str]:
    """What the pool's records say the other pools book (``"3.00 GiB"``...)."""
    found = set()
    for decision in pool.decisions:
        match = re.search(r"other pools on the card book (\S+ \S+)", decision.reason)
        if match:
            found.add(match.group(1))
    return found


def _attacking(work: Callable[[], None], loop: Callable[[], None] | None = None) -> Forked:
    attacker = Forked(work, user=NOBODY, loop=loop)
    assert attacker.line == "ready", attacker.line
    return attacker


# -- forged rows ---------------------------------------------------------------------------


def test_forged_rows_count_for_nothing_and_a_real_process_books_what_it_could_run(
    root: Path,
) -> None:
    """In the attacker's own file, rows under PID 1, under the victim's own PID, under the
    attacker's live process with workers that are not its children, and booking more than the
    card: none is priced. The attacker's live process with a child as its worker is priced (what
    it could take by allocating; docs/threat-model.md, "Book what they could run")."""
    directory = _table(root)
    victim = os.getpid()
    children: list[subprocess.Popen[bytes]] = []

    def forge() -> None:
        # cat, not Python: the second user may not reach this interpreter.
        child = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        children.append(child)  # lives until the attacker exits (its stdin closes)
        me, start = os.getpid(), read_start_token(os.getpid())
        assert start is not None
        rows = [
            _row("1.1", 1, read_start_token(1) or "1", [1], GiB),
            _row(f"{victim}.9", victim, read_start_token(victim) or "", [victim], GiB),
            _row(f"{me}.2", me, start, [victim], GiB),
            _row(f"{me}.3", me, start, [child.pid], TOTAL_BYTES + 1),
            _row(f"{me}.4", me, start, [child.pid], 3 * GiB),
        ]
        _own_file(directory).write_bytes(format_booking_table(CARD, rows))

    attacker = _attacking(forge)
    try:
        seen = BookingTable(directory, shared=True).others(CARD, total_bytes=TOTAL_BYTES)
        assert seen is not None
        assert [(p.pool_id, p.booked_bytes) for p in seen.pools] == [(f"{attacker.pid}.4", 3 * GiB)]
        pool, results, _ = _run_victim(directory)
    finally:
        attacker.close()
    assert results == list(range(10))
    assert _priced_others(pool) <= {"3.00 GiB"}
    assert sorted(p.name for p in root.iterdir()) == ["table"]


def _set_next_pid(pid: int) -> bool:
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as file:
            file.write(str(pid - 1))
        return True
    except OSError:
        return False


def test_a_row_under_a_reused_pid_counts_for_nothing(root: Path) -> None:
    """The attacker's pool wrote its row and exited; its PID now names another live process of
    the same user (a real reuse, forced through ns_last_pid): the row is not priced."""
    directory = _table(root)
    old = Forked(lambda: None, user=NOBODY)
    pid, start = old.pid, read_start_token(old.pid)
    assert start is not None
    _own_file_path = directory / f"{CARD}.uid{NOBODY[0] if NOBODY else 0}.json"
    old.close()
    reused: Forked | None = None
    for _ in range(50):  # another process of the host may take the PID first
        if not _set_next_pid(pid):
            pytest.skip("cannot choose the next PID (/proc/sys/kernel/ns_last_pid not writable)")
        candidate = Forked(lambda: None, user=NOBODY)
        if candidate.pid == pid:
            reused = candidate
            break
        candidate.close()
    if reused is None:
        pytest.skip(f"PID {pid} was taken by another process 50 times over")
    try:
        assert read_start_token(pid) not in (None, start)
        row = _row(f"{pid}.1", pid, start, [pid], 5 * GiB)
        _own_file_path.write_bytes(format_booking_table(CARD, [row]))
        assert NOBODY is not None
        os.chown(_own_file_path, *NOBODY)
        seen = BookingTable(directory, shared=True).others(CARD, total_bytes=TOTAL_BYTES)
        assert seen is not None
        assert seen.pools == ()
        pool, results, _ = _run_victim(directory)
    finally:
        reused.close()
    assert results == list(range(10))
    assert _priced_others(pool) == set()


def test_text_no_pool_writes_costs_the_pool_nothing(root: Path) -> None:
    """Text nested past the recursion limit on one card (before: a RecursionError out of the
    victim's step), a file past the size limit on the other: the pool's results arrive, the
    refusals are counted and warned about."""
    directory = _table(root)

    def plant() -> None:
        _own_file(directory, simulated_uuid(0)).write_bytes(b"[" * 100_000)
        _own_file(directory, simulated_uuid(1)).write_bytes(b" " * (1 << 20))

    attacker = _attacking(plant)
    try:
        pool, results, said = _run_victim(directory, devices=2)
    finally:
        attacker.close()
    assert results == list(range(10))
    assert pool.statistics().bookings_skipped >= 1
    assert [m for m in said if "nested deeper" in m or "bytes, more than" in m]
    assert _priced_others(pool) == set()


# -- the directory -------------------------------------------------------------------------


def test_a_directory_flooded_past_the_scan_limit_is_said_and_costs_the_pool_nothing(
    root: Path,
) -> None:
    """More entries than are looked at: the pool's results arrive, the step is counted, a
    warning names the limit, and nothing is created outside the directory."""
    directory = _table(root)

    def flood() -> None:
        for n in range(MAX_DIRECTORY_ENTRIES + 50):
            os.close(os.open(directory / f"flood-{n}", os.O_CREAT | os.O_WRONLY, 0o644))

    attacker = _attacking(flood)
    try:
        pool, results, said = _run_victim(directory)
    finally:
        attacker.close()
    assert results == list(range(10))
    assert pool.statistics().bookings_skipped >= 1
    assert [m for m in said if f"more than {MAX_DIRECTORY_ENTRIES} entries" in m]
    records = [d for d in pool.decisions if d.event == "bookings_skipped"]
    assert records and "scan_limit" in str(records[0].extra["cause"])
    assert records[0].extra["max_directory_entries"] == MAX_DIRECTORY_ENTRIES
    assert sorted(p.name for p in root.iterdir()) == ["table"]


def test_a_file_swapped_between_the_scan_and_the_open_is_never_followed(root: Path) -> None:
    """The attacker's file changes, without pause, between a forged table, a link to the
    victim's own file, a link out of the directory, a FIFO, a directory and a hard link:
    the victim's results arrive, nothing is priced, nothing is created at the link's target,
    and the victim's own file stays its own."""
    directory = _table(root)
    outside = root / "outside.json"
    victim = os.getpid()
    forged = format_booking_table(
        CARD, [_row(f"{victim}.5", victim, read_start_token(victim) or "", [victim], 9 * GiB)]
    )
    state = {"n": 0}

    def swap() -> None:
        path = _own_file(directory)
        spare = directory / f"spare.uid{os.getuid()}"
        state["n"] += 1
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            elif path.exists() or path.is_symlink():
                path.unlink()
            kind = state["n"] % 6
            if kind == 0:
                path.write_bytes(forged)
            elif kind == 1:
                path.symlink_to(directory / f"{CARD}.uid0.json")
            elif kind == 2:
                path.symlink_to(outside)
            elif kind == 3:
                os.mkfifo(path)
            elif kind == 4:
                path.mkdir()
            else:
                if not spare.exists():
                    spare.write_bytes(forged)
                os.link(spare, path)
        except OSError:
            pass

    attacker = _attacking(lambda: None, loop=swap)
    try:
        pool, results, _ = _run_victim(directory, tasks=20)
    finally:
        attacker.close()
    assert results == list(range(20))
    assert _priced_others(pool) == set()
    assert not outside.exists() and not outside.is_symlink()
    assert sorted(p.name for p in root.iterdir()) == ["table"]
    own = (directory / f"{CARD}.uid0.json").lstat()
    assert own.st_uid == 0 and own.st_nlink == 1
    assert pool.statistics().bookings_unavailable is None


def test_a_directory_swapped_between_the_check_and_the_open_never_redirects_the_table(
    root: Path,
) -> None:
    """The directory above the table is the attacker's; it swaps the table's directory for a
    link to a directory of its own, and back, without pause, while victim pools start and
    stop (each opens the table afresh): every result arrives, each pool uses the table or says
    why not, and nothing is ever created in the attacker's directory."""
    assert NOBODY is not None
    above = root / "above"
    above.mkdir()
    os.chown(above, *NOBODY)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, *NOBODY)
    elsewhere.chmod(0o1777)
    table = above / "table"

    def swap() -> None:
        try:
            if table.is_dir() and not table.is_symlink():
                table.rename(above / "moved")
                table.symlink_to(elsewhere, target_is_directory=True)
            elif table.is_symlink():
                table.unlink()
                if (above / "moved").is_dir():
                    (above / "moved").rename(table)
        except OSError:
            pass

    attacker = _attacking(lambda: None, loop=swap)
    outcomes = []
    try:
        for _ in range(3):
            pool, results, _ = _run_victim(table, tasks=4)
            assert results == list(range(4))
            outcomes.append(pool.statistics().bookings_unavailable)
    finally:
        attacker.close()
    assert list(elsewhere.iterdir()) == []
    for reason in outcomes:
        assert reason is None or "booking table" in reason
    assert sorted(p.name for p in root.iterdir()) == ["above", "elsewhere"]


def test_an_honest_users_pool_is_seen_beside_a_refused_name(root: Path) -> None:
    """Another user's honest pool on the card is seen, with its bookings, beside a file under a
    misspelt uid (refused, and the step counted)."""
    directory = _table(root)

    def publish() -> None:
        mine = BookingTable(directory, shared=True)
        own = TaskBooking(worker_pid=os.getpid(), key="k", booked_bytes=GiB, reached_bytes=0)
        if not mine.publish(CARD, f"{os.getpid()}.1", [own]):
            raise RuntimeError(mine.unavailable_reason)
        (directory / f"{CARD}.uid0{os.getuid()}.json").write_text(json.dumps({"x": 1}))

    attacker = _attacking(publish)
    try:
        table = BookingTable(directory, shared=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seen = table.others(CARD, total_bytes=TOTAL_BYTES)
    finally:
        attacker.close()
    assert seen is not None
    assert [(p.pid, p.booked_bytes) for p in seen.pools] == [(attacker.pid, GiB)]
    assert table.skipped_steps == 1  # the misspelt name beside it: counted


# -- what the kernel keeps from another user -------------------------------------------------


def _report(tries: dict[str, Callable[[], object]], out: Path) -> Callable[[], None]:
    """A child's work: each try, and what became of it (``"ok"`` or the error's name), into
    ``out`` (one line per try)."""

    def work() -> None:
        lines = []
        for name, attempt in tries.items():
            try:
                attempt()
                lines.append(f"{name} ok")
            except OSError as exc:
                lines.append(f"{name} {type(exc).__name__}")
        fd = os.open(out, os.O_WRONLY)
        os.write(fd, "\n".join(lines).encode())
        os.close(fd)

    return work


def _outcomes(root: Path, tries: dict[str, Callable[[], object]]) -> dict[str, str]:
    out = root / "out"
    out.touch()
    out.chmod(0o666)
    attacker = _attacking(_report(tries, out))
    attacker.close()
    outcomes = dict(line.split(" ", 1) for line in out.read_text().splitlines())
    out.unlink()
    return outcomes


def test_another_user_cannot_read_write_or_lock_a_private_table(root: Path) -> None:
    """The default private table (0700 directory, 0600 files): another user can neither open
    the card's file to read it, write it or lock it, nor create a file beside it."""
    directory = root / "private"
    table = BookingTable(directory)
    assert table.exchange(CARD, "1.1", []) is not None
    path = directory / f"{CARD}.json"
    tries: dict[str, Callable[[], object]] = {
        "read": lambda: os.close(os.open(path, os.O_RDONLY)),
        "write": lambda: os.close(os.open(path, os.O_WRONLY)),
        "create": lambda: os.close(os.open(directory / "planted.json", os.O_CREAT | os.O_WRONLY)),
        "list": lambda: os.listdir(directory),
    }
    outcomes = _outcomes(root, tries)
    table.close()
    assert outcomes == dict.fromkeys(tries, "PermissionError")
    assert sorted(p.name for p in directory.iterdir()) == [f"{CARD}.json"]


def test_another_user_cannot_signal_or_read_the_pools_processes(root: Path) -> None:
    """Another user's signal to the pool's process or a worker, or a read of their memory, is
    refused by the kernel; the pool's results are untouched."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB") as pool:
            worker = pool.submit(os.getpid).result(timeout=PATIENCE_S)
            parent = os.getpid()
            tries: dict[str, Callable[[], object]] = {
                "kill-parent": lambda: os.kill(parent, 15),
                "kill-worker": lambda: os.kill(worker, 9),
                "read-memory": lambda: os.close(os.open(f"/proc/{worker}/mem", os.O_RDONLY)),
            }
            outcomes = _outcomes(root, tries)
            assert pool.submit(abs, -3).result(timeout=PATIENCE_S) == 3
    assert outcomes == dict.fromkeys(tries, "PermissionError")


def test_many_rows_of_one_process_claim_one_share(root: Path) -> None:
    """The attacker's one live process writes 64 rows that all wait for room (before: 64 pools
    in the fair share, so the victim was held to a 65th of the card and started its tasks one
    at a time): the rows take one share, and the victim's four tasks of 2 GiB on a 40 GiB card
    are never held to a share."""
    directory = _table(root)

    def crowd() -> None:
        me, start = os.getpid(), read_start_token(os.getpid())
        assert start is not None
        rows = [
            PoolBooking(
                pool_id=f"{me}.{n}",
                pid=me,
                start=start,
                label="crowd",
                updated_s=time.time(),
                waiting=1,
                need_bytes=GiB,
            )
            for n in range(64)
        ]
        _own_file(directory).write_bytes(format_booking_table(CARD, rows))

    def refresh() -> None:  # the stamps stay fresh, as a live pool's do
        crowd()
        time.sleep(1.0)

    attacker = _attacking(crowd, loop=refresh)
    try:
        seen = BookingTable(directory, shared=True).others(CARD, total_bytes=TOTAL_BYTES)
        assert seen is not None
        assert (len(seen.pools), seen.waiting_pools, seen.active_pools) == (64, 1, 1)
        with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
            with GpuPoolExecutor(
                max_workers=4, task_peak="2GiB", share_bookings="host", bookings_dir=directory
            ) as pool:
                futures = [pool.submit(delayed_hold, n, "2GiB", 0.0, 0.2) for n in range(8)]
                results = [f.result(timeout=PATIENCE_S) for f in futures]
    finally:
        attacker.close()
    assert results == list(range(8))
    assert [d.reason for d in pool.decisions if d.event == "share_wait"] == []
