"""The out-of-memory attribution: which term of the bound was wrong when a card ran out (pure).

Reads one ``out_of_memory`` record (a mapping, as the decision log holds
it; its terms are named in :data:`gpupool._core.events.OOM_TERMS`) and
returns an :class:`OomAnalysis`. ``gpupool postmortem`` streams a log and
calls :func:`analyse_oom` for each such record.

The attribution arithmetic
--------------------------

An ``out_of_memory`` record carries, for the card the task ran on:

====================  ==========================================================
``T``                 ``total_bytes``: the card's capacity
``C``                 ``census_co_tenant_bytes``: everything on the card that was
                      not the pool, read once at construction
``O``                 ``own_high_water_bytes``: the parent's device high-water as
                      the pool knew it when the card ran out
``R``                 ``reserve_bytes``: kept free on purpose
``B``, ``n``          ``booked_bytes``, ``running``: the asks of the ``n`` tasks
                      running on the card, the failing one's included
``W``                 the most tasks the log shows running on the card so far;
                      ``W - n`` workers may be idle or retiring, each holding
                      its context
``A``                 ``task_ask_bytes``: the failing task's own ask (its price)
``r``, ``q``          ``reached_bytes``, ``requested_bytes``: what the failing
                      child held at its peak, and the allocation refused
``U``, ``F``          ``live_used_bytes``, ``live_free_bytes``: the card read by
                      the parent *after* the child reported, so the failing
                      child had already given back what it reached (at most
                      ``r`` of it remains) and the others held what they held
====================  ==========================================================

From them, in this order:

1. **The ask.** The failing task needed at least ``need = r + q``. If
   ``need > A`` it went past its price by ``need - A``: the ask was
   underestimated. (The pool then re-prices the key at ``need``.)
2. **The pool's children at the reading** are estimated from above:
   ``children = others + r`` with ``others = B - A`` (the other running
   tasks at their booked asks), or, when the failing task went past its
   price, ``others = max(B - A, (n - 1) * need)`` (tasks of one key are alike;
   the record does not name the others' keys), plus ``(W - n) * r`` for the
   idle or retiring workers' contexts (a context is at most what the failing
   task reached: ``r`` includes its own context; where the child could not
   measure ``r``, as with rows hidden in a container, ``A`` stands for it). A record that carries
   ``live_pool_bytes`` (the pool's children as read) is used as is.
3. **Outside the pool** then held at least ``outside = U - children``, which
   the census priced at ``C + O``. ``growth = outside - (C + O)`` is a lower
   bound on what processes that are not the pool's children grew by after
   they were priced; it counts only past the reserve (``growth > R``), which
   covers the driver's own growth and page rounding.
4. **Own or co-tenant.** With ``live_own_bytes`` in the record (the parent's
   device bytes read at the out-of-memory) the growth splits exactly:
   ``own = live_own - O`` and ``co_tenant = U - children - live_own - C``.
   Without it, the only evidence of the parent's growth is a larger
   ``own_high_water_bytes`` in a later record of the same card
   (``own = later - O``); the rest of ``growth`` is the co-tenant's, and the
   analysis says that own growth could not be told apart
   (``own_separable: false``).
5. **Over the room.** The running tasks were booked at more than the
   card's room, ``B > T - C - O - R`` (less other pools' bookings): the width
   itself ran past the bound (a fixed ``width=``, the serial floor), by
   ``B - room``.
6. **Unattributed.** When no term went past its price by these figures, the
   rest is named as unattributed: ``U + q - T`` (at least what the card was
   short at the reading), left to allocator fragmentation, the driver, or a
   reading taken after the card had recovered.

The verdict names every wrong term found, largest first; ``verdict`` is the
first of them, or ``"unattributed"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpupool._core.events import describe_task
from gpupool._core.units import format_size

__all__ = ["OomAnalysis", "analyse_oom", "record_float", "record_int", "record_str"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OomAnalysis:
    """One out-of-memory record, the card as it stood, and the term that was wrong.

    Attributes:
        line: the record's line in the log.
        time_s: seconds since the pool was constructed.
        device: the card.
        key: the failing task's key.
        total_bytes: ``T``.
        census_co_tenant_bytes: ``C``.
        own_high_water_bytes: ``O``.
        reserve_bytes: ``R``.
        booked_bytes: ``B``.
        running: ``n``.
        task_ask_bytes: ``A``.
        key_ask_bytes: the key's ask when it failed (the record's ``ask_bytes``).
        ask_basis: its basis.
        reached_bytes: ``r``.
        requested_bytes: ``q``.
        live_used_bytes: ``U``.
        live_free_bytes: ``F``.
        need_bytes: ``r + q``, or ``None`` when either is missing.
        ask_shortfall_bytes: ``need - A`` when positive, else 0.
        children_bytes: the pool's children at the reading (step 2).
        co_tenant_live_bytes: ``C`` plus the co-tenant's growth, where derivable.
        co_tenant_growth_bytes: step 4's co-tenant share.
        own_live_bytes: the parent's bytes at the reading, where known.
        own_growth_bytes: step 4's own share.
        own_separable: whether own growth could be told from a co-tenant's.
        unattributed_bytes: step 5's rest.
        pool_read: the pool's children were read from the card's rows
            (``live_pool_bytes``), not estimated from the bookings.
        runs_by_key: the tasks running on the card when it ran out, per key: how many,
            and what they were booked at when they started (the record's ``runs``).
        retry: whether the pool retried the task.
        wrong_terms: the terms found wrong, largest first, with their bytes.
        verdict: the first wrong term, or ``"unattributed"``.
        explanation: the verdict in one sentence, every number in it.
        missing: the record's terms that were needed and absent.
        task_booked_bytes: what the failing task was booked at when it started (the
            record's ``task_booked_bytes``: below its ask where its key's tasks were priced
            together), or ``None`` where the record does not say.
        run_bookings: per key of ``runs_by_key``, each running task's booking when it
            started, as the record's ``runs`` table states it (in the table's order).
        task: the failing task in words (its ``map`` entry and label:
            :func:`~gpupool._core.events.describe_task`), or empty.
    """

    line: int
    time_s: float
    device: int | None
    key: str | None
    total_bytes: int | None
    census_co_tenant_bytes: int | None
    own_high_water_bytes: int | None
    reserve_bytes: int
    booked_bytes: int | None
    running: int | None
    task_ask_bytes: int | None
    key_ask_bytes: int | None
    ask_basis: str | None
    reached_bytes: int | None
    requested_bytes: int | None
    live_used_bytes: int | None
    live_free_bytes: int | None
    need_bytes: int | None
    ask_shortfall_bytes: int
    children_bytes: int | None
    co_tenant_live_bytes: int | None
    co_tenant_growth_bytes: int
    own_live_bytes: int | None
    own_growth_bytes: int
    own_separable: bool
    unattributed_bytes: int | None
    pool_read: bool
    runs_by_key: tuple[tuple[str, int, int], ...]
    retry: bool
    wrong_terms: tuple[tuple[str, int], ...]
    verdict: str
    explanation: str
    missing: tuple[str, ...]
    task_booked_bytes: int | None = None
    run_bookings: tuple[tuple[str, tuple[int, ...]], ...] = ()
    task: str = ""

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict of every field."""
        out = {name: getattr(self, name) for name in self.__slots__}
        out["wrong_terms"] = [{"term": t, "bytes": b} for t, b in self.wrong_terms]
        out["runs_by_key"] = [
            {"key": k, "running": n, "booked_bytes": b} for k, n, b in self.runs_by_key
        ]
        out["missing"] = list(self.missing)
        out["run_bookings"] = [{"key": k, "booked_bytes": list(b)} for k, b in self.run_bookings]
        return out


