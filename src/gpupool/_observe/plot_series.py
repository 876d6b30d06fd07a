"""What ``gpupool plot`` draws of one card, folded from a run's records in bounded memory.

A reader's part (no matplotlib): :func:`plot_point` folds each record of a
card into its :class:`DevicePlot`. Every series is thinned (every other point
dropped) when it reaches :data:`MAX_POINTS`; the marks (events with their
reason) when they reach :data:`MAX_MARKS` (all are counted); a card names at
most :data:`MAX_PLOT_KEYS` task keys, and books the rest together under
:data:`OTHER_KEYS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool._core.attribution import record_int
from gpupool._core.events import describe_task

__all__ = [
    "MARK_EVENTS",
    "MAX_MARKS",
    "MAX_PLOT_KEYS",
    "MAX_POINTS",
    "OTHER_KEYS",
    "WAIT_EVENTS",
    "CardView",
    "DevicePlot",
    "Mark",
    "Marks",
    "PoolView",
    "Series",
    "View",
    "plot_point",
]

#: Points kept per plotted series before it is thinned by half.
MAX_POINTS = 4096

#: Marks (an event's time, value and reason) kept per card and event before they are
#: thinned by half.
MAX_MARKS = 512

#: Task keys a card's bookings name; later keys are booked together as :data:`OTHER_KEYS`.
MAX_PLOT_KEYS = 12
OTHER_KEYS = "(other keys)"

#: The events drawn as marks, each with its reason.
MARK_EVENTS = (
    "out_of_memory",
    "widen_refused",
    "cap_lifted",
    "live_gate_wait",
    "share_wait",
    "head_wait",
    "critical_wait",
    "serial_start",
)

#: The events that held a task back.
WAIT_EVENTS = ("live_gate_wait", "share_wait", "head_wait", "critical_wait")

Mark = tuple[float, int, str]


class Series:
    """Points ``(time_s, *values)`` kept under :data:`MAX_POINTS` by thinning in half."""

    __slots__ = ("_skip", "points", "stride")

    def __init__(self) -> None:
        self.points: list[tuple[float, ...]] = []
        self.stride = 1
        self._skip = 0

    def add(self, *point: float) -> None:
        self._skip += 1
        if self._skip < self.stride:
            return
        self._skip = 0
        self.points.append(point)
        if len(self.points) >= MAX_POINTS:
            self.points = self.points[::2]
            self.stride *= 2


class Marks:
    """One event's ``(time_s, value, reason)`` marks, kept under :data:`MAX_MARKS` by thinning
    in half; ``count`` is every one seen."""

    __slots__ = ("_skip", "count", "points", "stride")

    def __init__(self) -> None:
        self.points: list[tuple[float, int, str]] = []
        self.count = 0
        self.stride = 1
        self._skip = 0

    def add(self, time_s: float, value: int, reason: str) -> None:
        self.count += 1
        self._skip += 1
        if self._skip < self.stride:
            return
        self._skip = 0
        self.points.append((time_s, value, reason))
        if len(self.points) >= MAX_MARKS:
            self.points = self.points[::2]
            self.stride *= 2


@dataclass(slots=True)
class DevicePlot:
    """One device's terms over time, as the plot draws them (thinned when long).

    Attributes:
        device: the device index.
        terms: ``(time_s, total, co_tenant, own_high_water, ask, width, ceiling,
            other_pools, together_tasks, together_bytes)`` from every record that carries
            the bound (``-1``: not in the record; ``together_*``: the pooled price the bound
            stated, "X for the K together", where the key's tasks were priced together).
        live_used: ``(time_s, live_used_bytes)`` where a record read the card, at the
            time of the reading (a sample's ``read_s``).
        reads: ``(time_s, used, co_tenant, own, other_pools)`` from each record that
            splits a reading (``card_read``, ``out_of_memory``): the co-tenants and the
            parent as read, or the census co-tenant and the own high-water where the
            reading could not split them; at the time of the reading.
        key_names: the task keys ``keys`` books, in the order first seen.
        keys: ``(time_s, *booked_bytes)`` with each reading: what the tasks running then
            were booked at when they started, summed per key of ``key_names``.
        limit: ``(time_s, tasks_fit, oom_cap)`` at each change of this card's own limit:
            the tasks its room holds at the ask (the record's ``tasks_fit``), and the cap
            an out-of-memory set (``-1``: none, or not in the record).
        marks: per event of :data:`MARK_EVENTS`, its marks; the value is the bytes the
            card was asked for (used + refused) for an out-of-memory, else the width.
        total_bytes: the card's total, as the last record that carries it says (0: none).
    """

    device: int
    terms: Series = field(default_factory=Series)
    live_used: Series = field(default_factory=Series)
    reads: Series = field(default_factory=Series)
    key_names: list[str] = field(default_factory=list)
    keys: Series = field(default_factory=Series)
    limit: Series = field(default_factory=Series)
    marks: dict[str, Marks] = field(default_factory=dict)
    total_bytes: int = 0
    _census: tuple[int, int, int] = (0, 0, 0)
    _limit: tuple[int, int] | None = None


def plot_point(plot: DevicePlot, record: Mapping[str, Any], event: str, time_s: float) -> None:
    """Fold one record of ``plot``'s device into it."""
    plot.total_bytes = record_int(record, "total_bytes") or plot.total_bytes
    _terms(plot, record, event, time_s)
    used = record_int(record, "live_used_bytes")
    if used is not None:
        read_s = _read_s(plot, record, time_s)
        plot.live_used.add(read_s, used)
        if event in ("card_read", "out_of_memory"):
            _reading(plot, record, used, read_s)
            _keys(plot, record.get("keys" if event == "card_read" else "runs"), time_s)
    _limit(plot, record, time_s)
    if event in MARK_EVENTS:
        requested = record_int(record, "requested_bytes") or 0
        total = record_int(record, "total_bytes") or 0
        width = record_int(record, "width_after")
        value = (
            ((used + requested) if used is not None else total)
            if event == "out_of_memory"
            else (width or 0)
        )
        reason = record.get("reason")
        said = reason if isinstance(reason, str) else event
        task = describe_task(record)  # the task the record is about, where it names one
        plot.marks.setdefault(event, Marks()).add(
            time_s, value, f"{task}: {said}" if task else said
        )


def _read_s(plot: DevicePlot, record: Mapping[str, Any], time_s: float) -> float:
    """When the record's reading was taken (a sample's ``read_s``), never before an earlier one."""
    read_s = record.get("read_s")
    when = time_s
    if isinstance(read_s, (int, float)) and not isinstance(read_s, bool) and 0 <= read_s <= time_s:
        when = float(read_s)
    last = plot.live_used.points[-1][0] if plot.live_used.points else 0.0
    return max(when, last)


def _terms(plot: DevicePlot, record: Mapping[str, Any], event: str, time_s: float) -> None:
    total = record_int(record, "total_bytes")
    co = record_int(record, "co_tenant_bytes")
    own = record_int(record, "own_high_water_bytes")
    ask = record_int(record, "ask_bytes")
    if total is None or co is None or own is None or ask is None:
        return
    width = record_int(record, "width_after")
    ceiling = record_int(record, "ceiling")
    if event == "out_of_memory":
        width = None  # the narrowed record that follows carries the new width
    others = record_int(record, "other_pools_bytes") or 0
    together_tasks = record_int(record, "together_tasks")
    together_bytes = record_int(record, "together_bytes")
    stated = together_tasks is not None and together_bytes is not None
    plot.terms.add(
        time_s,
        total,
        co,
        own,
        ask,
        width if width is not None else -1,
        ceiling if ceiling is not None else -1,
        others,
        together_tasks if stated and together_tasks is not None else -1,
        together_bytes if stated and together_bytes is not None else -1,
    )
    plot._census = (co, own, others)


def _reading(plot: DevicePlot, record: Mapping[str, Any], used: int, time_s: float) -> None:
    """The reading's split; a term the reading lacks is the census's (as priced)."""
    census_co, census_own, census_others = plot._census
    co = record_int(record, "live_co_tenant_bytes")
    own = record_int(record, "live_own_bytes")
    others = record_int(record, "live_other_pools_bytes")
    plot.reads.add(
        time_s,
        used,
        co if co is not None else census_co,
        own if own is not None else census_own,
        others if others is not None else census_others,
    )


def _keys(plot: DevicePlot, table: object, time_s: float) -> None:
    """The bookings of a reading's ``keys`` table (or an out-of-memory's ``runs``), by key."""
    booked = [0] * len(plot.key_names)
    for row in table if isinstance(table, list) else ():
        key = row.get("key") if isinstance(row, dict) else None
        amount = record_int(row, "booked_bytes") if isinstance(row, dict) else None
        if not isinstance(key, str) or amount is None:
            continue
        if key not in plot.key_names:
            if len(plot.key_names) >= MAX_PLOT_KEYS:
                key = OTHER_KEYS
            if key not in plot.key_names:
                plot.key_names.append(key)
                booked.append(0)
        booked[plot.key_names.index(key)] += amount
    plot.keys.add(time_s, *booked)


def _limit(plot: DevicePlot, record: Mapping[str, Any], time_s: float) -> None:
    """This card's own limit: the tasks its room holds at the ask, as the record states it
    (``tasks_fit``: the planner's count, never worked out again here; a log written before
    the records carried it draws no such limit), and an out-of-memory's cap."""
    fit, cap = plot._limit if plot._limit is not None else (-1, -1)
    if "tasks_fit" in record:
        stated = record_int(record, "tasks_fit")
        fit = stated if stated is not None else -1
    if "oom_cap" in record:
        capped = record_int(record, "oom_cap")
        cap = capped if capped is not None else -1
    if (fit >= 0 or cap >= 0) and (fit, cap) != plot._limit:
        plot._limit = (fit, cap)
        plot.limit.add(time_s, fit, cap)


# -- what a card's panels draw ----------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class CardView:
    """What the plot draws for one card in one run (times in seconds from the run's start).

    Attributes:
        title: the panel's title.
        total_bytes: the card's capacity.
        end_s: the run's last second.
        name: names the card's panels (``"card 0"``, ``"run 2 card 0"``).
        priced: ``(time_s, co_tenant_bytes, own_high_water_bytes, other_pools_bytes,
            price_bytes)`` steps: the bound's terms, as the width was priced. ``price_bytes``
            is what the record states the tasks were priced at: for a key priced together,
            the pooled price ("X for the K together"; where the width is below K, the
            lesser of that price and width x ask, which the width's own price is under),
            else width x ask.
        reads: ``(time_s, used, co_tenant, own, other_pools)`` steps: the card as read.
        key_names: the task keys ``keys`` books.
        keys: ``(time_s, booked_bytes per key of key_names)`` steps, with each reading.
        used: ``(time_s, used_bytes)``: the card as read.
        used_label: what ``used`` is (the log's readings, a caller's samples).
        used_sampled: ``used`` is dense samples (drawn as a line alone), not readings
            (each a dot, held until the next).
        width: ``(time_s, width)`` steps.
        limit: ``(time_s, tasks_fit, oom_cap)`` steps: this card's own limits (``-1``: none).
        ceiling: ``(time_s, ceiling)`` steps of the pool-wide ceiling, given only where
            it is this card's (the pool has one card).
        marks: per event (``"out_of_memory"``, ``"widen_refused"``, ...), its
            ``(time_s, value, reason)``; an out-of-memory's value is the bytes the
            card was asked for (used + refused).
        counts: per event, how many there were (more than ``marks`` keeps, in a long run).
    """

    title: str
    total_bytes: int
    end_s: float
    name: str = "card"
    priced: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    reads: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    key_names: list[str] = field(default_factory=list)
    keys: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    used: list[tuple[float, int]] = field(default_factory=list)
    used_label: str = "used, as read (a dot per reading)"
    used_sampled: bool = False
    width: list[tuple[float, int]] = field(default_factory=list)
    limit: list[tuple[float, int, int]] = field(default_factory=list)
    ceiling: list[tuple[float, int]] = field(default_factory=list)
    marks: dict[str, list[Mark]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, event: str) -> int:
        """How many ``event`` records the card had."""
        return self.counts.get(event, len(self.marks.get(event, ())))


@dataclass(slots=True, kw_only=True)
class PoolView:
    """The pool-wide panel of a run of several cards: their width together and the ceiling
    (each field as :class:`CardView`'s; ``name``: ``"pool"``, ``"run 2 pool"``)."""

    title: str
    end_s: float
    name: str = "pool"
    width: list[tuple[float, int]] = field(default_factory=list)
    ceiling: list[tuple[float, int]] = field(default_factory=list)


View = CardView | PoolView
