"""What an ended task teaches the planner: its peaks, learned once per turn (pure core).

A task that ends with a peak report is a sample of its key's peaks. Its booking is
released at once (:meth:`Learning.ended`), and its peak is kept; what the peaks teach
is priced once for all the tasks of the key that ended since (:meth:`Learning.settle`):
the key's ask takes them as samples and is derived once, its running tasks are booked
at that ask, and the widths are reviewed once, with a record where the ask or a width
moved. Until then the key's ask is the one before them. The dispatcher settles at the
top of each turn of its loop, before it reads a card, starts a task, publishes the
pool's state or delivers a result, so every start, width and record of a turn is
priced with every measurement received before it; :meth:`Learning.finished` (an
end and its settle at once) is the same for a caller driving the planner itself.
"""

from __future__ import annotations

import dataclasses

from gpupool._core.events import Decision, EventName
from gpupool._core.peak import PeakReport
from gpupool._core.planner import records
from gpupool._core.planner.evidence import rooms_alone_bytes, varied_peaks
from gpupool._core.planner.queued import Queued
from gpupool._core.planner.sharing import note_freed
from gpupool._core.planner.verdicts import ASK_RECORD_STEP, Refuse, TaskId
from gpupool._core.policy import Ask
from gpupool._core.units import format_size

__all__ = ["Learning"]


@dataclasses.dataclass(slots=True)
class Learned:
    """The peaks the tasks of one key that ended since the last settle measured (each with
    its task's size), the card of the last, and the report a record states (the last one,
    unless an earlier one tells of a descendant left running or a rejected reading and the
    last does not)."""

    device: int
    report: PeakReport
    peaks: list[tuple[int, float | None]]

    def add(self, device: int, report: PeakReport, size: float | None) -> None:
        """One more peak of the key, measured on ``device`` for a task of ``size``."""
        assert report.device_peak_bytes is not None
        self.peaks.append((report.device_peak_bytes, size))
        self.device = device
        if _noteworthy(report) or not _noteworthy(self.report):
            self.report = report


def _noteworthy(report: PeakReport) -> bool:
    return bool(report.outliving_descendants or report.rejected_readings)


