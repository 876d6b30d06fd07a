"""What readers on other threads see of a pool: an immutable snapshot (process layer).

The planner and its ask table belong to the dispatcher thread: they change in
the middle of every turn, and the ask table memoises what it derives, so a
read from another thread can fail (a dict or deque changed size under it) or
cache an ask built from half-updated state. Instead, the dispatcher thread
copies what ``statistics()``, ``width`` and ``track`` need into a
:class:`PoolSnapshot` and publishes it by one reference assignment.
"""

from __future__ import annotations

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
    """The pool as the dispatcher thread last published it, in values no one changes:
    ``counts`` are the outcomes' and the planner's together, the rest as
    :class:`~gpupool.PoolStatistics` states them."""

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
    now_counts = dict(counts)
    for name, count in planner.counts.items():
        now_counts[name] = now_counts.get(name, 0) + count
    # The planner only appends to its width timeline: the same length and last entry are the
    # same timeline, and a long run does not copy it at every turn.
    timeline = planner.widths
    widths = (
        last.widths
        if last is not None
        and len(last.widths) == len(timeline)
        and (not timeline or last.widths[-1] == timeline[-1])
        else tuple(timeline)
    )
    now_asks = {key: asks.ask(key) for key in asks.keys()}  # noqa: SIM118
    # Copied: the planner may keep the dict it hands out.
    by_key = dict(planner.widths_by_key())
    # Each value equal to the last snapshot's is that snapshot's object; a new one is a
    # read-only view of a dict built here, which nothing else holds.
    counts_view = _kept(last.counts if last else None, now_counts)
    asks_view = _kept(last.asks if last else None, now_asks)
    by_key_view = _kept(last.widths_by_key if last else None, by_key)
    if (
        last is not None
        and counts_view is last.counts
        and asks_view is last.asks
        and by_key_view is last.widths_by_key
        and widths is last.widths
        and planner.width == last.width
        and log_write_errors == last.log_write_errors
        and bookings_unavailable == last.bookings_unavailable
    ):
        return last
    return PoolSnapshot(
        counts=counts_view,
        width=planner.width,
        widths=widths,
        asks=asks_view,
        widths_by_key=by_key_view,
        log_write_errors=log_write_errors,
        bookings_unavailable=bookings_unavailable,
    )


def _kept(last: Mapping[str, V] | None, now: dict[str, V]) -> Mapping[str, V]:
    """``last`` where it equals ``now``, else a read-only view of ``now``."""
    return last if last is not None and last == now else MappingProxyType(now)
