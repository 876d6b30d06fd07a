"""One user's contexts file alone never raises another user's context figure: in a table shared
by every user, another user's recorded context counts only where a second user recorded as much.

Real files owned by real other uids (``nobody``'s written by a forked child that became
``nobody``, through the pool's own write path; a third uid's made its owner by root), real
spawned pools on simulated cards with the allocator cap on; skipped with the reason where the
suite does not run as root. The rule itself is also tested on validated records (no root).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from second_user import NOBODY, Forked, needs_nobody

import standin_torch
from gpupool import GpuPoolExecutor
from gpupool._core.contexts import (
    CONTEXT_ESTIMATE_BYTES,
    CONTEXT_PLAUSIBLE_MAX_BYTES,
    ContextRecord,
    decide_context_estimate,
)
from gpupool._core.units import GiB, MiB
from gpupool._sensors.contexts import ContextFile
from gpupool.testing import SimulatedDevice, SimulatedHost

MODEL = "Simulated GPU"
#: A uid with no passwd entry: a third user, made a file's owner by root.
THIRD_UID = 4242
ME = os.geteuid()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky 1777 table directory other users can write in (pytest's are private)."""
    root = Path(tempfile.mkdtemp(prefix="gpupool-contexts-"))
    root.chmod(0o755)
    directory = root / "table"
    directory.mkdir()
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(root, ignore_errors=True)


def _by_hand(directory: Path, uid: int, context_bytes: int) -> Path:
    """A contexts file written by hand for ``uid`` (well formed), made ``uid``'s by root."""
    entry = {"context_bytes": context_bytes, "program": "evil.py", "pool": "1.1", "time_s": 1.0}
    path = directory / f"contexts.uid{uid}.json"
    path.write_text(json.dumps({"version": 1, "models": {MODEL: entry}}))
    os.chown(path, uid, uid)
    path.chmod(0o644)
    return path


def _noted_by_nobody(directory: Path, context_bytes: int) -> None:
    """``nobody``'s pool measured ``context_bytes``: a child that became ``nobody`` writes it
    through the pool's own write path."""

    def work() -> None:
        if not ContextFile(directory, shared=True, pool_id="9.1").note(MODEL, context_bytes):
            raise RuntimeError("nobody's note wrote nothing")

    child = Forked(work, user=NOBODY)
    child.close()
    assert child.line == "ready", child.line
    assert (directory / f"contexts.uid{NOBODY[0]}.json").stat().st_uid == NOBODY[0]  # type: ignore[index]


def _capped_pool(directory: Path) -> tuple[list[dict], dict]:
    """Four capped torch tasks of 1 GiB, the first priced at 4 GiB, on a 16 GiB card whose rows
    are hidden (the context is estimated) in the shared table, one worker (its first cap is
    the 4 GiB booking's): what each saw of the cap, and the last context record."""
    host = SimulatedHost([SimulatedDevice("16GiB")], context="500MiB", container=True)
    with host:
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="4GiB",
            reserve=0,
            cap_allocator=True,
            share_bookings="host",
            bookings_dir=directory,
            initializer=standin_torch.install_in_worker,
            initargs=(16 * GiB, True),
        ) as ex:
            futures = [ex.submit(standin_torch.capped_task, GiB) for _ in range(4)]
            seen = [f.result(timeout=120) for f in futures]
            records = [d.to_dict() for d in ex.decisions if "context_source" in d.to_dict()]
    assert [s["outcome"] for s in seen] == ["ok"] * 4, seen[0]["state"]
    assert records, "no task's peak was measured"
    return seen, records[-1]


def _read(directory: Path) -> ContextFile:
    contexts = ContextFile(directory, shared=True, pool_id="2.1")
    contexts.read()
    return contexts


@needs_nobody
@pytest.mark.slow
def test_one_users_6_gib_figure_alone_changes_nothing(shared_dir):
    """Another user's hand-written 6 GiB context, matched by no second user: the figure stays
    the default, the cap leaves torch its booking less 640 MiB, and the 4 tasks all succeed
    (before: the cap left torch nothing and all 4 ran out of memory); the refusals name it."""
    assert NOBODY is not None
    _by_hand(shared_dir, NOBODY[0], CONTEXT_PLAUSIBLE_MAX_BYTES)
    seen, record = _capped_pool(shared_dir)
    assert (record["context_bytes"], record["context_source"]) == (
        CONTEXT_ESTIMATE_BYTES,
        "estimated (default)",
    )
    for s in seen:
        assert s["state"]["outside_bytes"] == CONTEXT_ESTIMATE_BYTES
        assert s["state"]["outside_source"] == "estimated (default)"
    assert seen[0]["fractions"][0][0] == (4 * GiB - CONTEXT_ESTIMATE_BYTES) / (16 * GiB)
    why = _read(shared_dir).refused[f"contexts.uid{NOBODY[0]}.json"]
    assert f"context_bytes {CONTEXT_PLAUSIBLE_MAX_BYTES} is not corroborated" in why


