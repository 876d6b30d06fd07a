"""``gpupool postmortem``: logs of real simulated runs name the term that was wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpupool._commands.cli import main
from gpupool._core.units import GiB
from gpupool._observe.log_reader import iter_records
from gpupool._observe.postmortem import analyse_oom, read_postmortem


def _json(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    assert main(["postmortem", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["runs"]) == 1
    value: dict[str, Any] = report["runs"][0]
    return value


def test_underestimated_ask_is_named(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """An estimate of 2 GiB for 6.02 GiB tasks: every out-of-memory names the ask first."""
    report = _json(capsys, logs["ask"])
    assert report["out_of_memory"] >= 1
    for oom in report["ooms"]:
        assert oom["verdict"] == "ask"
        assert oom["task_ask_bytes"] == 2 * GiB
        assert oom["need_bytes"] > 6 * GiB
        assert oom["ask_shortfall_bytes"] == oom["need_bytes"] - 2 * GiB
    assert report["tasks_lost"] == 0
    assert report["retries"] == report["out_of_memory"]


def test_growing_co_tenant_is_named(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A co-tenant that grows 6 GiB after the census is named, by at least most of its growth."""
    report = _json(capsys, logs["co_tenant"])
    assert report["out_of_memory"] >= 1
    first = report["ooms"][0]
    assert first["verdict"] == "co_tenant"
    assert first["ask_shortfall_bytes"] == 0
    assert 4 * GiB < first["co_tenant_growth_bytes"] <= 6 * GiB
    assert first["own_separable"] is True


def test_growing_parent_is_outside_the_pool(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A parent that holds 6 GiB more mid-run: the growth is found outside the pool, not the ask."""
    report = _json(capsys, logs["own"])
    first = report["ooms"][0]
    assert first["ask_shortfall_bytes"] == 0
    assert first["verdict"] in {"co_tenant", "own"}
    assert 4 * GiB < first["co_tenant_growth_bytes"] + first["own_growth_bytes"] <= 6 * GiB


def test_growing_parent_is_named_own(logs: dict[str, Path]) -> None:
    """A parent that holds 6 GiB more mid-run is named as the pool's own process."""
    pm = read_postmortem(logs["own"])
    assert pm.ooms[0].verdict == "own"


def test_live_own_bytes_splits_own_from_co_tenant(logs: dict[str, Path]) -> None:
    """With live_own_bytes in a record (the field asked for), the arithmetic names own."""
    record = next(r for _, r in iter_records(logs["own"]) if r["event"] == "out_of_memory")
    priced = record.get("priced_own_high_water_bytes", record["own_high_water_bytes"])
    own = priced + 6 * GiB
    analysis = analyse_oom({**record, "live_own_bytes": own})
    assert analysis.verdict == "own"
    assert analysis.own_growth_bytes == 6 * GiB
    assert analysis.co_tenant_growth_bytes < GiB
    assert analysis.own_separable


def test_clean_run_summary(logs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The incident run: widths 1 -> 2, the ask goes estimated -> measured, nothing lost."""
    report = _json(capsys, logs["incident"])
    assert [w["width"] for w in report["widths"]] == [1, 2]
    (ask,) = report["asks"].values()
    bases = [h["basis"] for h in ask["history"]]
    assert bases[:2] == ["estimated", "measured"]
    assert set(bases[1:]) == {"measured"}  # the learned margin may move it again, measured
    assert abs(ask["history"][0]["ask_bytes"] - 9.9 * GiB) < 2
    assert report["out_of_memory"] == 0
    assert report["tasks_lost"] == 0
    assert main(["postmortem", str(logs["incident"])]) == 0
    text = capsys.readouterr().out
    assert "tasks lost: none" in text
    assert "widths over time: 1 at 0.00 s, 2 at" in text


def test_text_report_shows_the_card(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The words name the card's terms and the verdict for each out-of-memory."""
    assert main(["postmortem", str(logs["co_tenant"])]) == 0
    text = capsys.readouterr().out
    for label in (
        "card total",
        "co-tenant (census)",
        "own high-water",
        "booked ",
        "failing task's ask",
        "it had reached",
        "wrong term: co_tenant",
    ):
        assert label in text


def test_the_pools_width_is_the_cards_widths_after_each_turn(tmp_path: Path) -> None:
    """One turn of the pool moves several cards at one instant (a measurement shifts the
    ceiling's share from one card to another): their records share a ``time_s``. The pool's
    width at that instant is the sum after them all, never a sum half-way through the turn
    (which read 9 tasks at once under max_workers=8)."""
    run = {"schema": 3, "run_id": "20261202T000000Z-000000000001"}
    moves = [
        ("constructed", 0.0, 0, 0),
        ("constructed", 0.0, 1, 8),
        ("widened", 2.3, 0, 1),
        ("narrowed", 2.3, 1, 7),
        ("narrowed", 2.4, 0, 0),
        ("widened", 2.4, 1, 8),
        ("narrowed", 3.0, 1, 6),
    ]
    log = tmp_path / "turns.jsonl"
    log.write_text(
        "".join(
            json.dumps({**run, "event": e, "time_s": t, "device": d, "width_after": w}) + "\n"
            for e, t, d, w in moves
        )
    )
    pm = read_postmortem(log)
    assert [(t, int(w)) for t, w in pm.widths.points] == [(0.0, 8), (3.0, 6)]
    assert [(t, int(w)) for t, w in pm.device_widths[0].points] == [(0.0, 0), (2.3, 1), (2.4, 0)]