def record_str(record: Mapping[str, object], name: str) -> str | None:
    """The record's ``name`` if it is a string, else ``None``."""
    value = record.get(name)
    return value if isinstance(value, str) else None


def record_int(record: Mapping[str, object], name: str) -> int | None:
    """The record's ``name`` if it is an integer (not a bool), else ``None``."""
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def analyse_oom(
    record: Mapping[str, object],
    *,
    line: int = 0,
    later_own_high_water_bytes: int | None = None,
    most_running: int | None = None,
) -> OomAnalysis:
    """Attribute one ``out_of_memory`` record (pure: the arithmetic of the module docstring).

    Args:
        record: the record as read from the log.
        line: its line number, for the report.
        later_own_high_water_bytes: the largest ``own_high_water_bytes`` that a
            later record of the same card carries, if any (evidence that the
            parent grew when the record has no ``live_own_bytes``).
        most_running: ``W``, the most tasks the log showed running on the
            card up to this record (default: ``running``).

    Returns:
        The card as it stood and the verdict.
    """
    terms = _parse_terms(record)
    figures = _derive_figures(terms, later_own_high_water_bytes, most_running)
    return _report(record, line, terms, figures)


def _report(
    record: Mapping[str, object], line: int, terms: _Terms, figures: _Figures
) -> OomAnalysis:
    """Report: the terms and figures as an :class:`OomAnalysis`, beside what the record says
    of its own (the time, the card, the task and its key's ask, the tasks running on the card,
    whether the pool retried it)."""
    missing = terms.missing()
    return OomAnalysis(
        line=line,
        time_s=record_float(record.get("time_s")),
        device=record_int(record, "device"),
        key=record_str(record, "key"),
        task=describe_task(record),
        total_bytes=terms.total,
        census_co_tenant_bytes=terms.census_co,
        own_high_water_bytes=terms.own_hw,
        reserve_bytes=terms.reserve,
        booked_bytes=terms.booked,
        running=terms.running,
        task_ask_bytes=terms.ask,
        key_ask_bytes=record_int(record, "ask_bytes"),
        ask_basis=record_str(record, "ask_basis"),
        reached_bytes=terms.reached,
        requested_bytes=terms.requested,
        live_used_bytes=terms.used,
        live_free_bytes=terms.free,
        need_bytes=figures.need,
        ask_shortfall_bytes=figures.shortfall,
        children_bytes=figures.children,
        co_tenant_live_bytes=figures.split.co_live,
        co_tenant_growth_bytes=figures.split.co_growth,
        own_live_bytes=figures.split.own_live,
        own_growth_bytes=figures.split.own_growth,
        own_separable=figures.split.separable,
        unattributed_bytes=figures.unattributed,
        pool_read=terms.live_pool is not None,
        runs_by_key=_runs_by_key(record.get("runs")),
        retry=record.get("retry") is True,
        wrong_terms=figures.wrong_terms,
        verdict=figures.wrong_terms[0][0] if figures.wrong_terms else "unattributed",
        explanation=_explain(terms, figures, missing),
        missing=tuple(missing),
        task_booked_bytes=record_int(record, "task_booked_bytes"),
        run_bookings=_run_bookings(record.get("runs")),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Terms:
    """The record's terms (the module docstring's letters), read once; ``None`` if absent."""

    total: int | None
    census_co: int | None
    own_hw: int | None
    reserve: int
    booked: int | None
    running: int | None
    ask: int | None
    reached: int | None
    requested: int | None
    used: int | None
    free: int | None
    live_pool: int | None
    live_own: int | None
    others_held: int
    others_overrun: int
    other_pools: int

    def missing(self) -> list[str]:
        """The needed terms the record lacks, by their names in the record."""
        needed = {
            "total_bytes": self.total,
            "census_co_tenant_bytes": self.census_co,
            "own_high_water_bytes": self.own_hw,
            "booked_bytes": self.booked,
            "running": self.running,
            "task_ask_bytes": self.ask,
            "reached_bytes": self.reached,
            "requested_bytes": self.requested,
            "live_used_bytes": self.used,
        }
        missing = [name for name, value in needed.items() if value is None]
        if self.live_own is None:
            missing.append("live_own_bytes")
        return missing


def _parse_terms(record: Mapping[str, object]) -> _Terms:
    """Gather: the record's terms, with the older names a log may still carry."""
    census_co = record_int(record, "census_co_tenant_bytes")
    if census_co is None:
        census_co = record_int(record, "co_tenant_bytes")
    # The own high-water the running tasks were priced at, where the record has
    # it: the pool re-reads its own bytes before every start, so the record's
    # bound may already include growth that the running tasks were not priced for.
    own_hw = record_int(record, "priced_own_high_water_bytes")
    if own_hw is None:
        own_hw = record_int(record, "own_high_water_bytes")
    return _Terms(
        total=record_int(record, "total_bytes"),
        census_co=census_co,
        own_hw=own_hw,
        reserve=record_int(record, "reserve_bytes") or 0,
        booked=record_int(record, "booked_bytes"),
        running=record_int(record, "running"),
        ask=record_int(record, "task_ask_bytes"),
        reached=record_int(record, "reached_bytes"),
        requested=record_int(record, "requested_bytes"),
        used=record_int(record, "live_used_bytes"),
        free=record_int(record, "live_free_bytes"),
        live_pool=record_int(record, "live_pool_bytes"),
        live_own=record_int(record, "live_own_bytes"),
        others_held=record_int(record, "other_pools_held_bytes") or 0,
        others_overrun=record_int(record, "other_pools_overrun_bytes") or 0,
        other_pools=record_int(record, "other_pools_bytes") or 0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Figures:
    """What steps 1 to 6 derive from the terms, and the wrong terms they found."""

    need: int | None
    shortfall: int
    children: int | None
    split: _Growth
    room: int | None
    unattributed: int | None
    wrong_terms: tuple[tuple[str, int], ...]


def _derive_figures(t: _Terms, later_own_hw: int | None, most_running: int | None) -> _Figures:
    """Derive: the module docstring's steps, in its order, on the record's terms."""
    # 1. the ask
    need = t.reached + t.requested if t.reached is not None and t.requested is not None else None
    shortfall = max(0, need - t.ask) if need is not None and t.ask is not None else 0

    # 2. the pool's children at the reading
    children = t.live_pool
    if children is None and t.booked is not None and t.ask is not None:
        children = _children_from_bookings(
            t.booked, t.ask, need, shortfall, t.running, t.reached, most_running
        )

    # 3. outside the pool; 4. own or co-tenant
    split = _Growth(own_live=t.live_own, separable=t.live_own is not None)
    if (
        t.used is not None
        and children is not None
        and t.census_co is not None
        and t.own_hw is not None
    ):
        # Other gpupool pools' tasks are priced by their bookings, not as co-tenants.
        outside = t.used - children - t.others_held
        split = _split_growth(outside, t.census_co, t.own_hw, t.live_own, later_own_hw)

    # 5. over the room
    room = None
    if t.total is not None and t.census_co is not None and t.own_hw is not None:
        room = t.total - t.census_co - t.own_hw - t.reserve - t.other_pools

    # 6. unattributed
    unattributed: int | None = None
    if t.used is not None and t.requested is not None and t.total is not None:
        unattributed = max(0, t.used + t.requested - t.total)
    return _Figures(
        need=need,
        shortfall=shortfall,
        children=children,
        split=split,
        room=room,
        unattributed=unattributed,
        wrong_terms=_judge_terms(t, need, shortfall, split, room),
    )


def _judge_terms(
    t: _Terms, need: int | None, shortfall: int, split: _Growth, room: int | None
) -> tuple[tuple[str, int], ...]:
    """Judge: every term past its price (growth only past the reserve), in the verdict's order."""
    terms: list[tuple[str, int]] = []
    if need is not None and t.total is not None and need > t.total:
        terms.append(("larger_than_card", need - t.total))
    if shortfall > 0:
        terms.append(("ask", shortfall))
    if split.co_growth > t.reserve:
        terms.append(("co_tenant", split.co_growth))
    if split.own_growth > t.reserve:
        terms.append(("own", split.own_growth))
    if t.others_overrun > t.reserve:
        terms.append(("another_pool", t.others_overrun))
    if room is not None and t.booked is not None and t.booked > max(room, 0):
        terms.append(("over_room", t.booked - max(room, 0)))
    # A task larger than the card is named first: no other term could have let it run.
    terms.sort(key=lambda term: (term[0] != "larger_than_card", -term[1]))
    return tuple(terms)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Growth:
    """Step 4: what the bytes outside the pool grew by, split into own and co-tenant."""

    own_growth: int = 0
    co_growth: int = 0
    own_live: int | None = None
    co_live: int | None = None
    separable: bool = False


def _children_from_bookings(
    booked: int,
    ask: int,
    need: int | None,
    shortfall: int,
    running: int | None,
    reached: int | None,
    most_running: int | None,
) -> int:
    """Step 2 without a reading of the pool's rows: the others at their booked asks (or at
    the failing task's need, when it went past its price), plus idle workers' contexts."""
    others = max(0, booked - ask)
    if shortfall and need is not None and running is not None:
        others = max(others, max(0, running - 1) * need)
    idle = max(0, (most_running or 0) - (running or 0))
    # Without the failing child's peak (rows hidden: a container, MIG), it and each idle
    # worker count at its ask: from above, as the rest of the step (never 0, which would
    # name the pool's own bytes a co-tenant's growth).
    return others + (reached if reached is not None else ask) * (1 + idle)


def _split_growth(
    outside: int,
    census_co: int,
    own_hw: int,
    live_own: int | None,
    later_own_hw: int | None,
) -> _Growth:
    """Steps 3 and 4: ``outside`` (used less the pool's children and other pools' tasks)
    against its price, split into own and co-tenant growth."""
    if live_own is not None:
        co_growth = max(0, outside - live_own - census_co)
        return _Growth(
            own_growth=max(0, live_own - own_hw),
            co_growth=co_growth,
            own_live=live_own,
            co_live=census_co + co_growth,
            separable=True,
        )
    growth = outside - census_co - own_hw
    own_growth, own_live, separable = 0, None, False
    if later_own_hw is not None and later_own_hw > own_hw:
        own_growth, own_live, separable = later_own_hw - own_hw, later_own_hw, True
    co_growth = max(0, growth - own_growth)
    return _Growth(
        own_growth=own_growth,
        co_growth=co_growth,
        own_live=own_live,
        co_live=census_co + co_growth,
        separable=separable,
    )


def _runs_by_key(table: object) -> tuple[tuple[str, int, int], ...]:
    """The record's ``runs`` table summed per key (rows that are not rows are skipped)."""
    if not isinstance(table, list):
        return ()
    by_key: dict[str, tuple[int, int]] = {}
    for row in table:
        if not isinstance(row, dict) or not isinstance(row.get("key"), str):
            continue
        booked = record_int(row, "booked_bytes") or 0
        count, total = by_key.get(row["key"], (0, 0))
        by_key[row["key"]] = (count + 1, total + booked)
    return tuple((key, n, b) for key, (n, b) in by_key.items())


def _run_bookings(table: object) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The record's ``runs`` table's bookings per key, each as stated (rows that are not rows
    are skipped, as :func:`_runs_by_key` skips them)."""
    if not isinstance(table, list):
        return ()
    by_key: dict[str, list[int]] = {}
    for row in table:
        if not isinstance(row, dict) or not isinstance(row.get("key"), str):
            continue
        by_key.setdefault(row["key"], []).append(record_int(row, "booked_bytes") or 0)
    return tuple((key, tuple(booked)) for key, booked in by_key.items())


def _explain(t: _Terms, f: _Figures, missing: list[str]) -> str:
    """Format: the verdict in one sentence, every number in it, or why none can be named."""
    if f.wrong_terms:
        return "; ".join(_explain_term(term, nbytes, t, f) for term, nbytes in f.wrong_terms)
    lacking = [m for m in missing if m != "live_own_bytes"]
    if lacking:
        return "no term can be named: the record lacks " + ", ".join(lacking)
    return (
        "no term went past its price by the record's figures; "
        f"{format_size(f.unattributed)} (live used + refused - total) is unattributed: "
        "allocator fragmentation, the driver, or a reading taken after the card recovered"
    )


def _explain_term(term: str, nbytes: int, t: _Terms, f: _Figures) -> str:
    """One wrong term's clause, with the figures that show it wrong."""
    if term == "larger_than_card":
        return (
            f"the task needs more than the card can hold: at least {format_size(f.need)} "
            f"({format_size(t.reached)} held + {format_size(t.requested)} refused) on a "
            f"{format_size(t.total)} card; its ask was {format_size(t.ask)}, and no price or "
            "width would have run it there"
        )
    if term == "ask":
        return (
            f"the ask was underestimated: the task needed at least {format_size(f.need)} "
            f"({format_size(t.reached)} reached + {format_size(t.requested)} refused), "
            f"{format_size(nbytes)} more than its price of {format_size(t.ask)}"
        )
    if term == "co_tenant":
        note = (
            ""
            if f.split.separable
            else " (or this process: the two cannot be told apart. The card's process "
            "rows at the out-of-memory would have: this process's own row "
            "(live_own_bytes) and its workers' (live_pool_bytes); the driver listed none of "
            "them, as in a container (no rows before driver 535.113, other PIDs after) or "
            "on a MIG instance)"
        )
        return (
            f"a co-tenant grew after the census by at least {format_size(nbytes)} beyond "
            f"the {format_size(t.census_co)} it was priced at{note}"
        )
    if term == "another_pool":
        return f"another pool on the card grew {format_size(nbytes)} past what it had booked"
    if term == "over_room":
        return (
            f"the running tasks were booked at {format_size(t.booked)}, more than the card's "
            f"room of {format_size(f.room)}: the width ran past the bound (a fixed width= "
            "wider than the bound, or the serial floor), so no price was wrong"
        )
    # "own", the last term _judge_terms names
    return (
        f"the pool's own process grew {format_size(nbytes)} past the "
        f"{format_size(t.own_hw)} high-water the width was priced at"
    )


def record_float(value: object) -> float:
    """A finite number from a record's value; anything else (a string, NaN) reads as 0.0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    number = float(value)
    return number if math.isfinite(number) else 0.0
