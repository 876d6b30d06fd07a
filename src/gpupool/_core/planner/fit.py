"""The one fit: what fits on a card beside these runs at this ask, and why not more.

Every "how many" the pool states is a view of :func:`fit`: admission (a task starts only where
``more >= 1``), ``ex.width`` (the pending asks placed card by card), ``widths_by_key``, the
warm-worker limit, the critical key's width and every record's width (:func:`card_widths`). So the
width a record states is the computation that gated the start beside it.

The live gate (:func:`live_gate`) is the second, live check on the same card: the free bytes read
now must cover the new booking, what the running tasks have not reached yet, and the reserve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpupool._core.bound import (
    Bound,
    Ceiling,
    Limit,
    WidthDecision,
    derive_bound,
    fits_together,
    live_gate_admits,
)
from gpupool._core.planner.state import Card, Fit, Run
from gpupool._core.policy import Ask

__all__ = [
    "MEMO_LIMIT",
    "Booked",
    "Fit",
    "Held",
    "LiveGate",
    "card_bound",
    "card_widths",
    "fit",
    "fit_counts",
    "host_per_task_bytes",
    "key_counts",
    "live_gate",
]


#: The most bounds, and the most fits, a card keeps (``card.memo``: its ``bound_memo`` and
#: ``fit_memo``) before it forgets them all (and works them out again as they are asked for).
MEMO_LIMIT = 256


class Held(Protocol):
    """A booking on a card: a running task, or one placed in a what-if."""

    @property
    def key(self) -> str: ...

    @property
    def booked_bytes(self) -> int: ...

    @property
    def solo(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Booked:
    """A what-if booking (a task placed on a card by a view, or held for one, not started);
    ``solo``: at its own price, not its share of its key's (:attr:`Run.solo`)."""

    key: str
    booked_bytes: int
    solo: bool = False


def key_counts(runs: Iterable[Held], key: str) -> tuple[int, int]:
    """How many of ``runs`` are of ``key``, and how many of those are booked at their share of
    the key's price together (:meth:`Card.key_counts` for a what-if)."""
    same = together = 0
    for run in runs:
        if run.key == key:
            same += 1
            together += not run.solo
    return same, together


def host_per_task_bytes(card: Card, ceiling: Ceiling) -> int:
    """What each task's child holds in host RAM, where host RAM is the card's memory.

    On unified memory (GB10, Jetson) the card's room and the host's RAM are one ``MemAvailable``: a
    child's device bytes and its RSS draw on it together, so each task is priced at its ask plus the
    children's RSS (as the ceiling prices it: measured, or the prior) in the card's room. 0 on a
    discrete card, whose room is its own memory.
    """
    if not card.census.unified or not ceiling.child_rss_bytes:
        return 0
    return ceiling.child_rss_bytes


def card_bound(card: Card, ask: Ask, *, reserve_bytes: int, ceiling: Ceiling) -> Bound:
    """``card``'s bound priced at ``ask``, with its own high-water so far and the other pools'
    bookings; for a key priced together, how many of its tasks together fit alone; on
    unified memory each task's child RSS beside its ask (:func:`host_per_task_bytes`).

    Worked out once per price and terms: the card keeps the bounds it worked out by the
    ask's :meth:`~gpupool._core.policy.Ask.price_terms` (``card.memo.bound_memo``) and serves one
    while the card's terms (own high-water, other pools, reserve), its census and the
    ceiling are the ones it was worked out from."""
    terms = (
        card.live.own_high_water_bytes,
        card.pools.others_bytes,
        card.pools.others_at_census_bytes,
        reserve_bytes,
    )
    price = ask.price_terms()
    memo = card.memo.bound_memo.get(price)
    if memo is not None and memo[0] is ceiling and memo[1] is card.census and memo[2] == terms:
        return memo[3]
    bound = _card_bound(card, ask, reserve_bytes=reserve_bytes, ceiling=ceiling)
    if len(card.memo.bound_memo) >= MEMO_LIMIT:
        card.memo.bound_memo.clear()
    card.memo.bound_memo[price] = (ceiling, card.census, terms, bound)
    return bound


