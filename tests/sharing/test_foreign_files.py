"""Another user's files in a shared booking table cost a bounded read: refused before they are
parsed where they are not what a pool writes, parsed once while unchanged, read within a budget.

Real files, owned by a real second user (``nobody``, made their owner by root, or written by a
child that became ``nobody``); skipped with the reason where the suite does not run as root.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from second_user import NOBODY, Forked, needs_nobody

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._core.bookings import (
    PoolBooking,
    TaskBooking,
    parse_booking_table,
)
from gpupool._core.units import GiB
from gpupool._sensors.booking_foreign import (
    MAX_FOREIGN_FILE_BYTES,
    READ_BUDGET_BYTES,
    SETTLED_S,
    ForeignReader,
    ForeignStep,
    canonical_uid,
)
from gpupool._sensors.booking_rows import MAX_POOLS_PER_FILE, MAX_TASKS_PER_POOL
from gpupool._sensors.bookings import read_start_token
from gpupool._sensors.simulated import simulated_uuid

UUID = "GPU-00000000-1111-2222-3333-555555555555"
#: The simulated card's UUID (what a pool inside ``SimulatedHost`` books under).
CARD = simulated_uuid(0)
TOTAL_BYTES = 40 * GiB
#: A safety net so that a broken test fails instead of hanging; never asserted on.
PATIENCE_S = 60.0


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky 1777 table directory another user can reach (pytest's are private)."""
    root = Path(tempfile.mkdtemp(prefix="gpupool-foreign-"))
    root.chmod(0o755)
    directory = root / "table"
    directory.mkdir()
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(root, ignore_errors=True)


def _name(uid: int | str, uuid: str = UUID) -> str:
    return f"{uuid}.uid{uid}.json"


def _forged(pools: int, tasks: int, *, pid: int = 4_000_000, uuid: str = UUID) -> bytes:
    """Well-formed text of ``pools`` rows of ``tasks`` tasks, none under a live process."""
    rows = {
        f"{pid + n}.1": {
            "pid": pid + n,
            "start": "1",
            "label": "forged",
            "updated_s": time.time(),
            "waiting": 0,
            "need_bytes": 0,
            "tasks": [[pid + 100_000 + i, "k", 1, 0] for i in range(tasks)],
        }
        for n in range(pools)
    }
    body = {"version": 1, "card_uuid": uuid, "pools": rows}
    return json.dumps(body, separators=(",", ":")).encode()


def _theirs(path: Path, data: bytes) -> Path:
    """Write ``data`` at ``path`` as the second user's own file (0644)."""
    assert NOBODY is not None
    path.write_bytes(data)
    os.chown(path, *NOBODY)
    path.chmod(0o644)
    return path


def _honest_row(pid: int, booked: int = GiB) -> PoolBooking:
    start = read_start_token(pid)
    assert start is not None
    return PoolBooking(
        pool_id=f"{pid}.1",
        pid=pid,
        start=start,
        label="honest",
        updated_s=time.time(),
        tasks=(TaskBooking(worker_pid=pid, key="k", booked_bytes=booked, reached_bytes=0),),
    )


def _untimed(budget_bytes: int = READ_BUDGET_BYTES) -> ForeignReader:
    """A reader whose time budget never binds (on a loaded host a parse may overrun it and
    leave the next steps' reads for later): these tests count reads and parses."""
    return ForeignReader(budget_bytes=budget_bytes, budget_s=3600.0, share=1.0)


def _read(reader: ForeignReader, directory: Path, own_uid: int = 0) -> ForeignStep:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return reader.read(fd, UUID, f"{UUID}.uid", own_uid, lambda pools, uid: None)
    finally:
        os.close(fd)


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("digits", "uid"),
    [
        ("1002", 1002),
        ("0", 0),
        ("01002", None),
        ("001002", None),
        ("+1002", None),
        (" 1002", None),
        ("1_002", None),
        ("١٠٠٢", None),  # Arabic-Indic digits: str.isdigit() and int() accept them
        ("", None),
    ],
)
def test_only_a_uids_one_spelling_names_its_file(digits: str, uid: int | None) -> None:
    assert canonical_uid(digits) == uid


# -- refused before parsing ---------------------------------------------------------------


@needs_nobody
def test_a_file_with_hard_links_or_another_spelling_is_refused_unread(shared_dir: Path) -> None:
    """One file under its owner's name and hard links to it under other spellings of the
    uid (before: each name was read and parsed in full, at every step)."""
    assert NOBODY is not None
    first = _theirs(shared_dir / _name(NOBODY[0]), _forged(4, 50))
    for spelling in (f"0{NOBODY[0]}", f"00{NOBODY[0]}"):
        os.link(first, shared_dir / _name(spelling))
    reader = _untimed()
    step = _read(reader, shared_dir)
    assert step.read_bytes == 0
    assert reader.parses == 0
    refused = step.refused
    assert "3 hard links" in refused[_name(NOBODY[0])]
    assert set(refused) == {_name(n) for n in (NOBODY[0], f"0{NOBODY[0]}", f"00{NOBODY[0]}")}