class Learning(Queued):
    """Ended tasks and what their peak reports teach: the asks, the child's RSS, the records."""

    @property
    def unsettled(self) -> bool:
        """Whether tasks ended whose peaks :meth:`settle` has not priced yet."""
        return bool(self._learned)

    def finished(
        self, task: TaskId, report: PeakReport | None, now_s: float, *, failed: bool = False
    ) -> Refuse | None:
        """``task`` ended with a result or an ordinary error; learn from its peak report at
        once (:meth:`ended`, then :meth:`settle`). Returns strict mode's refusal where what it
        taught narrows the pool below ``max_workers``."""
        self.ended(task, report, now_s, failed=failed)
        return self.settle(now_s)

    def ended(
        self, task: TaskId, report: PeakReport | None, now_s: float, *, failed: bool = False
    ) -> None:
        """``task`` ended with a result or an ordinary error: its booking is released and its
        peak kept, a sample of its key's peaks from the next :meth:`settle`.

        A task that raised (``failed``) is no sample of its key's peaks: it may have stopped
        before allocating what the work needs. Its peak only raises the key's ask, where it
        passed it (as an out-of-memory's does), at once."""
        run = self._end_run(task)
        self.tasks.pop(task, None)
        self._drop_queued(task)
        if run is None:
            return
        if run.device is not None:
            note_freed(self.cards[run.device], run, now_s)
        self._rebook(run.key)
        if not failed:
            count, mean_s = self._durations_s.get(run.key, (0, 0.0))
            took_s = max(0.0, now_s - run.started_s)
            self._durations_s[run.key] = (count + 1, mean_s + (took_s - mean_s) / (count + 1))
            self.timed(run.key, took_s)
        if report is None:
            return
        self._learn_rss(report, now_s)
        if report.device is None or run.device is None:
            return
        if report.device_peak_bytes is None:
            rejected = "; ".join(report.rejected_readings)
            self.sensor_error(
                run.device,
                "NoMeasurement: a worker could not measure its task's device peak"
                + (f" (rejected: {rejected})" if rejected else ""),
                f"{run.key}'s ask stays as it was",
                now_s,
            )
            return
        if failed:
            self._raised_past(run.key, run.device, report, now_s)
            return
        learned = self._learned.get(run.key)
        if learned is None:
            peak = (report.device_peak_bytes, run.size)
            self._learned[run.key] = Learned(run.device, report, [peak])
        else:
            learned.add(run.device, report, run.size)

    def _raised_past(self, key: str, device: int, report: PeakReport, now_s: float) -> None:
        """A task of ``key`` raised after holding ``report``'s peak: where that passed the
        key's ask, the ask never falls below it again (with a margin)."""
        peak = report.device_peak_bytes
        assert peak is not None
        self.settle(now_s)
        before = self.asks.ask(key)
        if peak <= before.ask_bytes:
            return
        after = self.asks.floor(key, peak + self.asks.policy.margin_for(peak))
        self._rebook(key)
        self._ask_changed(key, Learned(device, report, [(peak, None)]), before, after, now_s)

    def settle(self, now_s: float) -> Refuse | None:
        """Price what the tasks that ended since the last settle measured: for each key, its
        ask derived once (held within the cards' rooms), its running tasks booked at it, a
        ``peaks_vary`` record where its peaks vary a lot, and the widths reviewed once.
        Returns strict mode's refusal where a narrowing below ``max_workers`` was refused."""
        while self._learned:
            key = next(iter(self._learned))
            learned = self._learned.pop(key)
            if self._rooms_due:
                self._limit_asks()
            before = self.asks.ask(key)
            for peak_bytes, size in learned.peaks:
                self.asks.sample(key, peak_bytes, size)
            after = self.asks.ask(key)
            self._peaks_vary(after, learned.device, now_s)
            self._rebook(key)
            self._ask_changed(key, learned, before, after, now_s)
        return self.refused

    def sensor_error(self, device: int | None, error: str, effect: str, now_s: float) -> None:
        """Record a failed reading, once per card and kind of error."""
        kind = (-1 if device is None else device, error.split(":", 1)[0])
        if kind in self._sensor_errors:
            return
        self._sensor_errors.add(kind)
        self.counts["sensor_errors"] += 1
        self.record(
            self._simple(
                "sensor_error",
                device,
                self.asks.ask(self._last_key),
                f"card {device}: a reading failed ({error}); {effect} while it fails; the "
                "static bound still applies",
                now_s,
                extra={"error": error[:500]},
            )
        )

    def _limit_asks(self) -> None:
        """Hold learned asks within the cards' rooms for one task, as they are now; where
        the rooms moved, running tasks are booked at their keys' asks again."""
        self._rooms_due = False
        rooms = rooms_alone_bytes(
            self.cards, reserve_bytes=self.config.reserve_bytes, ceiling=self.ceiling
        )
        if self.asks.limit_to_room(rooms):
            for key in {run.key for run in self.running.values()}:
                self._rebook(key)

    def _peaks_vary(self, ask: Ask, device: int, now_s: float) -> None:
        """Tell the user, once per key, that its measured peaks vary a lot."""
        found = None if ask.key in self._varied_keys else varied_peaks(ask)
        if found is not None:
            self._varied_keys.add(ask.key)
            self.record(self._simple("peaks_vary", device, ask, found[0], now_s, extra=found[1]))

    def _learn_rss(self, report: PeakReport, now_s: float) -> None:
        rss = report.rss_peak_bytes
        if rss is None or (self.child_rss_bytes is not None and rss <= self.child_rss_bytes):
            return
        self.child_rss_bytes = rss
        self._rooms_due = True  # on unified memory, a task's room is less its child's RSS
        before = self.ceiling
        self.ceiling = self._derive_ceiling()
        if self.ceiling.value == before.value:
            return
        event: EventName = "narrowed" if self.ceiling.value < before.value else "widened"
        self.record(
            Decision(
                event=event,
                time_s=now_s,
                device=None,
                width_before=before.value,
                width_after=self.ceiling.value,
                reason=(
                    f"the ceiling goes {before.value} -> {self.ceiling.value}: host RAM "
                    f"({format_size(self.ceiling.host_ram_bytes)} available) at "
                    f"{format_size(rss)} measured RSS per child (was "
                    f"{format_size(before.child_rss_bytes)}"
                    + (
                        ")"
                        if before.child_rss_bytes != self.config.child_rss_prior_bytes
                        else ", the prior)"
                    )
                    + f"; set by {self.ceiling.limit}"
                ),
                ceiling=self.ceiling,
                limit=self.ceiling.limit,
            )
        )
        self.width = self._width_now()
        self._timeline(now_s)

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
            return said

        # A descendant left running, or a rejected reading, is recorded once per key.
        noted = bool(report.outliving_descendants or report.rejected_readings)
        noted = noted and key not in self._noted_reports
        if noted:
            self._noted_reports.add(key)
        if not (moved or changed_basis or noted) and after.price_terms() == before.price_terms():
            return  # the peaks priced the key as before: no term of any width moved
        unchanged: EventName = "bound_changed"
        if changed_basis:
            unchanged = "measured"
        elif after.ask_bytes < last.ask_bytes:
            unchanged = "widen_refused"
        widths_moved = self._review(
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
            },
        )
        if widths_moved or moved or changed_basis:
            self._recorded_asks[key] = after

    def flush_asks(self, now_s: float) -> None:
        """Record each key's final ask where it moved since its last record (at most one record
        per key: a log read afterwards ends with every key's true price)."""
        self.settle(now_s)
        for key in self.asks.keys():  # noqa: SIM118 (AskTable is not a dict)
            ask = self.asks.ask(key)
            last = self._recorded_asks.get(key)
            if last is None or last.ask_bytes == ask.ask_bytes or not self.cards:
                continue
            self._recorded_asks[key] = ask
            self.record(
                self._simple(
                    "bound_changed",
                    None,
                    ask,
                    f"{key}: final ask {ask.describe()} (last recorded "
                    f"{format_size(last.ask_bytes)})",
                    now_s,
                )
            )
