"""The overhead and card benchmarks run end to end at their smallest sizes, and say what they claim.

Each test runs one script in a child process with tiny sizes and checks the
shape of its ``--json`` figures: every executor or pool is there, and every
ratio is a finite positive number. The figures themselves are not judged
(timings on a loaded machine); the scenario's facts that do not depend on
timing are.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(script: str, tmp_path: Path, *args: str) -> Any:
    out = tmp_path / f"{script}.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the script printed no table"
    return json.loads(out.read_text())


def test_most_at_once_counts_overlapping_windows_and_not_touching_ones() -> None:
    """Windows that only touch (one ends as the next starts) are not at once; nested ones are."""
    sys.path.insert(0, str(BENCH))
    try:
        from spread_peaks import key_asks, most_at_once
    finally:
        sys.path.remove(str(BENCH))
    assert most_at_once([]) == 0
    assert most_at_once([(0.0, 1.0), (1.0, 2.0)]) == 1
    assert most_at_once([(0.0, 3.0), (1.0, 2.0), (1.5, 4.0), (3.5, 5.0)]) == 3
    records = [
        {"event": "constructed", "key": None, "key_ask_bytes": None},
        {"event": "widened", "key": "m.spread", "key_ask_bytes": 5, "samples": 1},
        {"event": "card_read", "key": "m.spread", "key_ask_bytes": 5},
        {"event": "narrowed", "key": "m.spread", "key_ask_bytes": 9, "samples": 2},
        {"event": "widened", "key": "m.other", "key_ask_bytes": 1},
    ]
    assert [(m["event"], m["ask_bytes"]) for m in key_asks(records)] == [
        ("widened", 5),
        ("narrowed", 9),
    ]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_overhead_reports_every_executor_on_every_figure(tmp_path: Path) -> None:
    """The default mode measures the five executors on no-op, payload and first-result figures,
    each with a positive ratio to the standard pool (spawn) and to loky."""
    report = _run("overhead.py", tmp_path, "--tasks", "20", "--payload-tasks", "3", "--repeat", "1")
    executors = {
        "stdlib (spawn)",
        "stdlib (forkserver)",
        "loky",
        "gpupool (host)",
        "gpupool (simulated card)",
    }
    assert set(report["executors"]) == executors
    assert report["payload_bytes"] == 2**20
    for figure in ("noop_s", "payload_s", "first_result_s"):
        for ratios in ("ratio_to_stdlib_spawn", "ratio_to_loky"):
            assert set(report[figure][ratios]) == executors, figure
            assert all(_positive(v) for v in report[figure][ratios].values()), (figure, ratios)
        assert report[figure]["ratio_to_stdlib_spawn"]["stdlib (spawn)"] == 1.0
        assert all(len(v) == 1 for v in report[figure]["runs"].values())


@pytest.mark.slow
def test_overhead_scaling_mode_still_runs(tmp_path: Path) -> None:
    """``--scaling`` (each run in a fresh process) still reports a row per executor."""
    report = _run(
        "overhead.py",
        tmp_path,
        "--scaling",
        "--task-counts",
        "20",
        "--worker-counts",
        "2",
    )
    assert report["mode"] == "scaling"
    assert len(report["rows"]) == 4
    assert all(_positive(row["per_task_s"]) for row in report["rows"])


@pytest.mark.slow
def test_short_tasks_compares_gpupool_with_the_best_fixed_width(tmp_path: Path) -> None:
    """gpupool's makespan over the best fixed width is a positive ratio, and the standard pool at
    a width the card holds loses no task."""
    report = _run(
        "short_tasks.py",
        tmp_path,
        "--tasks",
        "8",
        "--rounds",
        "1",
        "--widths",
        "2,4",
        "--hold-ms",
        "5",
    )
    assert set(report["rows"]) == {
        "gpupool",
        "stdlib 2",
        "stdlib 4",
        "gpupool width=2",
        "gpupool width=4",
    }
    assert report["rows"]["stdlib 2"]["lost"] == 0
    assert report["rows"]["stdlib 4"]["lost"] == 0
    assert report["rows"]["gpupool"]["lost"] == 0
    assert report["best_stdlib"] in {"stdlib 2", "stdlib 4"}
    assert _positive(report["ratio_to_best_stdlib"])
    assert _positive(report["ratio_to_best_gpupool_fixed"])


@pytest.mark.slow
def test_spread_peaks_reads_the_keys_ask_from_the_decision_log(tmp_path: Path) -> None:
    """After a cycle of measured peaks the key has a measured ask in the log, the card's room is
    read beside it, and at least one task ran."""
    report = _run("spread_peaks.py", tmp_path, "--tasks", "6", "--hold-s", "0.05")
    (only,) = report["rounds"]
    assert _positive(only["final_ask_bytes"])
    assert _positive(only["max_ask_bytes"])
    assert _positive(only["room_bytes"])
    assert only["ask_moves"], "no record of the key's ask"
    assert only["ask_moves"][-1]["basis"] == "measured"
    assert only["most_at_once"] >= 1
    assert only["ooms"] == 0
    assert isinstance(report["ask_within_room"], bool)


@pytest.mark.slow
def test_four_pools_report_tasks_per_pool_and_the_longest_wait(tmp_path: Path) -> None:
    """Four pools run side by side; the report has each pool's tasks, the least/most ratio in
    [0, 1] and a longest wait."""
    report = _run(
        "four_pools.py",
        tmp_path,
        "--duration",
        "3",
        "--task-s",
        "0.1",
        "--room-wait-s",
        "5",
        "--logs",
        str(tmp_path / "logs"),
    )
    (only,) = report["rounds"]
    assert [p["kind"] for p in only["pools"]] == ["steady", "steady", "steady", "spread"]
    assert max(only["tasks_run"]) > 0
    assert 0.0 <= only["least_over_most"] <= 1.0
    assert _positive(only["longest_wait_s"])
    assert all(p["failed"] == 0 for p in only["pools"])


@pytest.mark.slow
def test_profile_dispatch_profiles_the_dispatcher_thread(tmp_path: Path) -> None:
    """The profile covers the dispatcher thread's steps: its scheduling pass and at least two
    other steps of interest, each with positive calls and time per task."""
    report = _run("profile_dispatch.py", tmp_path, "--tasks", "40", "--rounds", "1")
    rows = {row["function"]: row for row in report["of_interest"]}
    assert "Dispatcher._schedule" in rows, sorted(rows)
    assert len(rows) >= 3, sorted(rows)
    for step, row in rows.items():
        assert _positive(row["calls"]) and _positive(row["cum_us"]), step
    assert _positive(report["thread_own_per_task_us"])
    assert report["top"], "no other gpupool function in the profile"
