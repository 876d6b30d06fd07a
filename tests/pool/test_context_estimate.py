"""Where a worker's own row is hidden, its context is priced at the largest the host measured on
its card's model (kept in a file beside the booking table), and the allocator cap uses the same
figure: real spawned pools on simulated cards; the file as untrusted input."""

from __future__ import annotations

import json
import os

import pytest

import standin_torch
from gpupool import GpuPoolExecutor
from gpupool._core.contexts import (
    CONTEXT_ESTIMATE_BYTES,
    CONTEXT_PLAUSIBLE_MAX_BYTES,
    MAX_CONTEXT_FILE_BYTES,
    parse_context_file,
)
from gpupool._core.units import GiB, MiB
from gpupool._sensors.contexts import MAX_CONTEXT_FILES, ContextFile
from gpupool.testing import SimulatedDevice, SimulatedHost

MODEL = "Simulated GPU"


def _capped_pool_run(table, *, container: bool, log=None) -> tuple[dict, list[dict]]:
    """One capped torch task (1 GiB) priced at 4 GiB on a 16 GiB card whose context is 1.5 GiB;
    what the task saw of the cap, and the pool's decision records."""
    host = SimulatedHost([SimulatedDevice("16GiB")], context="1536MiB", container=container)
    with host:
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="4GiB",
            reserve=0,
            cap_allocator=True,
            bookings_dir=table,
            initializer=standin_torch.install_in_worker,
            initargs=(16 * GiB, True),
        ) as ex:
            seen = ex.submit(standin_torch.capped_task, GiB).result(timeout=60)
            records = [d.to_dict() for d in ex.decisions]
    return seen, records


def _measured(records: list[dict]) -> dict:
    peaks = [r for r in records if "context_source" in r]
    assert peaks, records
    return peaks[-1]


@pytest.mark.slow
def test_a_context_measured_where_rows_are_listed_prices_it_where_they_are_hidden(tmp_path):
    """A pool on a card that lists its rows measures a 1.5 GiB context and records it for the
    card's model; a pool on a card of that model whose rows are hidden (a container) prices
    its workers' context at 1.5 GiB (not the 640 MiB default), says where the figure comes
    from, and caps torch's allocator with the same figure."""
    table = tmp_path / "table"
    _, listed = _capped_pool_run(table, container=False)
    assert (_measured(listed)["context_bytes"], _measured(listed)["context_source"]) == (
        1536 * MiB,
        "process-row",
    )
    written = json.loads((table / "contexts.json").read_text())
    assert written["models"][MODEL]["context_bytes"] == 1536 * MiB

    seen, hidden = _capped_pool_run(table, container=True)
    record = _measured(hidden)
    assert record["context_bytes"] == 1536 * MiB
    assert record["context_source"].startswith(
        f"estimated (largest measured on {MODEL}: 1.50 GiB, by uid {os.geteuid()} ("
    )
    assert record["peak_bytes"] == GiB + 1536 * MiB  # torch's 1 GiB plus the context
    state = seen["state"]
    assert (state["outside_bytes"], state["outside_source"]) == (
        1536 * MiB,
        record["context_source"],
    )
    assert seen["fractions"][0][0] == (4 * GiB - 1536 * MiB) / (16 * GiB)


@pytest.mark.slow
def test_without_a_measurement_the_default_says_so(tmp_path):
    """A pool on a hidden-rows card of a model nobody measured prices its context at the
    default, and its source says so."""
    seen, records = _capped_pool_run(tmp_path / "table", container=True)
    record = _measured(records)
    assert (record["context_bytes"], record["context_source"]) == (
        CONTEXT_ESTIMATE_BYTES,
        "estimated (default)",
    )
    assert seen["state"]["outside_source"] == "estimated (default)"


# -- the file, as untrusted input -----------------------------------------------------------


def _entry(context_bytes: object) -> dict:
    return {"context_bytes": context_bytes, "program": "x.py", "pool": "1.1", "time_s": 1.0}


