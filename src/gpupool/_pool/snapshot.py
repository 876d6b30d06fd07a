"""What readers on other threads see of a pool: an immutable snapshot (process layer).

The planner and its ask table belong to the dispatcher thread: they change in
the middle of every turn, and the ask table memoises what it derives, so a
read from another thread can fail (a dict or deque changed size under it) or
cache an ask built from half-updated state. Instead, the dispatcher thread
copies what ``statistics()``, ``width`` and ``track`` need into a
:class:`PoolSnapshot` and publishes it by one reference assignment::

    dispatcher thread                          caller threads
    -----------------                          --------------
    planner, asks, counts (live, its own)
    take_snapshot(...) -> PoolSnapshot   ->    dispatcher.snapshot -> statistics(), width
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from gpupool._core.planner import Planner
    from gpupool._core.policy import Ask, AskTable

__all__ = ["PoolSnapshot", "take_snapshot"]

V = TypeVar("V")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSnapshot:
    """The pool as the dispatcher thread last published it, in values no one changes.

    Attributes:
        counts: the dispatcher's and the planner's event counts together
            (``completed``, ``failed``, ``cancelled``, ``oom``, ``retries``...).
        width: the planner's width.
        widths: ``(time_s, width)`` at each change of the width.
        asks: each task key's ask.
        widths_by_key: the planner's ``widths_by_key()``.
        log_write_errors: decision records the log file could not take.
        bookings_unavailable: why the host's booking table cannot be used, or ``None``.
    """

    counts: Mapping[str, int]
    width: int
    widths: tuple[tuple[float, int], ...]
    asks: Mapping[str, Ask]
    widths_by_key: Mapping[str, int]
    log_write_errors: int
    bookings_unavailable: str | None = None


def take_snapshot(
    planner: Planner,
    asks: AskTable,
    counts: Mapping[str, int],
    *,
    log_write_errors: int,
    last: PoolSnapshot | None,
    bookings_unavailable: str | None = None,
) -> PoolSnapshot:
    """What ``planner``, ``asks`` and ``counts`` hold now; only their owning thread may call it.

    Each value equal to ``last``'s is ``last``'s own object, and ``last`` itself
    comes back when nothing changed.
    """
    totals = collections.Counter(counts)
    totals.update(planner.counts)
    now_counts: Mapping[str, int] = dict(totals)
    # The planner only appends to its width timeline: the same length and last entry are the
    # same timeline, and a long run does not copy it at every turn.
    widths = (
        last.widths
        if last is not None
        and len(last.widths) == len(planner.widths)
        and last.widths[-1:] == tuple(planner.widths[-1:])
        else tuple(planner.widths)
    )
    now_asks: Mapping[str, Ask] = {key: asks.ask(key) for key in asks.keys()}  # noqa: SIM118
    by_key: Mapping[str, int] = planner.widths_by_key()
    if last is not None:
        now_counts = last.counts if last.counts == now_counts else now_counts
        now_asks = last.asks if last.asks == now_asks else now_asks
        by_key = last.widths_by_key if last.widths_by_key == by_key else by_key
        if (
            now_counts is last.counts
            and now_asks is last.asks
            and by_key is last.widths_by_key
            and widths is last.widths
            and planner.width == last.width
            and log_write_errors == last.log_write_errors
            and bookings_unavailable == last.bookings_unavailable
        ):
            return last
    return PoolSnapshot(
        counts=_frozen(now_counts),
        width=planner.width,
        widths=widths,
        asks=_frozen(now_asks),
        widths_by_key=_frozen(by_key),
        log_write_errors=log_write_errors,
        bookings_unavailable=bookings_unavailable,
    )


def _frozen(values: Mapping[str, V]) -> Mapping[str, V]:
    """A read-only view of a fresh dict (a view already made stays as it is)."""
    return values if isinstance(values, MappingProxyType) else MappingProxyType(dict(values))
