"""Read a decision log back: what the pool did, and which term was wrong when a card ran out.

A reader, not part of the pool: it streams a JSON Lines decision log (written
with ``GpuPoolExecutor(log_path=...)``) one line at a time, keeps only bounded
aggregates, and parses with :mod:`json` alone (nothing in a log is executed or
unpickled). ``gpupool postmortem`` and ``gpupool plot`` print what it returns.

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
   task reached: ``r`` includes its own context). A record that carries
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
5. **Unattributed.** When no term went past its price by these figures, the
   rest is named as unattributed: ``U + q - T`` (at least what the card was
   short at the reading), left to allocator fragmentation, the driver, or a
   reading taken after the card had recovered.

The verdict names every wrong term found, largest first; ``verdict`` is the
first of them, or ``"unattributed"``.

Bounded memory: a log grows with decisions, but a long run still writes
many; every series kept here is thinned (every other point dropped) when it
reaches :data:`MAX_POINTS`, and at most :data:`MAX_OOM_DETAILS` out-of-memory
analyses are kept in full (all are counted).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupool._core.events import EVENTS, SCHEMA_VERSION
from gpupool._core.units import format_size
from gpupool._errors import GpuPoolError

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_OOM_DETAILS",
    "MAX_POINTS",
    "DecisionLogError",
    "DevicePlot",
    "EmptyLogError",
    "OomAnalysis",
    "Postmortem",
    "analyse_oom",
    "format_postmortem",
    "iter_records",
    "read_postmortem",
]

#: The longest line a decision record can be. The executor caps the one free
#: text it copies (an error message) at 500 characters; a record is under
#: 4 KiB. A longer line means the file is not a decision log, and reading it
#: whole would break the reader's memory bound.
MAX_LINE_BYTES = 1024 * 1024

#: Points kept per plotted series before it is thinned by half.
MAX_POINTS = 4096

#: Out-of-memory analyses kept in full; the rest are counted.
MAX_OOM_DETAILS = 256

#: Events that set a device's width (``width_after``).
_WIDTH_EVENTS = frozenset({"constructed", "narrowed", "widened"})


class DecisionLogError(GpuPoolError, ValueError):
    """The file is not a decision log this gpupool can read.

    Attributes:
        path: the file.
        line: the 1-based line number at fault, or ``None`` for the whole file.
    """

    def __init__(self, message: str, *, path: str, line: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.line = line


class EmptyLogError(DecisionLogError):
    """The file holds no decision records."""


# -- reading ---------------------------------------------------------------------------


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each record in a decision log, streaming.

    Blank lines are skipped. Only :func:`json.loads` touches the text.

    Args:
        path: a JSON Lines decision log.

    Yields:
        The 1-based line number and the record as a dict.

    Raises:
        DecisionLogError: the file cannot be opened, a line is not UTF-8 JSON
            (the last one: truncated), is not a decision record, or was written
            with a newer schema; the message names the line.
        EmptyLogError: the file holds no records.
    """
    name = str(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed in the finally below
    except OSError as exc:
        raise DecisionLogError(
            f"{name}: cannot be read ({exc.strerror or exc})", path=name, line=None
        ) from None
    seen = 0
    number = 0
    try:
        while True:
            raw = handle.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DecisionLogError(
                    f"{name}, line {number}: longer than {format_size(MAX_LINE_BYTES)}; "
                    "not a gpupool decision log",
                    path=name,
                    line=number,
                )
            ended = raw.endswith(b"\n")
            if not raw.strip():
                continue
            # readline() stops short of a newline only at the end of the file.
            record = _parse_line(raw, number=number, last=not ended, path=name)
            seen += 1
            yield number, record
    finally:
        handle.close()
    if seen == 0:
        raise EmptyLogError(
            f"{name}: empty, no decision records (was log_path= given to the pool, and did "
            "the pool get as far as its construction?)",
            path=name,
            line=None,
        )


def _parse_line(raw: bytes, *, number: int, last: bool, path: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        if last and raw.lstrip().startswith(b"{"):
            raise DecisionLogError(
                f"{path}, line {number}: truncated (the file ends in the middle of a record: "
                "was the pool killed, or is it still writing?)",
                path=path,
                line=number,
            ) from None
        raise DecisionLogError(
            f"{path}, line {number}: not JSON; not a gpupool decision log",
            path=path,
            line=number,
        ) from None
    if not isinstance(value, dict) or "schema" not in value or "event" not in value:
        raise DecisionLogError(
            f"{path}, line {number}: not a gpupool decision record (a JSON object with "
            "'schema' and 'event' keys)",
            path=path,
            line=number,
        )
    schema = value["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise DecisionLogError(
            f"{path}, line {number}: schema {schema!r} is not a decision-log schema version",
            path=path,
            line=number,
        )
    if schema > SCHEMA_VERSION:
        raise DecisionLogError(
            f"{path}, line {number}: written with decision-log schema {schema}; this gpupool "
            f"reads schema {SCHEMA_VERSION} at most. Read it with a newer gpupool.",
            path=path,
            line=number,
        )
    for key, item in value.items():
        # Records are flat (Decision.to_dict): scalars only, byte counts within int64.
        if isinstance(item, (dict, list)) or (
            isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**63
        ):
            raise DecisionLogError(
                f"{path}, line {number}: {key!r} holds {type(item).__name__} "
                f"{str(item)[:40]!r}, not a value a decision record has",
                path=path,
                line=number,
            )
    if not isinstance(value["event"], str) or value["event"] not in EVENTS:
        raise DecisionLogError(
            f"{path}, line {number}: unknown event {value['event']!r} for schema {schema}",
            path=path,
            line=number,
        )
    return value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a decision-log value")


# -- the out-of-memory attribution -----------------------------------------------------


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
        retry: whether the pool retried the task.
        wrong_terms: the terms found wrong, largest first, with their bytes.
        verdict: the first wrong term, or ``"unattributed"``.
        explanation: the verdict in one sentence, every number in it.
        missing: the record's terms that were needed and absent.
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
    retry: bool
    wrong_terms: tuple[tuple[str, int], ...]
    verdict: str
    explanation: str
    missing: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        out = {name: getattr(self, name) for name in self.__slots__}
        out["wrong_terms"] = [{"term": t, "bytes": b} for t, b in self.wrong_terms]
        out["missing"] = list(self.missing)
        return out


def _int(record: Mapping[str, Any], name: str) -> int | None:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def analyse_oom(
    record: Mapping[str, Any],
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
    total = _int(record, "total_bytes")
    census_co = _int(record, "census_co_tenant_bytes")
    if census_co is None:
        census_co = _int(record, "co_tenant_bytes")
    own_hw = _int(record, "own_high_water_bytes")
    reserve = _int(record, "reserve_bytes") or 0
    booked = _int(record, "booked_bytes")
    running = _int(record, "running")
    ask = _int(record, "task_ask_bytes")
    reached = _int(record, "reached_bytes")
    requested = _int(record, "requested_bytes")
    used = _int(record, "live_used_bytes")
    free = _int(record, "live_free_bytes")
    live_pool = _int(record, "live_pool_bytes")
    live_own = _int(record, "live_own_bytes")
    needed = {
        "total_bytes": total,
        "census_co_tenant_bytes": census_co,
        "own_high_water_bytes": own_hw,
        "booked_bytes": booked,
        "running": running,
        "task_ask_bytes": ask,
        "reached_bytes": reached,
        "requested_bytes": requested,
        "live_used_bytes": used,
    }
    missing = [name for name, value in needed.items() if value is None]
    if live_own is None:
        missing.append("live_own_bytes")

    # 1. the ask
    need = reached + requested if reached is not None and requested is not None else None
    shortfall = max(0, need - ask) if need is not None and ask is not None else 0

    # 2. the pool's children at the reading
    children: int | None = None
    if live_pool is not None:
        children = live_pool
    elif booked is not None and ask is not None:
        others = max(0, booked - ask)
        if shortfall and need is not None and running is not None:
            others = max(others, max(0, running - 1) * need)
        idle = max(0, (most_running or 0) - (running or 0))
        children = others + (reached or 0) * (1 + idle)

    # 3. outside the pool; 4. own or co-tenant
    growth = 0
    own_growth = 0
    co_growth = 0
    own_live: int | None = live_own
    co_live: int | None = None
    separable = live_own is not None
    if used is not None and children is not None and census_co is not None and own_hw is not None:
        outside = used - children
        growth = outside - census_co - own_hw
        if live_own is not None:
            own_growth = max(0, live_own - own_hw)
            co_growth = max(0, outside - live_own - census_co)
        else:
            if later_own_high_water_bytes is not None and later_own_high_water_bytes > own_hw:
                own_growth = later_own_high_water_bytes - own_hw
                own_live = later_own_high_water_bytes
                separable = True
            co_growth = max(0, growth - own_growth)
        co_live = census_co + co_growth
    terms: list[tuple[str, int]] = []
    if shortfall > 0:
        terms.append(("ask", shortfall))
    if co_growth > reserve:
        terms.append(("co_tenant", co_growth))
    if own_growth > reserve:
        terms.append(("own", own_growth))
    terms.sort(key=lambda term: -term[1])
    unattributed: int | None = None
    if used is not None and requested is not None and total is not None:
        unattributed = max(0, used + requested - total)
    verdict = terms[0][0] if terms else "unattributed"
    explanation = _explain(
        verdict,
        terms,
        ask=ask,
        need=need,
        reached=reached,
        requested=requested,
        census_co=census_co,
        own_hw=own_hw,
        separable=separable,
        unattributed=unattributed,
        missing=missing,
    )
    return OomAnalysis(
        line=line,
        time_s=_finite(record.get("time_s")),
        device=_int(record, "device"),
        key=record.get("key") if isinstance(record.get("key"), str) else None,
        total_bytes=total,
        census_co_tenant_bytes=census_co,
        own_high_water_bytes=own_hw,
        reserve_bytes=reserve,
        booked_bytes=booked,
        running=running,
        task_ask_bytes=ask,
        key_ask_bytes=_int(record, "ask_bytes"),
        ask_basis=record.get("ask_basis") if isinstance(record.get("ask_basis"), str) else None,
        reached_bytes=reached,
        requested_bytes=requested,
        live_used_bytes=used,
        live_free_bytes=free,
        need_bytes=need,
        ask_shortfall_bytes=shortfall,
        children_bytes=children,
        co_tenant_live_bytes=co_live,
        co_tenant_growth_bytes=co_growth,
        own_live_bytes=own_live,
        own_growth_bytes=own_growth,
        own_separable=separable,
        unattributed_bytes=unattributed,
        retry=record.get("retry") is True,
        wrong_terms=tuple(terms),
        verdict=verdict,
        explanation=explanation,
        missing=tuple(missing),
    )


def _explain(
    verdict: str,
    terms: list[tuple[str, int]],
    *,
    ask: int | None,
    need: int | None,
    reached: int | None,
    requested: int | None,
    census_co: int | None,
    own_hw: int | None,
    separable: bool,
    unattributed: int | None,
    missing: list[str],
) -> str:
    parts: list[str] = []
    for term, nbytes in terms:
        if term == "ask":
            parts.append(
                f"the ask was underestimated: the task needed at least {format_size(need)} "
                f"({format_size(reached)} reached + {format_size(requested)} refused), "
                f"{format_size(nbytes)} more than its price of {format_size(ask)}"
            )
        elif term == "co_tenant":
            note = (
                ""
                if separable
                else " (or this process: the record has no live reading of the pool's own "
                "bytes, so the two cannot be told apart)"
            )
            parts.append(
                f"a co-tenant grew after the census by at least {format_size(nbytes)} beyond "
                f"the {format_size(census_co)} it was priced at{note}"
            )
        elif term == "own":
            parts.append(
                f"the pool's own process grew {format_size(nbytes)} past the "
                f"{format_size(own_hw)} high-water the width was priced at"
            )
    if not parts:
        if [m for m in missing if m != "live_own_bytes"]:
            return "no term can be named: the record lacks " + ", ".join(
                m for m in missing if m != "live_own_bytes"
            )
        return (
            "no term went past its price by the record's figures; "
            f"{format_size(unattributed)} (live used + refused - total) is unattributed: "
            "allocator fragmentation, the driver, or a reading taken after the card recovered"
        )
    return "; ".join(parts)


# -- the run ---------------------------------------------------------------------------


class _Series:
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


@dataclass(slots=True)
class DevicePlot:
    """One device's terms over time, as the plot draws them (thinned when long).

    Attributes:
        device: the device index.
        terms: ``(time_s, total, co_tenant, own_high_water, ask, width, ceiling)``
            from every record that carries the bound.
        live_used: ``(time_s, live_used_bytes)`` where a record read the card.
        booked: ``(time_s, booked_bytes)`` from out-of-memory records.
        ooms: ``(time_s, bytes)``: where the card ran out (live used + refused).
        refused: ``(time_s, width)`` of every refused widen.
        gate_waits: ``(time_s, live_used_bytes)`` of every live-gate wait.
    """

    device: int
    terms: _Series = field(default_factory=_Series)
    live_used: _Series = field(default_factory=_Series)
    booked: _Series = field(default_factory=_Series)
    ooms: _Series = field(default_factory=_Series)
    refused: _Series = field(default_factory=_Series)
    gate_waits: _Series = field(default_factory=_Series)


@dataclass(slots=True)
class Postmortem:
    """What a decision log says about a run.

    Attributes:
        path: the log.
        records: records read.
        duration_s: the last record's ``time_s``.
        events: records per event.
        widths: ``(time_s, total width)`` at each change of the pool's width
            (the sum of the devices' widths, or the pool's own for host pools).
        device_widths: per device, ``(time_s, width)`` at each change.
        asks: per task key, the ask's changes ``(time_s, ask_bytes, basis)``.
        ooms: the analyses kept (at most :data:`MAX_OOM_DETAILS`).
        out_of_memory: out-of-memory records seen.
        verdicts: out-of-memory records per verdict.
        shutdown: the shutdown record's totals, or ``None`` if the log has none.
        devices: per device, the series the plot draws.
    """

    path: str
    records: int = 0
    duration_s: float = 0.0
    events: dict[str, int] = field(default_factory=dict)
    widths: _Series = field(default_factory=_Series)
    device_widths: dict[int, _Series] = field(default_factory=dict)
    asks: dict[str, _Series] = field(default_factory=dict)
    ooms: list[OomAnalysis] = field(default_factory=list)
    out_of_memory: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    shutdown: dict[str, Any] | None = None
    devices: dict[int, DevicePlot] = field(default_factory=dict)

    @property
    def tasks_lost(self) -> int | None:
        """Tasks the shutdown record counts as lost (must be 0), or ``None`` without one."""
        if self.shutdown is None:
            return None
        value = self.shutdown.get("tasks_lost")
        return value if isinstance(value, int) else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary: ``gpupool postmortem --json`` prints it."""
        return {
            "path": self.path,
            "schema": SCHEMA_VERSION,
            "records": self.records,
            "duration_s": self.duration_s,
            "events": dict(sorted(self.events.items())),
            "widths": [{"time_s": t, "width": int(w)} for t, w in self.widths.points],
            "device_widths": {
                str(d): [{"time_s": t, "width": int(w)} for t, w in s.points]
                for d, s in sorted(self.device_widths.items())
            },
            "asks": {
                key: {
                    "ask_bytes": int(s.points[-1][1]),
                    "basis": _BASES[int(s.points[-1][2])],
                    "history": [
                        {"time_s": t, "ask_bytes": int(a), "basis": _BASES[int(b)]}
                        for t, a, b in s.points
                    ],
                }
                for key, s in sorted(self.asks.items())
                if s.points
            },
            "out_of_memory": self.out_of_memory,
            "verdicts": dict(sorted(self.verdicts.items())),
            "retries": None if self.shutdown is None else self.shutdown.get("retries"),
            "tasks_lost": self.tasks_lost,
            "shutdown": self.shutdown,
            "ooms": [a.to_dict() for a in self.ooms],
        }


_BASES = ("estimated", "measured", "unknown")


def _basis_code(value: object) -> int:
    return _BASES.index(value) if value in _BASES[:2] else 2


def read_postmortem(path: str | Path) -> Postmortem:
    """Stream a decision log into a :class:`Postmortem`, in bounded memory.

    Out-of-memory records are analysed when the next record of their card
    that carries an own high-water is read (or at the end), so that a later
    high-water can count as evidence of the parent's growth.

    Raises:
        DecisionLogError: the file is not a readable decision log (see
            :func:`iter_records`).
    """
    pm = Postmortem(path=str(path))
    current: dict[int | None, int] = {}
    last_total: int | None = None
    waiting: list[tuple[int, dict[str, Any], int]] = []
    own_after: dict[int, int] = {}
    most: dict[int, int] = {}
    default_ask: tuple[float, int, int] | None = None
    for number, record in iter_records(path):
        pm.records += 1
        event = str(record["event"])
        pm.events[event] = pm.events.get(event, 0) + 1
        time_s = _finite(record.get("time_s"))
        pm.duration_s = max(pm.duration_s, time_s)
        device = _int(record, "device")
        own_hw = _int(record, "own_high_water_bytes")
        if device is not None and own_hw is not None and event != "out_of_memory":
            own_after[device] = max(own_after.get(device, 0), own_hw)
        if waiting and device is not None and own_hw is not None:
            waiting = _flush(pm, waiting, own_after, device=device)
        plot = pm.devices.setdefault(device, DevicePlot(device)) if device is not None else None
        width_after = _int(record, "width_after")
        if device is not None:
            for value in (_int(record, "running"), width_after if event in _WIDTH_EVENTS else None):
                if value is not None:
                    most[device] = max(most.get(device, 0), value)
        if event in _WIDTH_EVENTS and width_after is not None:
            if device is not None:
                pm.device_widths.setdefault(device, _Series()).add(time_s, width_after)
            current[device] = width_after
            per_device = {d: w for d, w in current.items() if d is not None}
            total_width = max(1, sum(per_device.values())) if per_device else width_after
            if total_width != last_total:
                pm.widths.add(time_s, total_width)
                last_total = total_width
        key = record.get("key")
        ask = _int(record, "ask_bytes")
        if key is None and ask is not None and default_ask is None:
            # The construction prices every key at the estimate before any is seen.
            default_ask = (time_s, ask, _basis_code(record.get("ask_basis")))
        if isinstance(key, str) and ask is not None and event != "out_of_memory":
            if key not in pm.asks:
                pm.asks[key] = _Series()
                if default_ask is not None:
                    pm.asks[key].add(*default_ask)
            series = pm.asks[key]
            basis = _basis_code(record.get("ask_basis"))
            if not series.points or series.points[-1][1:] != (ask, basis):
                series.add(time_s, ask, basis)
        if plot is not None:
            _plot_point(plot, record, event, time_s)
        if event == "out_of_memory":
            pm.out_of_memory += 1
            waiting.append((number, record, most.get(device, 0) if device is not None else 0))
        elif event == "shutdown":
            pm.shutdown = {
                name: record.get(name)
                for name in (
                    "time_s",
                    "tasks_completed",
                    "tasks_failed",
                    "tasks_cancelled",
                    "out_of_memory",
                    "retries",
                    "workers_lost",
                    "tasks_lost",
                    "reason",
                )
            }
    _flush(pm, waiting, own_after, device=None)
    return pm


def _flush(
    pm: Postmortem,
    waiting: list[tuple[int, dict[str, Any], int]],
    own_after: dict[int, int],
    *,
    device: int | None,
) -> list[tuple[int, dict[str, Any], int]]:
    """Analyse the waiting out-of-memory records of ``device`` (``None``: all)."""
    kept: list[tuple[int, dict[str, Any], int]] = []
    for number, record, most_running in waiting:
        card = _int(record, "device")
        if device is not None and card != device:
            kept.append((number, record, most_running))
            continue
        analysis = analyse_oom(
            record,
            line=number,
            later_own_high_water_bytes=own_after.get(card) if card is not None else None,
            most_running=most_running,
        )
        pm.verdicts[analysis.verdict] = pm.verdicts.get(analysis.verdict, 0) + 1
        if len(pm.ooms) < MAX_OOM_DETAILS:
            pm.ooms.append(analysis)
    return kept


def _plot_point(plot: DevicePlot, record: Mapping[str, Any], event: str, time_s: float) -> None:
    total = _int(record, "total_bytes")
    co = _int(record, "co_tenant_bytes")
    own = _int(record, "own_high_water_bytes")
    ask = _int(record, "ask_bytes")
    width = _int(record, "width_after")
    ceiling = _int(record, "ceiling")
    if total is not None and co is not None and own is not None and ask is not None:
        if event == "out_of_memory":
            width = None  # the narrowed record that follows carries the new width
        plot.terms.add(
            time_s,
            total,
            co,
            own,
            ask,
            width if width is not None else -1,
            ceiling if ceiling is not None else -1,
        )
    used = _int(record, "live_used_bytes")
    if used is not None:
        plot.live_used.add(time_s, used)
    if event == "out_of_memory":
        booked = _int(record, "booked_bytes")
        if booked is not None:
            plot.booked.add(time_s, booked)
        requested = _int(record, "requested_bytes") or 0
        plot.ooms.add(time_s, (used or 0) + requested if used is not None else (total or 0))
    elif event == "widen_refused":
        plot.refused.add(time_s, width if width is not None else 0)
    elif event == "live_gate_wait" and used is not None:
        plot.gate_waits.add(time_s, used)


def _finite(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    number = float(value)
    return number if math.isfinite(number) else 0.0


# -- words -----------------------------------------------------------------------------


def format_postmortem(pm: Postmortem) -> list[str]:
    """The postmortem in words, one string per line (``gpupool postmortem`` prints them)."""
    lines = [
        f"gpupool postmortem: {pm.path}",
        f"{pm.records} decision record{'s' if pm.records != 1 else ''} over {pm.duration_s:.2f} s",
    ]
    lines.append(
        "widths over time: "
        + (", ".join(f"{int(w)} at {t:.2f} s" for t, w in pm.widths.points) or "none recorded")
    )
    for device, series in sorted(pm.device_widths.items()):
        if len(pm.device_widths) > 1:
            lines.append(
                f"  card {device}: " + ", ".join(f"{int(w)} at {t:.2f} s" for t, w in series.points)
            )
    if pm.asks:
        lines.append("asks per task key (as the records priced it):")
        for key, series in sorted(pm.asks.items()):
            history = " -> ".join(
                f"{format_size(int(a))} ({_BASES[int(b)]})" for _t, a, b in series.points
            )
            lines.append(f"  {key}: {history}")
    refused = pm.events.get("widen_refused", 0)
    waits = pm.events.get("live_gate_wait", 0)
    serial = pm.events.get("serial_start", 0)
    over = pm.events.get("fixed_width_over_bound", 0)
    lines.append(
        f"refused widens: {refused}; live-gate waits: {waits}; serial starts: {serial}"
        + (f"; fixed width over the bound: {over}" if over else "")
    )
    shutdown = pm.shutdown
    if shutdown is None:
        lines.append("no shutdown record: the pool did not shut down cleanly, or is still running")
    else:
        lost = pm.tasks_lost
        lines.append(
            f"shutdown: {shutdown.get('tasks_completed')} completed, "
            f"{shutdown.get('tasks_failed')} failed, {shutdown.get('tasks_cancelled')} "
            f"cancelled; {shutdown.get('out_of_memory')} out-of-memory, "
            f"{shutdown.get('retries')} retries, {shutdown.get('workers_lost')} workers lost"
        )
        lines.append(
            "tasks lost: none"
            if lost == 0
            else f"TASKS LOST: {lost} (the pool must never lose a task: report this)"
        )
    lines.append(f"out of memory: {pm.out_of_memory}")
    for number, analysis in enumerate(pm.ooms, 1):
        lines.extend(_format_oom(number, analysis))
    if pm.out_of_memory > len(pm.ooms):
        lines.append(f"  ({pm.out_of_memory - len(pm.ooms)} more not shown)")
    if pm.verdicts:
        lines.append("verdicts: " + ", ".join(f"{v} {n}" for v, n in sorted(pm.verdicts.items())))
    return lines


def _format_oom(number: int, a: OomAnalysis) -> list[str]:
    card = "-" if a.device is None else str(a.device)
    fate = "retried at a narrower width" if a.retry else "its error went to its future"
    co_live = (
        f"live >= {format_size(a.co_tenant_live_bytes)} (derived)"
        if a.co_tenant_live_bytes is not None
        else "live: not derivable"
    )
    own_live = (
        f"live {format_size(a.own_live_bytes)}"
        + ("" if a.own_separable and "live_own_bytes" not in a.missing else " (a later record)")
        if a.own_live_bytes is not None
        else "live: not in the record"
    )
    rows = [
        f"out of memory #{number} at {a.time_s:.2f} s (line {a.line}), card {card}, "
        f"task {a.key}; {fate}",
        f"  card total             {format_size(a.total_bytes):>12}",
        f"  co-tenant (census)     {format_size(a.census_co_tenant_bytes):>12}   {co_live}",
        f"  own high-water         {format_size(a.own_high_water_bytes):>12}   {own_live}",
        f"  reserve                {format_size(a.reserve_bytes):>12}",
        f"  booked asks            {format_size(a.booked_bytes):>12}   "
        f"{a.running} running, the failing task's included",
        f"  failing task's ask     {format_size(a.task_ask_bytes):>12}   booked at its start; "
        f"the key was priced {format_size(a.key_ask_bytes)} ({a.ask_basis}) when it failed",
        f"  it had reached         {format_size(a.reached_bytes):>12}   "
        f"and {format_size(a.requested_bytes)} more was refused",
        f"  live used / free       {format_size(a.live_used_bytes):>12}   "
        f"/ {format_size(a.live_free_bytes)} (read after the child reported)",
        f"  wrong term: {a.verdict} - {a.explanation}",
    ]
    return rows
