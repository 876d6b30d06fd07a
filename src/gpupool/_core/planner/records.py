"""What each record says: decision records built from the terms a rule produced.

Each builder takes the terms the rule that decided computed (a
:class:`~gpupool._core.planner.fit.Fit`, a :class:`~gpupool._core.planner.fit.LiveGate`, a
:class:`~gpupool._core.planner.sharing.ShareWait`, ...) and states them; none computes a figure of
its own, so a record says what gated.
"""

from __future__ import annotations

import collections

from gpupool._core.events import Decision, JsonValue, truncate_text
from gpupool._core.peak import PeakReport
from gpupool._core.planner.fit import LiveGate
from gpupool._core.planner.order import Hold
from gpupool._core.planner.state import Card, Critical
from gpupool._core.policy import Ask
from gpupool._core.predict import Features, Fit
from gpupool._core.units import format_size

__all__ = [
    "critical_wait",
    "outlier",
    "predicted",
    "peak_terms",
    "head_wait",
    "live_gate_wait",
    "shutdown",
]


def predicted(key: str, fit: Fit | None, before: Fit | None) -> tuple[str, dict[str, JsonValue]]:
    """A feature of the calls began (or stopped) to explain ``key``'s peaks: the sentence and
    the fit's terms (the feature, the line, its error)."""
    if fit is None:
        assert before is not None
        reason = (
            f"{key}: {before.feature} no longer explains the peaks; its tasks are priced by the "
            "key's distribution"
        )
        return reason, {"feature": before.feature, "predicted": False}
    reason = f"{key}: {fit.describe()}; each task is priced from its own {fit.feature}"
    return reason, {
        "feature": fit.feature,
        "predicted": True,
        "samples": fit.samples,
        "slope_bytes_per_unit": fit.slope_bytes,
        "intercept_bytes": round(fit.intercept_bytes),
        "fit_error_bytes": round(fit.error_bytes),
        "r2": round(fit.r2, 6),
    }


def outlier(
    key: str, peak_bytes: int, features: Features, ask: Ask
) -> tuple[str, dict[str, JsonValue]]:
    """A peak far outside ``key``'s distribution, kept apart: the sentence and the terms."""
    said = ", ".join(f"{name} {value:g}" for name, value in features[:4]) or "no features"
    reason = (
        f"{key}: a task peaked at {format_size(peak_bytes)}, far outside the key's "
        f"{ask.samples} other peaks (mean {format_size(ask.mean_bytes)}, largest "
        f"{format_size(ask.measured_peak_bytes)}): an outlier, kept apart (its call: {said}); "
        f"{ask.outliers} so far, rate {ask.outlier_rate:.3g}; the key stays at {ask.describe()}"
    )
    return reason, {
        "outlier_peak_bytes": peak_bytes,
        "outliers": ask.outliers,
        "outlier_rate": round(ask.outlier_rate, 6),
        "mean_peak_bytes": ask.mean_bytes,
        "largest_peak_bytes": ask.measured_peak_bytes,
        "samples": ask.samples,
    }


def live_gate_wait(card: Card, gate: LiveGate, episodes: int) -> tuple[str, dict[str, JsonValue]]:
    """The live gate's wait: the sentence and the terms."""
    reason = (
        f"card {card.index}: {format_size(gate.free_bytes)} free now (+ "
        f"{format_size(gate.idle_worker_bytes)} the idle worker it would run in holds) does not "
        f"cover {format_size(gate.next_bytes)} ask + {format_size(gate.unreached_bytes)} not yet "
        f"reached by {gate.running} running here and {card.pools.others_tasks} of other pools + "
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
        "other_pools_unreached_bytes": card.pools.others_unreached_bytes,
        "other_pools_tasks": card.pools.others_tasks,
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
        f"{len(hold.ending)} of the {len(card.runs)} running "
        f"({format_size(card.sums.booked_bytes)} booked): other tasks start there only where "
        "they fit beside what stays then and it, "
        "so it starts as soon as those end"
    )
    return reason, {
        "held_key": hold.key,
        "held_bytes": hold.held_bytes,
        "head_passed": passed,
        "head_waiting_s": round(waiting_s, 3),
        "ending_runs": len(hold.ending),
        "running": len(card.runs),
        "booked_bytes": card.sums.booked_bytes,
    }


def shutdown(
    now_s: float,
    width: int,
    counts: collections.Counter[str],
    *,
    tasks_lost: int,
    refused: str | None = None,
) -> Decision:
    """The run's totals, as the last record; ``refused``: the error that refused the pool as
    it was built (strict mode's first width), so that the run it started ends too."""
    totals = (
        f"{counts['completed']} completed, {counts['failed']} failed, {counts['cancelled']} "
        f"cancelled tasks; {counts['oom']} out-of-memory, {counts['retries']} retries, "
        f"{counts['lost']} workers lost"
    )
    extra: dict[str, JsonValue] = {
        "tasks_completed": counts["completed"],
        "tasks_failed": counts["failed"],
        "tasks_cancelled": counts["cancelled"],
        "out_of_memory": counts["oom"],
        "retries": counts["retries"],
        "workers_lost": counts["lost"],
        # Futures the pool found unresolved when it stopped (it failed them).
        "tasks_lost": tasks_lost,
    }
    reason = f"pool shut down after {totals}"
    if refused is not None:
        extra["refused"] = truncate_text(refused)
        reason = f"pool refused as it was built, before any task ran: {refused}"
    return Decision(
        event="shutdown",
        time_s=now_s,
        device=None,
        width_before=width,
        width_after=0,
        reason=reason,
        extra=extra,
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
        "peak_incomplete": report.incomplete,
        "incomplete_reason": report.incomplete_reason,
        "card_used_peak_bytes": report.card_used_peak_bytes,
    }