def _file(models: dict) -> bytes:
    return json.dumps({"version": 1, "models": models}).encode()


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (-GiB, "is not positive"),
        (0, "is not positive"),
        (CONTEXT_PLAUSIBLE_MAX_BYTES + 1, "more than any CUDA context"),
        (10**30, "more than any CUDA context"),
        (1.5e9, "is not a whole number of bytes"),
        ("2GiB", "is not a whole number of bytes"),
        (True, "is not a whole number of bytes"),
    ],
)
def test_an_implausible_figure_is_refused_with_its_reason(tmp_path, value, why):
    """A recorded context that is negative, 0, above any CUDA context, or not a whole number
    of bytes is refused, the reason kept, and the estimate stays the default."""
    table = tmp_path / "table"
    table.mkdir(mode=0o700)
    (table / "contexts.json").write_bytes(_file({MODEL: _entry(value), "Other": _entry(GiB)}))
    contexts = ContextFile(table, shared=False, pool_id="1.1")
    contexts.read()
    assert why in contexts.refused["contexts.json"]
    assert contexts.estimate(MODEL).source == "estimated (default)"
    assert contexts.estimate("Other").context_bytes == GiB  # the valid entry beside it holds


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00\xff garbage", "not JSON"),
        (b"[1, 2, 3]", "not a version 1 contexts file"),
        (b"[" * 100_000, "more than"),
        (b" " * (MAX_CONTEXT_FILE_BYTES + 1), "more than"),
        (_file({f"model {n}": _entry(GiB) for n in range(100)}), "more than 32"),
    ],
)
def test_a_file_that_is_not_a_contexts_file_is_refused_whole(tmp_path, data, why):
    """Garbage, another layout, a deeply nested or huge text, too many models: the file is
    refused with its reason, and every card keeps the default."""
    table = tmp_path / "table"
    table.mkdir(mode=0o700)
    (table / "contexts.json").write_bytes(data)
    contexts = ContextFile(table, shared=False, pool_id="1.1")
    contexts.read()
    assert why in contexts.refused["contexts.json"]
    assert contexts.records == []
    assert contexts.estimate(MODEL).context_bytes == CONTEXT_ESTIMATE_BYTES


def test_a_measurement_below_the_default_never_lowers_it(tmp_path):
    """A recorded 64 MiB context (or a hostile small one) leaves the estimate at the default:
    a short estimate risks an out-of-memory, a long one only costs packing."""
    table = tmp_path / "table"
    table.mkdir(mode=0o700)
    (table / "contexts.json").write_bytes(_file({MODEL: _entry(64 * MiB)}))
    contexts = ContextFile(table, shared=False, pool_id="1.1")
    contexts.read()
    assert contexts.records and contexts.estimate(MODEL).context_bytes == CONTEXT_ESTIMATE_BYTES


def test_shared_table_files_are_refused_unless_their_owner_wrote_them(tmp_path):
    """In a table shared by every user: a file whose name spells another uid than its owner's,
    a name that is no uid's spelling, and a symbolic link are refused; this user's own
    file is read. A note writes this user's file only, replaced whole, and only when larger."""
    table = tmp_path / "shared"
    table.mkdir()
    os.chmod(table, 0o1777)
    uid = os.geteuid()
    (table / f"contexts.uid{uid + 1}.json").write_bytes(_file({MODEL: _entry(4 * GiB)}))
    (table / "contexts.uid007.json").write_bytes(_file({MODEL: _entry(4 * GiB)}))
    (table / "elsewhere.json").write_bytes(_file({MODEL: _entry(4 * GiB)}))
    os.symlink(table / "elsewhere.json", table / f"contexts.uid{uid + 2}.json")
    contexts = ContextFile(table, shared=True, pool_id="1.1")
    contexts.read()
    assert "is not the uid its name spells" in contexts.refused[f"contexts.uid{uid + 1}.json"]
    assert "does not spell a uid" in contexts.refused["contexts.uid007.json"]
    assert "link" in contexts.refused[f"contexts.uid{uid + 2}.json"]
    assert contexts.estimate(MODEL).source == "estimated (default)"

    assert contexts.note(MODEL, GiB) is True
    assert contexts.note(MODEL, GiB) is False  # not larger: nothing written
    assert contexts.note(MODEL, CONTEXT_PLAUSIBLE_MAX_BYTES + 1) is False  # implausible
    mine = table / f"contexts.uid{uid}.json"
    assert oct(mine.stat().st_mode & 0o777) == "0o644"
    entries, refused = parse_context_file(mine.read_bytes(), uid=uid)
    assert refused == [] and entries[MODEL].context_bytes == GiB
    again = ContextFile(table, shared=True, pool_id="2.1")
    again.read()
    assert again.estimate(MODEL).context_bytes == GiB
    assert [p.name for p in table.iterdir() if p.name.endswith(".tmp")] == []


