"""What each record says: decision records built from the terms a rule produced.

Each builder takes the terms the rule that decided computed (a
:class:`~gpupool._core.planner.fit.Fit`, a
:class:`~gpupool._core.planner.fit.LiveGate`, a
:class:`~gpupool._core.planner.sharing.ShareWait`, ...) and states them; none
computes a figure of its own, so a record says what gated.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from gpupool._core.bound import Bound, Ceiling
from gpupool._core.events import Decision, JsonTable, JsonValue
from gpupool._core.peak import PeakReport
from gpupool._core.planner.fit import LiveGate
from gpupool._core.planner.oom import CapLift, Facts
from gpupool._core.planner.order import Hold
from gpupool._core.planner.samples import pool_rows, split_reading
from gpupool._core.planner.state import Card, Critical, Run
from gpupool._core.planner.verdicts import CardReading, Fail, Retry
from gpupool._core.units import format_size

__all__ = [
    "cap_lifted",
    "out_of_memory",
    "critical_wait",
    "peak_terms",
    "head_wait",
    "live_gate_wait",
    "shutdown",
]


def live_gate_wait(card: Card, gate: LiveGate, episodes: int) -> tuple[str, dict[str, JsonValue]]:
    """The live gate's wait: the sentence and the terms."""
    reason = (
        f"card {card.index}: {format_size(gate.free_bytes)} free now (+ "
        f"{format_size(gate.idle_worker_bytes)} the idle worker it would run in holds) does not "
        f"cover {format_size(gate.next_bytes)} ask + {format_size(gate.unreached_bytes)} not yet "
        f"reached by {gate.running} running here and {card.others_tasks} of other pools + "
        f"{format_size(gate.reserve_bytes)} reserve; the task waits ({episodes} shut "
        f"episode{'s' if episodes != 1 else ''} since the last such record)"
    )
    return reason, {
        "live_free_bytes": gate.free_bytes,
        "live_used_bytes": gate.used_bytes,
        "idle_worker_bytes": gate.idle_worker_bytes,
        "next_bytes": gate.next_bytes,
        "unreached_bytes": gate.unreached_bytes,
        "running": gate.running,
        "gate_episodes": episodes,
        "other_pools_unreached_bytes": card.others_unreached_bytes,
        "other_pools_tasks": card.others_tasks,
    }


def critical_wait(
    critical: Critical, held_key: str, device: int
) -> tuple[str, dict[str, JsonValue]]:
    """Other keys held back for the critical key: the sentence and the terms."""
    reason = (
        f"card {device}: {critical.key}'s pending tasks would take "
        f"{critical.time_left_s:.1f} s at {critical.width} at once, the most of any key "
        f"(the next: {critical.runner_up_time_left_s:.1f} s); one more of it fits here "
        f"once tasks of other keys end, so {held_key} waits rather than take that room"
    )
    return reason, {
        "critical_key": critical.key,
        "critical_time_left_s": round(critical.time_left_s, 3),
        "runner_up_time_left_s": round(critical.runner_up_time_left_s, 3),
        "critical_width": critical.width,
        "held_key": held_key,
    }


def head_wait(
    hold: Hold, card: Card, passed: int, waiting_s: float
) -> tuple[str, dict[str, JsonValue]]:
    """Room held for the queue's head: the sentence and the terms."""
    reason = (
        f"card {card.index}: a task of {hold.key} at the queue's head was passed {passed} "
        f"times by smaller tasks and has waited {waiting_s:.1f} s; "
        f"{format_size(hold.held_bytes)} is held for it there, freed by the end of "
        f"{len(hold.ending)} of the {len(card.runs)} running ({format_size(card.booked_bytes)} "
        "booked): other tasks start there only where they fit beside what stays then and it, "
        "so it starts as soon as those end"
    )
    return reason, {
        "held_key": hold.key,
        "held_bytes": hold.held_bytes,
        "head_passed": passed,
        "head_waiting_s": round(waiting_s, 3),
        "ending_runs": len(hold.ending),
        "running": len(card.runs),
        "booked_bytes": card.booked_bytes,
    }


def cap_lifted(card: Card, cap: int, lift: CapLift) -> tuple[str, dict[str, JsonValue]]:
    """An out-of-memory cap lifted: the sentence and the terms."""
    reason = (
        f"card {card.index}: the live reading shows {format_size(lift.not_pool_bytes)} on the "
        f"card that is not the pool's workers', within the bound's "
        f"{format_size(lift.priced_not_pool_bytes)} (co-tenants at the census, other pools, "
        f"own high-water) and its margin: the room the cap of {cap} was set for is back, so "
        "the cap lifts"
    )
    return reason, {
        "oom_cap_before": cap,
        "live_not_pool_bytes": lift.not_pool_bytes,
        "priced_not_pool_bytes": lift.priced_not_pool_bytes,
        "live_pool_bytes": lift.pool_bytes,
    }


def shutdown(
    now_s: float, width: int, counts: collections.Counter[str], *, tasks_lost: int
) -> Decision:
    """The run's totals, as the last record."""
    return Decision(
        event="shutdown",
        time_s=now_s,
        device=None,
        width_before=width,
        width_after=0,
        reason=(
            f"pool shut down after {counts['completed']} completed, {counts['failed']} "
            f"failed, {counts['cancelled']} cancelled tasks; {counts['oom']} out-of-memory, "
            f"{counts['retries']} retries, {counts['lost']} workers lost"
        ),
        extra={
            "tasks_completed": counts["completed"],
            "tasks_failed": counts["failed"],
            "tasks_cancelled": counts["cancelled"],
            "out_of_memory": counts["oom"],
            "retries": counts["retries"],
            "workers_lost": counts["lost"],
            # Futures the pool found unresolved when it stopped (it failed them).
            "tasks_lost": tasks_lost,
        },
    )


