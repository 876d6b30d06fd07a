"""What an ended task teaches the planner: its peaks, learned once per turn (pure core).

A task that ends with a peak report is a sample of its key's peaks. Its booking is released at once
(:meth:`~.planner.Planner.ended`), and its peak is kept; what the peaks teach is priced once for all
the tasks of the key that ended since (:meth:`Learning.settle`): the key's ask takes them as samples
and is derived once, its running tasks are booked at that ask, and the widths are reviewed once,
with a record where the ask or a width moved. Until then the key's ask is the one before them. The
dispatcher settles at the top of each turn of its loop, before it reads a card, starts a task,
publishes the pool's state or delivers a result, so every start, width and record of a turn is
priced with every measurement received before it; :meth:`~.planner.Planner.finished` (an end and its
settle at once) is the same for a caller driving the planner itself.

A learned ask is never priced past the room for one task of the tightest card that holds
its largest peak (:func:`rooms_alone_bytes`), and a key whose peaks vary a lot is named
once in a ``peaks_vary`` record (:func:`varied_peaks`): its tasks are not one workload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpupool._core.bound import Ceiling, derive_bound
from gpupool._core.events import Decision, EventName, JsonValue, TaskIdentity
from gpupool._core.peak import PeakReport
from gpupool._core.planner import records
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.fit import host_per_task_bytes
from gpupool._core.planner.samples import Recorder
from gpupool._core.planner.state import Card, Run
from gpupool._core.planner.verdicts import ASK_RECORD_STEP, Refuse
from gpupool._core.planner.views import Views
from gpupool._core.policy import VARY_RATIO, Ask, peaks_vary
from gpupool._core.predict import Features, Fit
from gpupool._core.units import format_size

__all__ = ["Learning", "rooms_alone_bytes", "varied_peaks"]


def rooms_alone_bytes(
    cards: Sequence[Card], *, reserve_bytes: int, ceiling: Ceiling
) -> tuple[int, ...]:
    """The room one task has on each readable card of ``cards`` once the other pools there drained:
    ``total - co_tenant - own_high_water - reserve`` (less a task's child RSS on unified memory)."""
    rooms: list[int] = []
    for card in cards:
        bound = derive_bound(
            card.census,
            own_high_water_bytes=card.live.own_high_water_bytes,
            reserve_bytes=reserve_bytes,
            ask_bytes=1,
            ask_basis="estimated",
            other_pools_at_census_bytes=card.pools.others_at_census_bytes,
        )
        if bound.room_bytes is not None:
            rooms.append(bound.room_bytes - host_per_task_bytes(card, ceiling))
    return tuple(rooms)


def varied_peaks(ask: Ask) -> tuple[str, dict[str, JsonValue]] | None:
    """The ``peaks_vary`` record's sentence and terms for a measured key whose peaks vary a
    lot, else ``None`` (also for a key whose tasks carry sizes: its asks are predicted per
    size, so the advice to give sizes is not for it)."""
    largest, least = ask.measured_peak_bytes, ask.least_peak_bytes
    if (
        ask.basis != "measured"
        or ask.size is not None
        or ask.sized_samples
        or largest is None
        or least is None
        or not peaks_vary(ask.samples, least, largest)
    ):
        return None
    reason = (
        f"{ask.key}: {ask.samples} measured peaks range from {format_size(least)} to "
        f"{format_size(largest)} (more than {VARY_RATIO:g}x): its tasks are not one workload, "
        f"so its margin is held to what was measured ({format_size(ask.margin_bytes)}, at most "
        f"the range {format_size(largest - least)}) and its ask is {ask.describe()}; give its "
        "tasks size= (the ask is then predicted per size) or split them into keys of their own"
    )
    return reason, {
        "samples": ask.samples,
        "least_peak_bytes": least,
        "largest_peak_bytes": largest,
        "peak_range_bytes": largest - least,
        "mean_peak_bytes": ask.mean_bytes,
        "stdev_bytes": ask.spread_bytes,
        "margin_bytes": ask.margin_bytes,
        "room_capped": ask.room_capped,
    }


@dataclasses.dataclass(slots=True)
class Learned:
    """The peaks the tasks of one key that ended since the last settle measured (each with its
    task's size), the card of the last, and the report a record states (the last one, unless an
    earlier one tells of a descendant left running or a rejected reading and the last does not)."""

    device: int
    report: PeakReport
    peaks: list[tuple[int, float | None, Features]]
    #: The task whose report a record states.
    task: TaskIdentity | None = None

    def add(
        self,
        device: int,
        report: PeakReport,
        size: float | None,
        features: Features,
        task: TaskIdentity | None,
    ) -> None:
        """One more peak of the key, measured on ``device`` for a task of ``size`` whose call
        had ``features``."""
        assert report.device_peak_bytes is not None
        self.peaks.append((report.device_peak_bytes, size, features))
        self.device = device
        if _noteworthy(report) or not _noteworthy(self.report):
            self.report = report
            self.task = task


class Predictions:
    """The records of what the asks learned beyond a key's distribution: a feature of the
    calls that explains its peaks (``predicted``), and a peak kept apart as an outlier
    (``outlier``). Writes nothing but records."""

    def __init__(self, state: PlannerState, views: Views) -> None:
        self._state = state
        self._views = views

    def fitted(self, key: str, before: Fit | None, device: int, now_s: float) -> None:
        """Record where the feature that explains ``key``'s peaks changed."""
        fit = self._state.asks.predictor(key)
        if (fit.feature if fit else None) == (before.feature if before else None):
            return
        reason, extra = records.predicted(key, fit, before)
        self._views.note("predicted", device, self._state.asks.ask(key), reason, now_s, extra=extra)

    def outlier(
        self, key: str, peak_bytes: int, features: Features, device: int, now_s: float
    ) -> None:
        """Record a peak of ``key`` kept apart as an outlier."""
        self._state.count("outliers")
        ask = self._state.asks.ask(key)
        reason, extra = records.outlier(key, peak_bytes, features, ask)
        self._views.note("outlier", device, ask, reason, now_s, extra=extra)


def _noteworthy(report: PeakReport) -> bool:
    return bool(report.outliving_descendants or report.rejected_readings or report.incomplete)


class Learning:
    """What ended tasks' peak reports teach: the asks, the child's RSS, and their records (the
    only writer of the peaks kept until the next settle and of the asks last recorded). The
    widths are reviewed where an ask moved."""

    def __init__(self, state: PlannerState, views: Views, log: Recorder) -> None:
        self._state = state
        self._views = views
        self._log = log
        # By key, what its tasks that ended since the last settle measured.
        self._learned: dict[str, Learned] = {}
        # By key, the ask its last record stated.
        self._recorded_asks: dict[str, Ask] = {}
        # Keys whose report of a descendant left running or a rejected reading was recorded.
        self._noted_reports: set[str] = set()
        # Keys told to the user as having peaks that vary a lot (a ``peaks_vary`` record).
        self._varied_keys: set[str] = set()
        # A term of the cards' rooms for one task moved (a co-tenant at census, the child's
        # RSS) since the asks were last held within them: the next measurement holds them.
        self._rooms_due = True
        self._predict = Predictions(state, views)

    @property
    def unsettled(self) -> bool:
        """Whether tasks ended whose peaks :meth:`settle` has not priced yet."""
        return bool(self._learned)

    def learned(self) -> dict[str, Learned]:
        """By key, the peaks kept for the next :meth:`settle` (a copy)."""
        return dict(self._learned)

    def recorded(self, key: str, ask: Ask) -> None:
        """A record stated ``ask`` as ``key``'s price."""
        self._recorded_asks[key] = ask

    def rooms_moved(self) -> None:
        """A term of the cards' rooms for one task moved: the next measurement holds the asks
        within them again."""
        self._rooms_due = True

    def learn(self, run: Run, report: PeakReport, now_s: float, *, failed: bool) -> None:
        """``run`` ended with ``report``: its child's RSS is learned at once, and its peak kept,
        a sample of its key's peaks from the next :meth:`settle`.

        A task that raised (``failed``) is no sample of its key's peaks: it may have stopped
        before allocating what the work needs. Its peak only raises the key's ask, where it
        passed it (as an out-of-memory's does), at once. So does a partial view (the report is
        ``incomplete``: processes under the worker whose bytes no reading told): it is a
        lower bound of the task's peak, so it never lowers the ask below ``task_peak`` or the
        largest whole measurement, and it is recorded once per key."""
        self._learn_rss(report, now_s)
        if report.device is None or run.device is None:
            return
        if report.device_peak_bytes is None:
            rejected = "; ".join(report.rejected_readings)
            self._views.sensor_error(
                run.device,
                "NoMeasurement: a worker could not measure its task's device peak"
                + (f" (rejected: {rejected})" if rejected else ""),
                f"{run.key}'s ask stays as it was",
                now_s,
            )
            return
        if failed or report.incomplete:
            # A partial view (descendants' bytes unread) is a lower bound: it only raises.
            self._raised_past(run.key, run.device, report, now_s)
            return
        learned = self._learned.setdefault(run.key, Learned(run.device, report, []))
        learned.add(run.device, report, run.size, run.features, run.identity)

    def _raised_past(self, key: str, device: int, report: PeakReport, now_s: float) -> None:
        """A task of ``key`` raised after holding ``report``'s peak, or measured it partially:
        where that passed the key's ask, the ask never falls below it again (with a margin)."""
        peak = report.device_peak_bytes
        assert peak is not None
        self.settle(now_s)
        before = self._state.asks.ask(key)
        floor = peak + self._state.asks.policy.margin_for(peak)
        if peak <= before.ask_bytes:
            if report.incomplete:
                # A lower bound of the task's peak: no later measurement prices the key
                # below it; said once per key, with what it did not do.
                after = self._state.asks.floor(key, floor)
                self._state.rebook(key)
                learned = Learned(device, report, [(peak, None, ())])
                self._ask_changed(key, learned, before, after, now_s)
            return
        after = self._state.asks.floor(key, floor)
        self._state.rebook(key)
        self._ask_changed(key, Learned(device, report, [(peak, None, ())]), before, after, now_s)

    def settle(self, now_s: float) -> Refuse | None:
        """Price what the tasks that ended since the last settle measured: for each key, its
        ask derived once (held within the cards' rooms), its running tasks booked at it, a
        ``peaks_vary`` record where its peaks vary a lot, and the widths reviewed once.
        Returns strict mode's refusal where a narrowing below ``max_workers`` was refused."""
        while self._learned:
            key = next(iter(self._learned))
            learned = self._learned.pop(key)
            if self._rooms_due:
                self.limit_asks()
            before = self._state.asks.ask(key)
            fit_before = self._state.asks.predictor(key)
            for peak_bytes, size, features in learned.peaks:
                if self._state.asks.sample(key, peak_bytes, size, features):
                    self._predict.outlier(key, peak_bytes, features, learned.device, now_s)
            self._predict.fitted(key, fit_before, learned.device, now_s)
            after = self._state.asks.ask(key)
            self._peaks_vary(after, learned.device, now_s)
            self._state.rebook(key)
            self._ask_changed(key, learned, before, after, now_s)
        return self._views.refused

    def limit_asks(self) -> None:
        """Hold learned asks within the cards' rooms for one task, as they are now; where
        the rooms moved, running tasks are booked at their keys' asks again."""
        self._rooms_due = False
        rooms = rooms_alone_bytes(
            self._state.cards,
            reserve_bytes=self._state.config.reserve_bytes,
            ceiling=self._state.ceiling,
        )
        if self._state.asks.limit_to_room(rooms):
            for key in {run.key for run in self._state.running.values()}:
                self._state.rebook(key)

    def _peaks_vary(self, ask: Ask, device: int, now_s: float) -> None:
        """Tell the user, once per key, that its measured peaks vary a lot."""
        found = None if ask.key in self._varied_keys else varied_peaks(ask)
        if found is not None:
            self._varied_keys.add(ask.key)
            self._views.note("peaks_vary", device, ask, found[0], now_s, extra=found[1])

    def _learn_rss(self, report: PeakReport, now_s: float) -> None:
        rss = report.rss_peak_bytes
        before = self._state.learn_rss(rss)
        if before is None:
            return
        self._rooms_due = True  # on unified memory, a task's room is less its child's RSS
        ceiling = self._state.ceiling
        if ceiling.value == before.value:
            return
        event: EventName = "narrowed" if ceiling.value < before.value else "widened"
        prior = before.child_rss_bytes == self._state.config.child_rss_prior_bytes
        reason = (
            f"the ceiling goes {before.value} -> {ceiling.value}: host RAM "
            f"({format_size(ceiling.host_ram_bytes)} available) at {format_size(rss)} measured "
            f"RSS per child (was {format_size(before.child_rss_bytes)}"
            f"{', the prior' if prior else ''}); set by {ceiling.limit}"
        )
        self._log.record(
            Decision(
                event=event,
                time_s=now_s,
                device=None,
                width_before=before.value,
                width_after=ceiling.value,
                reason=reason,
                ceiling=ceiling,
                limit=ceiling.limit,
            )
        )
        self._views.refresh(now_s)

    def _ask_changed(
        self, key: str, learned: Learned, before: Ask, after: Ask, now_s: float
    ) -> None:
        report = learned.report
        last = self._recorded_asks.get(key, before)
        moved = abs(after.ask_bytes - last.ask_bytes) > ASK_RECORD_STEP * max(1, last.ask_bytes)
        changed_basis = last.basis != after.basis

        def cause() -> str:  # worded only where a record is written
            count = len(learned.peaks)
            # The peak measured last (the report stated may be an earlier one: its note).
            peaks = f"{count} peaks, the last " if count > 1 else ""
            said = (
                f"{key} measured {peaks}{format_size(learned.peaks[-1][0])} "
                f"({report.device_source}); ask {before.describe()} -> {after.describe()}"
            )
            if report.outliving_descendants:
                said += (
                    f"; {report.outliving_descendants} process(es) "
                    + ("the task" if count == 1 else "one of these tasks")
                    + " started outlived it, holding "
                    f"{format_size(report.outliving_device_bytes)} (the worker keeps them)"
                )
            if report.incomplete:
                said += (
                    f"; a partial view ({report.incomplete_reason}): it may raise the ask, "
                    "never lower it"
                )
            return said

        # A descendant left running, or a rejected reading, is recorded once per key.
        noted = _noteworthy(report) and key not in self._noted_reports
        if noted:
            self._noted_reports.add(key)
        if not (moved or changed_basis or noted) and after.price_terms() == before.price_terms():
            return  # the peaks priced the key as before: no term of any width moved
        unchanged: EventName = "bound_changed"
        if changed_basis:
            unchanged = "measured"
        elif after.ask_bytes < last.ask_bytes:
            unchanged = "widen_refused"
        widths_moved = self._views.review(
            now_s,
            cause=cause,
            key=key,
            quiet=not (moved or changed_basis or noted),
            unchanged=unchanged,
            extra=records.peak_terms(report)
            | {
                "margin_bytes": after.margin_bytes,
                "spread_bytes": after.spread_bytes,
                "samples": after.samples,
            }
            # The task whose peak the record states.
            | (learned.task.terms() if learned.task is not None else {}),
        )
        if widths_moved or moved or changed_basis:
            self._recorded_asks[key] = after

    def flush_asks(self, now_s: float) -> None:
        """Record each key's final ask where it moved since its last record (at most one record
        per key: a log read afterwards ends with every key's true price)."""
        self.settle(now_s)
        for key in self._state.asks.keys():  # noqa: SIM118 (AskTable is not a dict)
            ask = self._state.asks.ask(key)
            last = self._recorded_asks.get(key)
            if last is None or last.ask_bytes == ask.ask_bytes or not self._state.cards:
                continue
            self._recorded_asks[key] = ask
            self._views.note(
                "bound_changed",
                None,
                ask,
                f"{key}: final ask {ask.describe()} (last recorded {format_size(last.ask_bytes)})",
                now_s,
            )