@needs_nobody
def test_files_that_no_pool_writes_are_refused_before_they_are_read(shared_dir: Path) -> None:
    """Past the size limit, owned by another uid than the name spells, a directory, a FIFO, a
    symbolic link: each refused from its status alone (nothing read), and the reason says which."""
    assert NOBODY is not None
    _theirs(shared_dir / _name(NOBODY[0]), b" " * (MAX_FOREIGN_FILE_BYTES + 1))
    _theirs(shared_dir / _name(4242), _forged(1, 1))  # owned by nobody, named for 4242
    (shared_dir / _name(4343)).mkdir()
    os.mkfifo(shared_dir / _name(4444))
    os.chown(shared_dir / _name(4444), 4444, 4444)
    (shared_dir / _name(4545)).symlink_to(shared_dir / _name(4242))
    reader = _untimed()
    step = _read(reader, shared_dir)
    refused = step.refused
    assert step.read_bytes == 0
    assert "more than" in refused[_name(NOBODY[0])]
    assert f"owner (uid {NOBODY[0]})" in refused[_name(4242)]
    assert "not a regular file" in refused[_name(4343)]
    assert "not a regular file" in refused[_name(4444)]
    assert "symbolic link" in refused[_name(4545)]


@needs_nobody
@pytest.mark.parametrize(
    ("text", "why"),
    [
        (_forged(MAX_POOLS_PER_FILE + 1, 0), f"more than {MAX_POOLS_PER_FILE} rows"),
        (_forged(1, MAX_TASKS_PER_POOL + 1), f"more than {MAX_TASKS_PER_POOL} tasks"),
        (b"[" * 100_000, "nested"),
    ],
    ids=["rows", "tasks", "nested"],
)
def test_text_past_the_limits_stops_the_decoding(shared_dir: Path, text: bytes, why: str) -> None:
    """Too many rows, a row of too many tasks, text nested past the interpreter's recursion
    limit (before: a RecursionError out of the pool's step): refused, and counted once."""
    assert NOBODY is not None
    assert len(text) <= MAX_FOREIGN_FILE_BYTES
    _theirs(shared_dir / _name(NOBODY[0]), text)
    reader = _untimed()
    for _ in range(3):
        step = _read(reader, shared_dir)
        assert why in step.refused[_name(NOBODY[0])]
        assert step.rows == []
    assert reader.parses == 2  # the first read, and its one retry (a torn read); never again


def test_decoding_stops_at_the_first_row_past_the_limit() -> None:
    """The limits hold while the text is decoded: a file of many rows is refused at the row
    past the limit, whatever follows it (here: text that would fail to decode)."""
    text = _forged(3, 1)[:-2] + b',"broken":'
    with pytest.raises(ValueError, match="not JSON"):
        parse_booking_table(text, card_uuid=UUID)
    with pytest.raises(ValueError, match="more than 2 rows"):
        parse_booking_table(text, card_uuid=UUID, max_pools=2)


# -- parsed once while unchanged -----------------------------------------------------------


@needs_nobody
def test_an_unchanged_file_is_parsed_once_and_a_changed_one_again(shared_dir: Path) -> None:
    """An unchanged file is not parsed again (once settled, not even read); a change is seen
    at the next step."""
    assert NOBODY is not None
    path = _theirs(shared_dir / _name(NOBODY[0]), _forged(2, 3))
    reader = _untimed()
    for _ in range(5):
        step = _read(reader, shared_dir)
        assert not step.passed_over
    assert reader.parses == 1
    time.sleep(SETTLED_S * 1.5)  # the file's ctime must lie behind the settling time
    step = _read(reader, shared_dir)
    assert step.read_bytes == 0
    with path.open("r+b") as file:  # in place, as a pool writes: same inode
        file.write(_forged(1, 3))
        file.truncate()
    _read(reader, shared_dir)
    assert reader.parses == 2


@needs_nobody
def test_the_step_budget_leaves_files_unread_in_turn(shared_dir: Path) -> None:
    """Two users' files that change at every step, and a budget that holds one: each step
    reads one, the least recently read first, and the other keeps its last rows."""
    assert NOBODY is not None
    text = _forged(2, 40)
    reader = _untimed(budget_bytes=len(text) + 10)
    paths = [_theirs(shared_dir / _name(NOBODY[0]), text), shared_dir / _name(4242)]
    paths[1].write_bytes(text)
    os.chown(paths[1], 4242, 4242)
    unread: list[str] = []
    for n in range(6):
        for path in paths:  # both change: one byte of their stamps
            path.write_bytes(text.replace(b'"label":"forged"', f'"label":"forged{n}"'.encode()))
        step = _read(reader, shared_dir)
        assert step.read_bytes <= reader.budget_bytes
        assert len(step.unread) == 1
        unread.extend(step.unread)
    assert unread[0::2] == [unread[0]] * 3
    assert unread[1::2] == [unread[1]] * 3
    assert unread[0] != unread[1]