def _card_bound(card: Card, ask: Ask, *, reserve_bytes: int, ceiling: Ceiling) -> Bound:
    """:func:`card_bound`, worked out."""
    host = host_per_task_bytes(card, ceiling)
    bound = derive_bound(
        card.census,
        own_high_water_bytes=card.live.own_high_water_bytes,
        reserve_bytes=reserve_bytes,
        ask_bytes=max(1, ask.ask_bytes),
        ask_basis=ask.basis,
        other_pools_bytes=card.pools.others_bytes,
        other_pools_at_census_bytes=card.pools.others_at_census_bytes,
    )
    if host:
        bound = dataclasses.replace(bound, host_per_task_bytes=host)
    if not ask.pooled or bound.room_bytes is None:
        return bound
    fits = fits_together(
        lambda k: ask.together_bytes(k) + k * host, bound.room_bytes, ceiling.value
    )
    return dataclasses.replace(
        bound, together_tasks=fits, together_bytes=ask.together_bytes(max(1, fits))
    )


def fit(
    card: Card,
    ask: Ask,
    runs: Sequence[Held] | None,
    *,
    reserve_bytes: int,
    ceiling: Ceiling,
    slots: int,
) -> Fit:
    """How many more tasks at ``ask`` fit on ``card`` beside ``runs`` (a what-if; ``None``:
    the card's runs, read off its running sums), within ``slots`` (what the ``ceiling``
    leaves the pool, named where it is what stops), and what stops the next.

    A fit reads the runs only through how many there are, what they book and how many are
    of ``ask``'s key: the card keeps the fits it worked out by those (``card.memo.fit_memo``)
    and serves one while the card's terms are the ones it was worked out from."""
    if runs is None:
        running, booked = len(card.runs), card.sums.booked_bytes
        same, together = card.key_counts(ask.key)
    else:
        running = len(runs)
        booked = sum(run.booked_bytes for run in runs)
        same, together = key_counts(runs, ask.key)
    return fit_counts(
        card,
        ask,
        running=running,
        booked_bytes=booked,
        same=same,
        together=together,
        reserve_bytes=reserve_bytes,
        ceiling=ceiling,
        slots=slots,
    )


def fit_counts(
    card: Card,
    ask: Ask,
    *,
    running: int,
    booked_bytes: int,
    same: int,
    together: int | None = None,
    reserve_bytes: int,
    ceiling: Ceiling,
    slots: int,
) -> Fit:
    """:func:`fit` beside ``running`` runs that book ``booked_bytes`` between them (without
    their child RSS), ``same`` of them of ``ask``'s key, ``together`` of those (default:
    all) booked at their share of the key's price together (:meth:`Ask.next_bytes`)."""
    if together is None:
        together = same
    terms = (
        card.live.own_high_water_bytes,
        card.pools.others_bytes,
        card.pools.others_at_census_bytes,
        card.cap.oom_cap,
        reserve_bytes,
    )
    place = (ask.price_terms(), running, booked_bytes, same, together, slots)
    memo = card.memo.fit_memo.get(place)
    if memo is not None and memo[0] is ceiling and memo[1] is card.census and memo[2] == terms:
        return memo[3]
    found = _fit(card, ask, running, booked_bytes, (same, together), reserve_bytes, ceiling, slots)
    if len(card.memo.fit_memo) >= MEMO_LIMIT:
        card.memo.fit_memo.clear()
    card.memo.fit_memo[place] = (ceiling, card.census, terms, found)
    return found


def _fit(
    card: Card,
    ask: Ask,
    running: int,
    booked_bytes: int,
    counts: tuple[int, int],
    reserve_bytes: int,
    ceiling: Ceiling,
    slots: int,
) -> Fit:
    """:func:`fit_counts`, worked out (``counts``: its ``same`` and ``together``)."""
    bound = card_bound(card, ask, reserve_bytes=reserve_bytes, ceiling=ceiling)
    host = bound.host_per_task_bytes
    booked_now = booked_bytes + host * running
    room = bound.room_bytes
    limit: Limit
    if room is None:
        # Unreadable is not empty: one task of the pool at a time.
        more, limit = (0 if running else 1), "unreadable"
    else:
        more = _more_fit(ask, counts, booked_now, host, room, max(0, slots))
        limit = "memory"
        if more >= slots:
            limit = ceiling.limit
    if card.cap.oom_cap is not None:
        allowed = max(0, card.cap.oom_cap - running)
        if more > allowed or (more == allowed and limit != "memory"):
            more, limit = allowed, "out_of_memory"
    return Fit(
        device=card.index,
        bound=bound,
        running=running,
        booked_bytes=booked_now,
        next_bytes=ask.next_bytes(*counts) + host,
        more=more,
        limit=limit,
    )