def peak_terms(report: PeakReport) -> dict[str, JsonValue]:
    """A measurement's terms: the peak, how the child measured it, and what its tree did."""
    return {
        "peak_bytes": report.device_peak_bytes,
        "peak_source": report.device_source,
        "baseline_bytes": report.baseline_bytes,
        "context_bytes": report.context_bytes,
        "context_source": report.context_source,
        "rss_peak_bytes": report.rss_peak_bytes,
        "rss_source": report.rss_source,
        "descendants": report.descendants,
        "outliving_descendants": report.outliving_descendants,
        "outliving_device_bytes": report.outliving_device_bytes,
        "rejected_readings": "; ".join(report.rejected_readings) or None,
    }


def out_of_memory(
    facts: Facts,
    outcome: Retry | Fail,
    card: Card | None,
    bound: Bound | None,
    ceiling: Ceiling,
    report: PeakReport,
    reading: CardReading | None,
    *,
    parent_pid: int | None,
    error: str,
    now_s: float,
) -> Decision:
    """An out-of-memory's record: what the task reached and was priced at, what the card held
    then, and what the planner does about it."""
    run = facts.run
    where = f"card {run.device if run.device is not None else '-'}"
    reason = (
        f"{where}: a task of {run.key} ran out of memory at "
        f"{format_size(facts.reached_bytes)} reached (asked for "
        f"{format_size(facts.requested_bytes)} more), started at its ask "
        f"{format_size(run.ask_bytes)} (booked {format_size(run.booked_at_start_bytes)}) "
        f"beside {facts.running_then - 1} other running; live "
        f"{format_size(reading.used_bytes if reading else None)} used, "
        f"{format_size(reading.free_bytes if reading else None)} free; {outcome.reason}"
    )
    # The card's width when it ran out: the record of the width's move (a raised price,
    # a cap) follows this one.
    width = card.width if card is not None else facts.running_then
    return Decision(
        event="out_of_memory",
        time_s=now_s,
        device=run.device,
        width_before=width,
        width_after=width,
        reason=reason,
        bound=bound,
        ceiling=ceiling,
        key=run.key,
        key_ask=facts.key_ask_after,
        limit="out_of_memory",
        extra=_oom_terms(facts, outcome, card, bound, report, reading, parent_pid, error),
    )


def _oom_terms(
    facts: Facts,
    outcome: Retry | Fail,
    card: Card | None,
    bound: Bound | None,
    report: PeakReport,
    reading: CardReading | None,
    parent_pid: int | None,
    error: str,
) -> dict[str, JsonValue]:
    """An out-of-memory record's terms: the card's reading split by whose bytes they are
    (the pool's own never a co-tenant's), and each task running there with its booking."""
    run = facts.run
    split, rows = None, None
    if reading is not None and card is not None:
        extra = frozenset({run.pid}) if run.pid is not None else frozenset()
        split = split_reading(card, reading, parent_pid, extra_pids=extra)
        rows = pool_rows(card, reading, parent_pid, extra_pids=extra)
    return {
        "task_ask_bytes": run.ask_bytes,
        "task_booked_bytes": run.booked_at_start_bytes,
        "ask_before_bytes": facts.key_ask_before.ask_bytes,
        "ask_after_bytes": facts.key_ask_after.ask_bytes,
        "reached_bytes": report.device_peak_bytes,
        "requested_bytes": report.oom_requested_bytes,
        "live_free_bytes": reading.free_bytes if reading else None,
        "live_used_bytes": reading.used_bytes if reading else None,
        "live_own_bytes": split.own_bytes if split else None,
        "live_pool_bytes": split.pool_bytes if split else None,
        "live_running_bytes": split.running_bytes if split else None,
        "live_co_tenant_bytes": split.co_tenant_bytes if split else None,
        "census_co_tenant_bytes": bound.co_tenant_bytes if bound else None,
        "priced_own_high_water_bytes": facts.priced_own_high_water_bytes,
        "other_pools_bytes": card.others_bytes if card else None,
        "other_pools_held_bytes": card.others_held_bytes if card else None,
        "other_pools_overrun_bytes": card.others_overrun_bytes if card else None,
        "other_pools_tasks": card.others_tasks if card else None,
        # What the card's runs were booked at when each started (not re-priced at an ask
        # the out-of-memory raised), and each of them.
        "booked_bytes": facts.booked_bytes,
        "runs": _runs_table(run, card, rows),
        "running": facts.running_then,
        "tries": facts.tries,
        "retry": isinstance(outcome, Retry),
        "outcome": outcome.kind if isinstance(outcome, Fail) else "retry",
        "oom_cap": card.oom_cap if card else None,
        "error": error[:500],
    }


def _runs_table(failed: Run, card: Card | None, rows: Mapping[int, int] | None) -> JsonTable:
    """Each task running on the card when ``failed`` ran out, ``failed`` first: its key, its
    ask and booking when it started, its booking now, and its row in the reading (``rows``;
    ``None`` where they cannot tell the pool's bytes)."""
    runs = [failed, *(card.runs.values() if card is not None else ())]
    return [
        {
            "key": run.key,
            "pid": run.pid,
            "failed": run is failed,
            "started_s": round(run.started_s, 6),
            "ask_bytes": run.ask_bytes,
            "booked_bytes": run.booked_at_start_bytes,
            "booked_now_bytes": run.booked_bytes,
            "held_bytes": rows.get(run.pid, 0)
            if rows is not None and run.pid is not None
            else None,
        }
        for run in runs
    ]