# -- the attack, against a pool ------------------------------------------------------------


def _attack(directory: Path, names: int) -> None:
    """The attacker's work (as ``nobody``): one file of forged rows under its own name, and
    ``names - 1`` hard links to it under other spellings of its uid."""
    uid = os.getuid()
    first = directory / _name(uid, CARD)
    first.write_bytes(_forged(8, 200, uuid=CARD))
    for zeros in range(1, names):
        os.link(first, directory / _name("0" * zeros + str(uid), CARD))


@needs_nobody
def test_hard_links_under_uid_spellings_cost_a_shared_pool_nothing(shared_dir: Path) -> None:
    """The attack measured on main (one file, hard links under other spellings of the uid,
    every name read and fully parsed at every step: 40 tasks of 50 ms took 80 s instead of
    1.3 s), made small: the pool's results arrive, the refusal is counted in statistics(),
    recorded, and warned about once (before: none of these)."""
    assert NOBODY is not None
    attacker = Forked(lambda: _attack(shared_dir, 5), user=NOBODY)
    try:
        assert attacker.line == "ready"
        with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with GpuPoolExecutor(
                    max_workers=2,
                    task_peak="2GiB",
                    share_bookings="host",
                    bookings_dir=shared_dir,
                ) as pool:
                    futures = [pool.submit(abs, -n) for n in range(12)]
                    results = [f.result(timeout=PATIENCE_S) for f in futures]
    finally:
        attacker.close()
    assert results == list(range(12))
    said = [str(w.message) for w in caught if "hard links" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert _name(NOBODY[0], CARD) in said[0]
    assert pool.statistics().bookings_skipped >= 1
    records = [d for d in pool.decisions if d.event == "bookings_skipped"]
    assert records, [d.event for d in pool.decisions]
    assert "refused" in str(records[0].extra["cause"])
    assert records[0].extra["files_refused"] == 5
    assert records[0].extra["read_bytes"] == 0
    assert not [d for d in pool.decisions if "other pools on the card" in d.reason]


@needs_nobody
def test_a_file_read_before_a_flood_is_still_read_past_the_scan(shared_dir: Path) -> None:
    """Entries past the scan limit: a file read before is opened by its name (a flood cannot
    hide a user's pool that was already seen), and its changes are still seen."""
    assert NOBODY is not None
    path = _theirs(shared_dir / _name(NOBODY[0]), _forged(1, 1))
    reader = ForeignReader(budget_s=3600.0, share=1.0, max_entries=0)  # every scan truncated
    assert _read(reader, shared_dir).rows == []  # never seen: nothing to open by name
    reader.max_entries = 10
    assert len(_read(reader, shared_dir).rows) == 1
    reader.max_entries = 0
    path.write_bytes(_forged(2, 1))
    step = _read(reader, shared_dir)
    assert step.scan_truncated
    assert len(step.rows) == 2


@needs_nobody
def test_reading_changed_files_takes_at_most_its_share_of_the_time(shared_dir: Path) -> None:
    """A file that changes at every step and costs 50 ms to take in (a check that advances the
    reader's clock by that much), steps 100 ms apart: reading it takes at most a tenth of the
    time (plus the budget and one overrun), and it is still read, in turn."""
    assert NOBODY is not None
    path = _theirs(shared_dir / _name(NOBODY[0]), _forged(1, 1))
    now = [0.0]
    reader = ForeignReader(budget_s=0.02, share=0.1, clock=lambda: now[0])

    def costly(pools: dict[str, PoolBooking], uid: int) -> None:
        now[0] += 0.05

    fd = os.open(shared_dir, os.O_RDONLY | os.O_DIRECTORY)
    spent_s = 0.0
    reads = 0
    try:
        for n in range(100):
            path.write_bytes(_forged(1, 1).replace(b"forged", f"forged{n:03d}".encode()))
            step = reader.read(fd, UUID, f"{UUID}.uid", 0, costly)
            spent_s += step.spent_s
            reads += step.read_bytes > 0
            now[0] += 0.1
    finally:
        os.close(fd)
    assert spent_s <= 0.1 * now[0] + 0.02 + 0.05  # the share, the budget, one overrun
    assert reads == reader.parses  # each read is one parse (the text changed each time)
    assert 10 <= reads <= (0.1 * now[0] + 0.02) / 0.05 + 1, (reads, now[0])