def test_names_that_are_not_short_printable_text_are_refused(tmp_path):
    """A program name with a terminal escape, or a model name past 96 characters, is refused
    (the source text goes into records and terminals): its entry does not count."""
    table = tmp_path / "table"
    table.mkdir(mode=0o700)
    escaped = {**_entry(2 * GiB), "program": "evil\x1b[31m.py"}
    (table / "contexts.json").write_bytes(_file({MODEL: escaped, "x" * 97: _entry(2 * GiB)}))
    contexts = ContextFile(table, shared=False, pool_id="1.1")
    contexts.read()
    assert "not a short printable name" in contexts.refused["contexts.json"]
    assert contexts.records == []


def test_a_larger_measurement_replaces_the_recorded_one_and_a_smaller_does_not(tmp_path):
    """A context that grew (700 MiB, then 900 MiB) is recorded at its largest; a second pool's
    smaller measurement (800 MiB) leaves the file as it is; the estimate is the largest."""
    table = tmp_path / "table"
    first = ContextFile(table, shared=False, pool_id="1.1")
    first.read()
    assert first.note(MODEL, 700 * MiB) and first.note(MODEL, 900 * MiB)
    second = ContextFile(table, shared=False, pool_id="2.1")
    second.read()
    assert second.note(MODEL, 800 * MiB) is False
    assert first.writes == 2 and second.writes == 0
    third = ContextFile(table, shared=False, pool_id="3.1")
    third.read()
    estimate = third.estimate(MODEL)
    assert estimate.context_bytes == 900 * MiB
    assert "pool 1.1" in estimate.source


def test_a_fifo_or_a_hard_linked_file_is_refused_without_blocking(tmp_path):
    """A FIFO under this user's contexts name (no writer: opening it to read would block) and a
    file with a second hard link are refused with their reasons, and the read returns; a FIFO
    in place of the lock leaves the file unwritten, saying why (it said nothing)."""
    fifo_table = tmp_path / "fifo"
    fifo_table.mkdir(mode=0o700)
    os.mkfifo(fifo_table / "contexts.json")
    contexts = ContextFile(fifo_table, shared=False, pool_id="1.1")
    contexts.read()
    assert "not a regular file" in contexts.refused["contexts.json"]

    linked_table = tmp_path / "linked"
    linked_table.mkdir(mode=0o700)
    (linked_table / "contexts.json").write_bytes(_file({MODEL: _entry(2 * GiB)}))
    os.link(linked_table / "contexts.json", tmp_path / "second-name.json")
    contexts = ContextFile(linked_table, shared=False, pool_id="1.1")
    contexts.read()
    assert "hard links" in contexts.refused["contexts.json"]
    assert contexts.estimate(MODEL).source == "estimated (default)"

    lock_table = tmp_path / "lock"
    lock_table.mkdir(mode=0o700)
    os.mkfifo(lock_table / "contexts.lock")
    contexts = ContextFile(lock_table, shared=False, pool_id="1.1")
    contexts.read()
    assert contexts.note(MODEL, GiB) is False
    assert contexts.problem is not None and "not a regular file" in contexts.problem
    assert not (lock_table / "contexts.json").exists()


def test_a_shared_directory_of_ten_thousand_files_is_read_within_its_bounds(tmp_path):
    """10,000 entries in a shared table's directory, every one named as some user's contexts
    file: at most 64 users' files are opened, among the first 4,096 entries, and the pool
    prices at the default."""
    table = tmp_path / "shared"
    table.mkdir()
    os.chmod(table, 0o1777)
    body = _file({MODEL: _entry(4 * GiB)})
    for uid in range(100_000, 110_000):
        (table / f"contexts.uid{uid}.json").write_bytes(body)
    contexts = ContextFile(table, shared=True, pool_id="1.1")
    contexts.read()
    opened = [name for name, why in contexts.refused.items() if "its owner" in why]
    assert 0 < len(opened) <= MAX_CONTEXT_FILES
    assert contexts.records == []
    assert contexts.estimate(MODEL).source == "estimated (default)"
