"""What readers on other threads see of a pool: an immutable snapshot (process layer).

The planner and its ask table belong to the dispatcher thread: they change in
the middle of every turn, and the ask table memoises what it derives, so a
read from another thread can fail (a dict or deque changed size under it) or
cache an ask built from half-updated state. Instead, the dispatcher thread
copies what ``statistics()``, ``width`` and ``track`` need into a
:class:`PoolSnapshot` and publishes it by one reference assignment.

:class:`Public` is the dispatcher's room for what it shows other threads: the snapshot it
replaces at the end of each turn, and its thread's end, which they wait on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from gpupool._observe.log import LOGGER

if TYPE_CHECKING:
    from gpupool._core.planner import Planner
    from gpupool._core.policy import Ask, AskTable
    from gpupool._observe.log import DecisionLog
    from gpupool._sensors.bookings import BookingTable

__all__ = ["PoolSnapshot", "Public", "ReadOnlyDict", "take_snapshot"]

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


class ReadOnlyDict(dict[str, V]):
    """A snapshot's mapping: a dict whose changing methods raise ``TypeError`` (as a read-only
    view's do), which pickles, copies, goes to JSON and through ``dataclasses.asdict`` as a
    dict does (a ``MappingProxyType`` does none of these)."""

    __slots__ = ()

    def _refused(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a pool's statistics are read-only: copy them with dict() to change them")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refused

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


def _kept(last: Mapping[str, V] | None, now: dict[str, V]) -> Mapping[str, V]:
    """``last`` where it equals ``now``, else a read-only copy of ``now``."""
    return last if last is not None and last == now else ReadOnlyDict(now)


class Public:
    """What the dispatcher thread shows other threads: the snapshot it replaces whole, and its
    own end, which they wait on. The thread writes every field; other threads read only what
    ``PUBLISHED`` names (the snapshot, the thread and its end, through :meth:`join`)."""

    #: What other threads may reach: each is replaced whole, or is a thread-safe object.
    PUBLISHED = frozenset({"snapshot", "thread", "join", "finished"})

    def __init__(
        self,
        planner: Planner,
        asks: AskTable,
        counts: Mapping[str, int],
        log: DecisionLog,
        table: BookingTable | None,
        run: Callable[[], None],
    ) -> None:
        # What a snapshot is taken of: the planner, its ask table, the outcomes' counts, the
        # log's write errors and the booking table's state (None: sharing is off).
        self.planner = planner
        self.asks = asks
        self.counts = counts
        self.log = log
        self.table = table
        self.snapshot: PoolSnapshot = take_snapshot(
            planner, asks, counts, log_write_errors=0, last=None
        )
        self.publish_failed = False
        # Tasks handed to the planner since the last snapshot (one taken before any of their
        # futures is RUNNING, so that width and widths_by_key count them).
        self.unpublished_tasks = False
        self.thread = threading.Thread(target=run, name="gpupool-dispatcher", daemon=True)
        # Set as the thread's last act. Waited on instead of the thread itself: on Python
        # 3.10-3.12 a Thread.join that Ctrl-C interrupts leaves that thread marked stopped
        # while it runs, so is_alive() and join() would lie from then on.
        self.finished = threading.Event()

    def publish(self) -> None:
        """Replace :attr:`snapshot` with what the planner holds now, in one assignment.

        Called only where the planner is not shared: before the thread starts, then by the
        thread at the end of every turn, before a future becomes RUNNING or done (a caller
        never sees a future newer than the statistics it reads), and after the last record.
        A value that did not change is the same object as before.
        """
        self.unpublished_tasks = False
        try:
            self.snapshot = take_snapshot(
                self.planner,
                self.asks,
                self.counts,
                log_write_errors=self.log.write_errors,
                bookings_unavailable=None if self.table is None else self.table.unavailable_reason,
                last=self.snapshot,
            )
        except Exception:
            # A stale snapshot, never a future left pending: this runs as futures are set.
            if not self.publish_failed:
                self.publish_failed = True
                LOGGER.exception("gpupool could not take the statistics snapshot")

    def tasks_added(self) -> None:
        """Tasks were handed to the planner: the next future made RUNNING publishes first."""
        self.unpublished_tasks = True

    def start(self) -> None:
        """Publish what the planner holds before the thread runs (the construction's width and
        records), and start the thread."""
        self.publish()
        self.thread.start()

    def ended(self) -> None:
        """The thread's last act: :meth:`join` returns from now on."""
        self.finished.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to finish (at most ``timeout`` seconds); whether it has."""
        if self.thread.ident is None or threading.current_thread() is self.thread:
            return self.finished.is_set()  # never started, or asked from the thread itself
        if not self.finished.wait(timeout):
            return False
        self.thread.join()  # its last lines: then nothing of the pool is held by its frames
        return True