def _more_fit(
    ask: Ask, counts: tuple[int, int], booked_now: int, host: int, room: int, slots: int
) -> int:
    """The most tasks at ``ask``, up to ``slots``, that fit in ``room`` beside ``booked_now``
    and ``counts`` (how many of their key, how many of those priced together): the count at
    which placing them one by one (each at ``ask.next_bytes`` plus ``host``) would stop. The
    ``k`` placed book ``ask.more_bytes(k, *counts) + k * host``, which grows with ``k``: for
    an ask priced alone with no outliers that is ``k`` steps of one size (a division), else a
    bisection."""
    if slots <= 0:
        return 0
    if not ask.pooled and not ask.outlier_rate:
        step = ask.ask_bytes + host
        if booked_now + step > room:
            return 0
        return slots if step <= 0 else min(slots, (room - booked_now) // step)
    fits, fails = 0, slots + 1
    while fails - fits > 1:
        middle = (fits + fails) // 2
        if booked_now + ask.more_bytes(middle, *counts) + middle * host <= room:
            fits = middle
        else:
            fails = middle
    return fits


def card_widths(fits: Sequence[Fit], ceiling: Ceiling) -> tuple[WidthDecision, ...]:
    """Every card's width from its fit, within the pool-wide ceiling: each card's runs plus the
    ones that fit beside them, the cards with the most room left filled first.

    The ``fits`` were computed with the slots the ceiling leaves the pool; here they are
    shared out. When no card runs or fits a task, the card with the most room gets the
    serial floor of 1 (an unreadable card, if none is readable)."""
    order = sorted(
        range(len(fits)),
        key=lambda i: (fits[i].bound.room_bytes is None, -(fits[i].left_bytes or 0), i),
    )
    left = max(0, ceiling.value - sum(f.running for f in fits))
    width = [f.running for f in fits]
    limits: list[Limit] = [f.limit for f in fits]
    for i in order:
        take = min(fits[i].more, left)
        left -= take
        width[i] += take
        if take < fits[i].more:
            limits[i] = ceiling.limit
    if fits and sum(width) == 0:
        for i in order:
            if fits[i].bound.room_bytes is not None:
                limits[i] = "floor"
        first = order[0]
        width[first] = 1
        limits[first] = "unreadable" if fits[first].bound.room_bytes is None else "floor"
    elif any(width):
        for i in range(len(fits)):
            if width[i] == 0 and limits[i] == "memory":
                limits[i] = "no_room"
    return tuple(
        WidthDecision(
            device=f.device, width=width[i], limit=limits[i], bound=f.bound, ceiling=ceiling
        )
        for i, f in enumerate(fits)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveGate:
    """The live gate's terms on one card for one more task (:func:`live_gate`); ``free_bytes``
    is ``None`` where the card has no reading (the gate is open)."""

    admits: bool
    free_bytes: int | None
    used_bytes: int | None
    idle_worker_bytes: int
    next_bytes: int
    unreached_bytes: int
    reserve_bytes: int
    running: int


def live_gate(card: Card, ask: Ask, runs: Sequence[Run], *, reserve_bytes: int) -> LiveGate:
    """The live gate on ``card`` for one more task at ``ask`` beside ``runs`` (the card's):
    the card's free bytes now (plus what the idle worker it would run in already holds) must
    cover its booking, what the running tasks have not reached yet, and the reserve. No
    reading: the gate is open."""
    next_bytes = ask.next_bytes(*key_counts(runs, ask.key))
    reading = card.live.reading
    admits, unreached, idle = True, 0, 0
    if reading is not None:
        rows = reading.process_bytes or {}
        unreached = sum(max(0, r.booked_bytes - rows.get(r.pid or -1, 0)) for r in runs)
        unreached += card.pools.others_unreached_bytes
        if reading.process_bytes is not None and card.worker_pids:
            running_pids = {r.pid for r in runs}
            held = [rows[p] for p in card.worker_pids if p not in running_pids and p in rows]
            if held:
                idle = max(0, min(next_bytes, *held))
        admits = live_gate_admits(
            live_free_bytes=reading.free_bytes + idle,
            ask_bytes=next_bytes,
            unreached_bytes=unreached,
            reserve_bytes=reserve_bytes,
        )
    return LiveGate(
        admits=admits,
        free_bytes=reading.free_bytes if reading is not None else None,
        used_bytes=reading.used_bytes if reading is not None else None,
        idle_worker_bytes=idle,
        next_bytes=next_bytes,
        unreached_bytes=unreached,
        reserve_bytes=reserve_bytes,
        running=len(runs),
    )