@needs_nobody
def test_another_users_larger_figure_does_not_stop_this_user_recording(shared_dir):
    """This user's own 1 GiB measurement is recorded beside another user's 6 GiB figure (a
    larger foreign figure must not keep it out: this user's file is what corroborates an
    honest one), and this user's pools then price at their own 1 GiB."""
    assert NOBODY is not None
    _by_hand(shared_dir, NOBODY[0], CONTEXT_PLAUSIBLE_MAX_BYTES)
    contexts = _read(shared_dir)
    assert contexts.note(MODEL, GiB) is True
    estimate = _read(shared_dir).estimate(MODEL)
    assert estimate.context_bytes == GiB
    assert estimate.source.startswith(
        f"estimated (largest measured on {MODEL}: 1.00 GiB, by uid {ME} ("
    )


@needs_nobody
@pytest.mark.slow
def test_two_users_agreeing_raise_the_figure_to_what_both_measured(shared_dir):
    """``nobody`` measured 1.5 GiB (written by its own process), a third user 2 GiB: the figure
    is 1.5 GiB (what both recorded at least), the cap uses it, the tasks succeed, and the
    third user's 2 GiB, matched by no one, is named among the refusals."""
    assert NOBODY is not None
    _noted_by_nobody(shared_dir, 1536 * MiB)
    _by_hand(shared_dir, THIRD_UID, 2 * GiB)
    seen, record = _capped_pool(shared_dir)
    assert record["context_bytes"] == 1536 * MiB
    assert record["context_source"].startswith(
        f"estimated (largest measured on {MODEL} by two users: 1.50 GiB, by uid {NOBODY[0]} ("
    )
    assert record["context_source"].endswith(
        f"uid {THIRD_UID} (evil.py, pool 1.1) measured 2.00 GiB)"
    )
    for s in seen:
        assert s["state"]["outside_bytes"] == 1536 * MiB
        assert s["state"]["outside_source"] == record["context_source"]
    assert seen[0]["fractions"][0][0] == (4 * GiB - 1536 * MiB) / (16 * GiB)
    refused = _read(shared_dir).refused
    assert (
        f"context_bytes {2 * GiB} is not corroborated" in refused[f"contexts.uid{THIRD_UID}.json"]
    )
    assert f"contexts.uid{NOBODY[0]}.json" not in refused


# -- the rule, on validated records (no second user needed) ---------------------------------


def _record(uid: int, context_bytes: int, model: str = MODEL) -> ContextRecord:
    return ContextRecord(
        model=model, context_bytes=context_bytes, uid=uid, program="x.py", pool="1.1", time_s=1.0
    )


@pytest.mark.parametrize(
    ("records", "figure", "source", "set_aside"),
    [
        ([], CONTEXT_ESTIMATE_BYTES, "default", []),
        ([_record(7, 6 * GiB)], CONTEXT_ESTIMATE_BYTES, "default", [7]),
        ([_record(7, 6 * GiB), _record(7, 5 * GiB)], CONTEXT_ESTIMATE_BYTES, "default", [7]),
        ([_record(7, 6 * GiB), _record(8, GiB)], GiB, "two users", [7]),
        ([_record(7, 6 * GiB), _record(8, 6 * GiB)], 6 * GiB, "two users", []),
        ([_record(ME, 2 * GiB), _record(7, 6 * GiB)], 2 * GiB, "own", [7]),
        (
            [_record(ME, 2 * GiB), _record(7, 3 * GiB), _record(8, 4 * GiB)],
            3 * GiB,
            "two users",
            [8],
        ),
        ([_record(ME, 3 * GiB), _record(7, 2 * GiB), _record(8, 2 * GiB)], 3 * GiB, "own", []),
        (
            [_record(7, 6 * GiB), _record(8, 6 * GiB, "Other")],
            CONTEXT_ESTIMATE_BYTES,
            "default",
            [7],
        ),
        ([_record(7, 100 * MiB), _record(8, 200 * MiB)], CONTEXT_ESTIMATE_BYTES, "default", []),
    ],
)
def test_the_figure_is_the_default_this_users_own_or_what_two_users_agree_on(
    records, figure, source, set_aside
):
    """The largest of the default, this user's own largest, and the second-largest of the
    per-user largest; another user's larger figure is set aside, never used."""
    estimate = decide_context_estimate(records, MODEL, uid=ME)
    assert estimate.context_bytes == figure
    expected = {
        "default": "estimated (default)",
        "own": f"estimated (largest measured on {MODEL}: ",
        "two users": f"estimated (largest measured on {MODEL} by two users: ",
    }[source]
    assert estimate.source.startswith(expected)
    assert [r.uid for r in estimate.set_aside] == set_aside
