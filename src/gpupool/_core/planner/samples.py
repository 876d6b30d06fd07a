"""Whose bytes a live reading shows, and the ``card_read`` samples the decision log keeps of it.

One computation, :func:`split_reading`, says which of a card's used bytes are this pool's (its
parent's row, its workers' rows and those of processes their tasks started, idle workers' contexts
included), which are other gpupool pools' and which are everything else's (the co-tenants). The
out-of-memory record, the cap lift and the samples all state its figures, so no byte of the pool's
own is ever named a co-tenant's.

A sample is written for a card:

* with every decision record of that card, when the card was read since the
  last sample (a decision states the reading it was made on);
* at the end of a turn of the process layer (after its starts, so a sample
  counts the tasks that run beside it), while the pool's tasks run there or
  the reading moves, at most once every :data:`SAMPLE_INTERVAL_S`;
* at once (but no sooner than :data:`SAMPLE_MIN_GAP_S` after the last) when
  the card's used bytes jump by :data:`SAMPLE_JUMP_FRACTION` of its total, or
  the number of the pool's tasks running there changed.

So the log grows with time and decisions, never with the tasks run: between
decisions, a card costs at most ``1 / SAMPLE_MIN_GAP_S`` samples a second
while it jumps, and ``1 / SAMPLE_INTERVAL_S`` otherwise.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpupool._core.events import Decision, JsonTable, JsonValue
from gpupool._core.planner.base import PlannerState
from gpupool._core.planner.state import Card
from gpupool._core.planner.verdicts import CardReading
from gpupool._core.units import MiB, format_size

__all__ = [
    "SAMPLE_INTERVAL_S",
    "SAMPLE_JUMP_FRACTION",
    "SAMPLE_MIN_GAP_S",
    "SAMPLE_STEP_BYTES",
    "UNEXPLAINED_STEP_BYTES",
    "ReadingSplit",
    "Recorder",
    "card_read",
    "pool_rows",
    "sample_due",
    "split_reading",
]

#: The steady rate of a card's samples while tasks run there, or its reading moves.
SAMPLE_INTERVAL_S = 1.0
#: The least time between two samples of a card, however fast it moves.
SAMPLE_MIN_GAP_S = 0.2
#: A jump of the card's used bytes by this fraction of its total is sampled at once.
SAMPLE_JUMP_FRACTION = 1 / 20
#: Less movement than this is not movement (an idle card is not sampled for it).
SAMPLE_STEP_BYTES = 64 * MiB

#: How far the card's used bytes that no row explains must rise past their least, while the
#: pool's tasks run, for an ``unexplained_memory`` warning (and how far past the last one
#: warned about, doubled, for the next): more than a driver's or an allocator's own drift.
UNEXPLAINED_STEP_BYTES = 512 * MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadingSplit:
    """A card's used bytes split by whose they are (``None``: the rows cannot tell them): the
    parent's row (0 where the rows list none for it), the pool's (its workers and the
    processes their tasks started; ``running_bytes`` of it in the workers running a task),
    the host's other gpupool pools' tasks, and the co-tenants' (everything else)."""

    used_bytes: int
    own_bytes: int | None
    pool_bytes: int | None
    running_bytes: int | None
    other_pools_bytes: int
    co_tenant_bytes: int | None

    def terms(self) -> dict[str, JsonValue]:
        """The split as a record's terms."""
        return {
            "live_used_bytes": self.used_bytes,
            "live_own_bytes": self.own_bytes,
            "live_pool_bytes": self.pool_bytes,
            "live_running_bytes": self.running_bytes,
            "live_other_pools_bytes": self.other_pools_bytes,
            "live_co_tenant_bytes": self.co_tenant_bytes,
        }


