"""Which per-process rows are measurements, and how a rejection reaches the decision log."""

from __future__ import annotations

import pytest

from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import Planner, PlannerConfig, Start
from gpupool._core.policy import AskTable, Policy
from gpupool._core.readings import CONTEXT_FLOOR_BYTES, judge_tree_rows
from gpupool._core.units import GiB, MiB
from support import card_census, census_of

WORKER, CHILD, OTHER = 1000, 1001, 2000


def test_the_tree_is_the_sum_of_its_processes_rows():
    """The worker's row and its child's add up; a stranger's row is not the tree's."""
    rows = [(WORKER, 300 * MiB), (CHILD, 8 * GiB), (OTHER, 5 * GiB)]
    judged = judge_tree_rows(rows, {WORKER, CHILD}, device_used_bytes=20 * GiB)
    assert judged.tree_bytes == 8 * GiB + 300 * MiB
    assert judged.reasons == ()


def test_a_tree_without_rows_has_no_reading():
    """No row of any member (no context anywhere in the tree) is no measurement, and no fault."""
    judged = judge_tree_rows([(OTHER, GiB)], {WORKER}, device_used_bytes=GiB)
    assert (judged.tree_bytes, judged.reasons) == (None, ())


@pytest.mark.parametrize("pid", [0, 0xFFFFFFFF])
def test_an_impossible_pid_rejects_the_whole_list(pid):
    """A list holding PID 0 or 0xFFFFFFFF was misread: even a plausible member row is not taken."""
    judged = judge_tree_rows([(WORKER, 2 * GiB), (pid, GiB)], {WORKER}, device_used_bytes=20 * GiB)
    assert judged.tree_bytes is None
    assert f"PID {pid}," in judged.reasons[0]


@pytest.mark.parametrize("used", [0, 16_040, CONTEXT_FLOOR_BYTES - 1])
def test_a_member_row_below_the_context_floor_leaves_the_tree_unknown(used):
    """A member row smaller than any context makes the whole tree's figure unknown, not smaller."""
    judged = judge_tree_rows(
        [(WORKER, 2 * GiB), (CHILD, used)], {WORKER, CHILD}, device_used_bytes=20 * GiB
    )
    assert judged.tree_bytes is None
    assert judged.reasons == (
        f"PID {CHILD}'s row says {used} bytes, less than any CUDA context "
        f"({CONTEXT_FLOOR_BYTES} bytes): a misread or withheld figure, not a measurement",
    )


def test_a_row_of_exactly_the_floor_is_a_measurement():
    """The floor itself is a plausible (if small) context."""
    judged = judge_tree_rows([(WORKER, CONTEXT_FLOOR_BYTES)], {WORKER}, device_used_bytes=GiB)
    assert judged.tree_bytes == CONTEXT_FLOOR_BYTES


def test_a_member_row_without_a_figure_leaves_the_tree_unknown():
    """A row whose bytes the driver does not say (WDDM, MIG) is not taken as 0, and the
    reason names it."""
    judged = judge_tree_rows(
        [(WORKER, 2 * GiB), (CHILD, None)], {WORKER, CHILD}, device_used_bytes=20 * GiB
    )
    assert judged.tree_bytes is None
    assert judged.reasons == (
        f"PID {CHILD}'s row has no figure (the driver's \"not available\", as on a MIG "
        "instance): not a measurement",
    )


def test_rows_above_the_devices_used_bytes_are_rejected_and_unknown_used_is_no_bound():
    """The tree cannot hold more than the device's used bytes; without a used figure, no check."""
    rows = [(WORKER, 6 * GiB), (CHILD, 6 * GiB)]
    judged = judge_tree_rows(rows, {WORKER, CHILD}, device_used_bytes=10 * GiB)
    assert judged.tree_bytes is None
    assert "more than the 10737418240 bytes in use on the whole device" in judged.reasons[0]
    assert judge_tree_rows(rows, {WORKER, CHILD}, device_used_bytes=None).tree_bytes == 12 * GiB


def _started_planner(records: list[Decision], tasks: int) -> Planner:
    census = census_of(
        [card_census(total_bytes=40 * GiB, free_bytes=40 * GiB)],
        cpus=8,
        available_ram_bytes=64 * GiB,
    )
    asks = AskTable(policy=Policy(reserve_bytes=0), default_estimate_bytes=4 * GiB)
    config = PlannerConfig(max_workers=4, reserve_bytes=0, parent_pid=1)
    planner = Planner(census=census, asks=asks, config=config, emit=records.append)
    planner.construct(0.0)
    for task in range(tasks):
        planner.submit(task, "k")
    for _ in range(tasks):
        verdict = planner.next_start(0.1)
        assert isinstance(verdict, Start)
        planner.started(verdict.task, verdict.device, 100 + verdict.task, 0.1)
    return planner


def test_a_report_with_no_trusted_reading_says_why_in_the_log():
    """A task whose rows were all rejected leaves its ask alone and the log names the rejection."""
    records: list[Decision] = []
    planner = _started_planner(records, 1)
    reason = "PID 1000's row says 16040 bytes, less than any CUDA context"
    report = PeakReport(
        device=0, device_peak_bytes=None, device_source="none", rejected_readings=(reason,)
    )
    planner.finished(0, report, 0.2)
    errors = [r for r in records if r.event == "sensor_error"]
    assert len(errors) == 1
    assert reason in errors[0].reason
    assert reason in str(errors[0].to_dict()["error"])
    assert planner.state.asks.ask("k").basis == "estimated"


def test_outliving_descendants_and_rejections_are_recorded_once_per_key():
    """A report naming a descendant left running is recorded even when no width or ask moves."""
    records: list[Decision] = []
    planner = _started_planner(records, 3)
    plain = PeakReport(device=0, device_peak_bytes=3 * GiB, device_source="simulator")
    planner.finished(0, plain, 0.2)  # the first measurement: recorded (basis changed)
    before = len(records)
    left = PeakReport(
        device=0,
        device_peak_bytes=3 * GiB,
        device_source="simulator",
        descendants=1,
        outliving_descendants=1,
        outliving_device_bytes=GiB,
        rejected_readings=("a reason",),
    )
    planner.finished(1, left, 0.3)
    noted = [r.to_dict() for r in records[before:] if r.key == "k"]
    assert len(noted) == 1
    assert noted[0]["outliving_descendants"] == 1
    assert noted[0]["outliving_device_bytes"] == GiB
    assert noted[0]["rejected_readings"] == "a reason"
    assert "1 process(es) the task started outlived it, holding 1.00 GiB" in noted[0]["reason"]
    after = len(records)
    planner.finished(2, left, 0.4)  # the same news for the same key: not again
    assert [r for r in records[after:] if r.key == "k"] == []