def split_reading(
    card: Card,
    reading: CardReading,
    parent_pid: int | None,
    *,
    extra_pids: frozenset[int] = frozenset(),
) -> ReadingSplit:
    """Whose bytes ``reading`` shows on ``card``. ``extra_pids`` are more of the pool's
    processes (a task that just ended, whose row may still be listed)."""
    rows = pool_rows(card, reading, parent_pid, extra_pids=extra_pids)
    others = card.pools.others_held_bytes
    if rows is None:
        return ReadingSplit(
            used_bytes=reading.used_bytes,
            own_bytes=None,
            pool_bytes=None,
            running_bytes=None,
            other_pools_bytes=others,
            co_tenant_bytes=None,
        )
    running = {run.pid for run in card.runs.values() if run.pid is not None}
    pool = (reading.pool_pids | card.worker_pids | running | extra_pids) - {parent_pid}
    own = rows.get(parent_pid, 0) if parent_pid is not None else 0
    pool_bytes = sum(rows.get(pid, 0) for pid in pool)
    return ReadingSplit(
        used_bytes=reading.used_bytes,
        own_bytes=own,
        pool_bytes=pool_bytes,
        running_bytes=sum(rows.get(pid, 0) for pid in running),
        other_pools_bytes=others,
        co_tenant_bytes=max(0, reading.used_bytes - own - pool_bytes - others),
    )


def pool_rows(
    card: Card,
    reading: CardReading,
    parent_pid: int | None,
    *,
    extra_pids: frozenset[int] = frozenset(),
) -> Mapping[int, int] | None:
    """The reading's process rows, or ``None`` where they cannot tell the pool's bytes: the
    driver lists no rows, or (a container whose driver lists other namespaces' PIDs) tasks
    run on the card and the rows list none of the pool's processes nor this one."""
    rows = reading.process_bytes
    if rows is None:
        return None
    tasks = {run.pid for run in card.runs.values() if run.pid is not None} | extra_pids
    ours = reading.pool_pids | card.worker_pids | tasks | {parent_pid}
    if tasks and not any(pid in rows for pid in ours):
        return None
    return rows


def sample_due(card: Card, now_s: float, *, decision: bool) -> bool:
    """Whether ``card``'s reading is to be sampled now (the rules of the module docstring)."""
    reading = card.live.reading
    if reading is None or reading is card.sample.sampled_reading:
        return False
    if decision or card.sample.sampled_s is None or card.sample.sampled_used_bytes is None:
        return True
    gap_s = now_s - card.sample.sampled_s
    moved = abs(reading.used_bytes - card.sample.sampled_used_bytes)
    total = card.census.total_bytes or 0
    jumped = moved >= max(SAMPLE_STEP_BYTES, total * SAMPLE_JUMP_FRACTION)
    if gap_s >= SAMPLE_MIN_GAP_S and (jumped or len(card.runs) != card.sample.sampled_running):
        return True
    return gap_s >= SAMPLE_INTERVAL_S and (bool(card.runs) or moved >= SAMPLE_STEP_BYTES)


def card_read(card: Card, split: ReadingSplit, free_bytes: int, now_s: float) -> Decision:
    """A ``card_read`` sample: the split, what the pool booked there, and by key.

    ``booked_bytes`` is what each running task was booked at when it started (the price it was
    admitted at); ``priced_now_bytes`` is what the fit counts them at now (more, where an
    out-of-memory or a measurement raised their key's price since). ``read_s`` is when the card was
    read (``time_s`` is when the sample was taken: with a decision, the reading it was made on).
    """
    by_key: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for run in card.runs.values():
        by_key[run.key][0] += 1
        by_key[run.key][1] += run.booked_at_start_bytes
    keys: JsonTable = [
        {"key": key, "running": running, "booked_bytes": booked}
        for key, (running, booked) in sorted(by_key.items())
    ]
    booked = sum(run.booked_at_start_bytes for run in card.runs.values())
    reason = (
        f"card {card.index}: {format_size(split.used_bytes)} used (this process "
        f"{format_size(split.own_bytes)}, the pool's workers {format_size(split.pool_bytes)}, "
        f"other pools {format_size(split.other_pools_bytes)}, co-tenants "
        f"{format_size(split.co_tenant_bytes)}); {len(card.runs)} running, booked "
        f"{format_size(booked)}"
    )
    return Decision(
        event="card_read",
        time_s=now_s,
        device=card.index,
        width_before=card.width,
        width_after=card.width,
        reason=reason,
        extra=split.terms()
        | {
            "live_free_bytes": free_bytes,
            "total_bytes": card.census.total_bytes,
            "read_s": round(card.live.reading_s, 6),
            "running": len(card.runs),
            "booked_bytes": booked,
            "priced_now_bytes": card.sums.booked_bytes,
            "oom_cap": card.cap.oom_cap,
            "keys": keys,
        },
    )


class Recorder:
    """The planner's only output besides its verdicts: its records, each after a sample of the
    reading its card's decision was made on (read off the state), and the pool's width over
    time; ``emit`` is the decision log."""

    def __init__(self, state: PlannerState, emit: Callable[[Decision], None]) -> None:
        self._state = state
        self._emit = emit
        self.widths: list[tuple[float, int]] = []
        # The kinds of failed reading recorded already, by card.
        self._errors: set[tuple[int, str]] = set()
        # By card: the least of its used bytes that no row explains, over the readings whose
        # rows list every running task, and the most of it already warned about.
        self._unexplained_least: dict[int, int] = {}
        self._unexplained_warned: dict[int, int] = {}

    def record(self, decision: Decision) -> None:
        """Write one record, after a sample of its card's reading where one is due."""
        cards = self._state.cards
        if decision.device is not None and decision.device < len(cards):
            self.sample(cards[decision.device], decision.time_s, decision=True)
        self._emit(decision)

    def sample(self, card: Card, now_s: float, *, decision: bool) -> None:
        """A ``card_read`` sample of ``card``'s last reading, where one is due
        (:func:`sample_due`)."""
        reading = card.live.reading
        if (
            reading is None
            or not self.widths  # not yet constructed: the census is the first record's
            or not sample_due(card, now_s, decision=decision)
        ):
            return
        split = split_reading(card, reading, self._state.config.parent_pid)
        card.sample.sampled_reading = reading
        card.sample.sampled_s = now_s
        card.sample.sampled_used_bytes = reading.used_bytes
        card.sample.sampled_running = len(card.runs)
        self._emit(card_read(card, split, reading.free_bytes, now_s))
        self._unexplained(card, reading, now_s)

    def _unexplained(self, card: Card, reading: CardReading, now_s: float) -> None:
        """An ``unexplained_memory`` warning where the card's used bytes that no row explains
        (``used - every row``) rose by :data:`UNEXPLAINED_STEP_BYTES` or more past their
        least while the pool's tasks ran: managed memory, a process the driver does not
        list, or a spike. Judged only on readings whose rows list every running task with
        its bytes (a container's or MIG's rows would make the pool's own bytes look
        unexplained), and never on unified memory (its used bytes are the host's)."""
        rows = reading.process_bytes
        if rows is None or card.census.unified:
            return
        unexplained = max(0, reading.used_bytes - sum(rows.values()))
        least = self._unexplained_least.get(card.index)
        if least is None or unexplained < least:
            self._unexplained_least[card.index] = unexplained
            return
        running = [run.pid for run in card.runs.values()]
        if not running or any(pid is None or rows.get(pid, 0) <= 0 for pid in running):
            return
        rise = unexplained - least
        warned = self._unexplained_warned.get(card.index, 0)
        if rise < UNEXPLAINED_STEP_BYTES or rise < 2 * warned:
            return
        self._unexplained_warned[card.index] = rise
        self._emit(
            Decision(
                event="unexplained_memory",
                time_s=now_s,
                device=card.index,
                width_before=card.width,
                width_after=card.width,
                reason=(
                    f"card {card.index}: {format_size(unexplained)} of its "
                    f"{format_size(reading.used_bytes)} used is in no process's row, "
                    f"{format_size(rise)} more than before while {len(running)} task(s) ran: "
                    "managed (unified) memory, a process the driver does not list, or a "
                    "spike; no task's peak counts it, so the pool may be priced short"
                ),
                extra={
                    "unexplained_bytes": unexplained,
                    "unexplained_rise_bytes": rise,
                    "used_bytes": reading.used_bytes,
                    "rows_bytes": sum(rows.values()),
                    "running": len(running),
                },
            )
        )

    def sample_cards(self, now_s: float) -> None:
        """The end of a turn of the process layer (its starts made): a sample of each card
        whose last reading is due one, so that it counts the tasks that run beside it."""
        for card in self._state.cards:
            self.sample(card, now_s, decision=False)

    def timeline(self, now_s: float, width: int) -> None:
        """The pool's width is ``width`` at ``now_s`` (kept where it moved)."""
        if not self.widths or self.widths[-1][1] != width:
            self.widths.append((round(now_s, 6), width))

    def first_error(self, device: int | None, error: str) -> bool:
        """Whether this is the first failed reading of its kind on ``device`` (then noted)."""
        kind = (-1 if device is None else device, error.split(":", 1)[0])
        if kind in self._errors:
            return False
        self._errors.add(kind)
        return True
