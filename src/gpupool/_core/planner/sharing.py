"""Sharing a card with the host's other pools: their bookings, the share, the room owed.

Pools on one host publish their bookings in a shared table (read by the process layer,
:mod:`gpupool._sensors.bookings`). Here those rows become terms of a card (:func:`others_terms`),
and while another pool waits for room on a card a start must keep two rules (:func:`share_wait`):

* its share: this pool takes no more than an equal share of the room the pools have between them
  (``(room + other pools' bookings) / pools running or waiting there``), rounded to the nearest task
  (a start is admitted while the middle of its booking is within the share, so two pools that each
  stop just short of it do not leave a task's room idle);
* the room it owes: a waiting pool that holds less than this pool and less than its share is owed
  the room for its next task (its ``need_bytes``), so this start must leave that much free; a task
  larger than a share waits for the others to shrink, not forever.

One task of its own always may run; with no other pool waiting, the bound alone decides. Two
exceptions, each for a bounded time: a pool at the serial floor (it runs nothing on the card and
waits for room its next task needs) is yielded to, even by this pool's one task (:func:`yields_to`,
at most :data:`YIELD_S`); and the room one of this pool's tasks frees goes first to a waiting pool
that holds less (:func:`gives_way`, for as long as the task ran and at most :data:`TURN_S`). Else
the pool whose task ended, hearing of its own end first, takes the room again each time, and of
pools that each hold a task, the one holding a second keeps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpupool._core.bookings import OtherPools
from gpupool._core.events import JsonValue
from gpupool._core.planner.state import Card, Run
from gpupool._core.units import format_size

__all__ = [
    "TURN_S",
    "YIELD_S",
    "GiveWay",
    "OthersTerms",
    "ShareWait",
    "Yield",
    "gives_way",
    "note_freed",
    "note_others",
    "owed_bytes",
    "owes_room",
    "share_record",
    "share_tasks",
    "share_wait",
    "turn_record",
    "turn_wait",
    "yields_to",
]

#: The longest a pool holds its starts on a card for another pool at the serial floor
#: there, from when it first saw that pool so (afterwards that pool waits as before: at
#: most ``room_wait_s``, then one task past the bound); also the longest it yields there
#: in a row to any pools, after which it yields there no more for as long.
YIELD_S = 30.0

#: The longest a pool leaves the room one of its tasks freed on a card to a waiting pool that holds
#: less there (:func:`gives_way`); the other pools read the table every 0.2 s while they run tasks.
TURN_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class OthersTerms:
    """The other pools' tasks on one card, each priced at the larger of its booking and
    what its worker holds."""

    priced_bytes: int
    unreached_bytes: int
    held_bytes: int
    overrun_bytes: int
    tasks: int


def note_others(
    card: Card, others: OtherPools | None, rows: Mapping[int, int], now_s: float, *, census: bool
) -> OthersTerms:
    """``card``'s other pools are ``others`` now: their terms, priced from ``rows``
    (:func:`others_terms`), and who waits and who took a turn (:func:`note_starved`,
    :func:`note_turn_taken`). ``census``: what they hold stands in the census' co-tenant bytes."""
    terms = others_terms(others, rows)
    card.pools.others = others
    card.pools.others_bytes = terms.priced_bytes
    card.pools.others_unreached_bytes = terms.unreached_bytes
    card.pools.others_tasks = terms.tasks
    card.pools.others_held_bytes = terms.held_bytes
    card.pools.others_overrun_bytes = terms.overrun_bytes
    card.pools.others_since_s = None if terms.tasks == 0 else card.pools.others_since_s or now_s
    note_starved(card, now_s)
    note_turn_taken(card)
    if census:
        card.pools.others_at_census_bytes = terms.held_bytes
    return terms


def others_terms(others: OtherPools | None, rows: Mapping[int, int]) -> OthersTerms:
    """Price the other pools' rows on a card, reading each task's holding from ``rows``
    (per-process device bytes; a task without a row holds what it reported reaching)."""
    held = unreached = tasks = overrun = 0
    if others is not None:
        for pool in others.pools:
            for task in pool.tasks:
                holding = rows.get(task.worker_pid, task.reached_bytes)
                held += holding
                unreached += max(0, task.booked_bytes - holding)
                overrun += max(0, holding - task.booked_bytes)
                tasks += 1
    return OthersTerms(
        priced_bytes=held + unreached,
        unreached_bytes=unreached,
        held_bytes=held,
        overrun_bytes=overrun,
        tasks=tasks,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareWait:
    """Why a start waits for the other pools on its card, with the terms."""

    share_bytes: int
    pool_booked_bytes: int
    next_bytes: int
    owed_bytes: int
    left_bytes: int
    within_share: bool


def share_bytes(card: Card, room_bytes: int) -> int:
    """An equal share of the room the pools on ``card`` have between them."""
    return (room_bytes + card.pools.others_bytes) // (1 + card.pools.others_active)


def share_tasks(card: Card, room_bytes: int | None, ask_bytes: int) -> int:
    """How many tasks of ``ask_bytes`` this pool's share of ``card`` admits (a start is
    admitted while the middle of its booking is within the share), where other pools
    wait there; 0 where none waits or the room is unknown."""
    if not card.pools.others_waiting or room_bytes is None or ask_bytes <= 0:
        return 0
    return max(0, (share_bytes(card, room_bytes) - ask_bytes // 2) // ask_bytes + 1)


def owed_bytes(card: Card, room_bytes: int, mine_bytes: int, share: int) -> int:
    """The most room a waiting pool on ``card`` is owed for its next task: one that holds
    less than this pool (``mine_bytes``) and less than its share, whose task could fit the
    room the pools have between them."""
    if card.pools.others is None:
        return 0
    pools_room = room_bytes + card.pools.others_bytes + mine_bytes
    return max(
        (
            pool.need_bytes
            for pool in card.pools.others.pools
            if pool.waiting
            and pool.booked_bytes < mine_bytes
            and pool.booked_bytes < share
            and pool.need_bytes <= pools_room
        ),
        default=0,
    )


def share_wait(card: Card, next_bytes: int, room_bytes: int | None) -> ShareWait | None:
    """``None`` where a start of ``next_bytes`` on ``card`` keeps both rules (or no other
    pool waits there); otherwise why it waits."""
    if (
        not card.pools.others_waiting
        or not card.runs
        or room_bytes is None
        or card.pools.others is None
    ):
        return None
    share = share_bytes(card, room_bytes)
    mine = card.sums.booked_bytes
    owed = owed_bytes(card, room_bytes, mine, share)
    left = room_bytes - mine - next_bytes
    within = mine + next_bytes // 2 <= share
    if within and left >= owed:
        return None
    return ShareWait(
        share_bytes=share,
        pool_booked_bytes=mine,
        next_bytes=next_bytes,
        owed_bytes=owed,
        left_bytes=left,
        within_share=within,
    )


def share_record(card: Card, wait: ShareWait) -> tuple[str, dict[str, JsonValue]]:
    """A start held to this pool's share, or to the room it owes, as a ``share_wait`` record:
    the sentence and the terms."""
    room = wait.share_bytes * (1 + card.pools.others_active) - card.pools.others_bytes
    why = (
        f"one more ({format_size(wait.next_bytes)}) would pass its share "
        f"{format_size(wait.share_bytes)} (({format_size(room)} room + "
        f"{format_size(card.pools.others_bytes)} other pools') / "
        f"{1 + card.pools.others_active} pools)"
        if not wait.within_share
        else f"one more ({format_size(wait.next_bytes)}) would leave "
        f"{format_size(wait.left_bytes)}, less than the {format_size(wait.owed_bytes)} a "
        f"waiting pool below its share ({format_size(wait.share_bytes)}) needs for its next task"
    )
    reason = (
        f"card {card.index}: {card.pools.others_waiting} other pool(s) wait for room here, and "
        f"this pool's {len(card.runs)} running task(s) book {format_size(wait.pool_booked_bytes)}; "
        f"{why}, so it waits"
    )
    return reason, _wait_terms(card, wait.share_bytes, wait.next_bytes, wait.owed_bytes)


def owes_room(card: Card, room_bytes: int | None) -> bool:
    """A waiting pool is owed room on ``card`` that is not free now."""
    if not card.pools.others_waiting or room_bytes is None:
        return False
    mine = card.sums.booked_bytes
    owed = owed_bytes(card, room_bytes, mine, share_bytes(card, room_bytes))
    return owed > 0 and room_bytes - mine < owed


@dataclass(frozen=True, slots=True, kw_only=True)
class Yield:
    """Why a start waits for another pool at the serial floor, with the terms."""

    pool_id: str
    need_bytes: int
    left_bytes: int
    pools_room_bytes: int
    waited_s: float


def note_starved(card: Card, now_s: float) -> None:
    """Keep, for each other pool on ``card`` that runs nothing there and waits for room, when
    this pool first saw it so; and since when this pool runs nothing there. A yield ends
    when one of those pools runs a task there (it had its turn: the next may be yielded
    to at once), or with none of them left to yield to (then :func:`_end_yield`)."""
    seen: dict[str, float] = {}
    turn = False
    if card.pools.others is not None:
        for pool in card.pools.others.pools:
            if pool.waiting and pool.need_bytes and not pool.tasks:
                seen[pool.pool_id] = card.turns.starved_since_s.get(pool.pool_id, now_s)
            elif pool.tasks and pool.pool_id in card.turns.starved_since_s:
                turn = True
    card.turns.starved_since_s = seen
    if turn:
        card.turns.yield_began_s = None
    elif card.turns.yield_began_s is not None and not any(
        now_s - t < YIELD_S for t in seen.values()
    ):
        _end_yield(card, now_s)
    _note_idle(card, now_s)


def _end_yield(card: Card, now_s: float) -> None:
    """This pool's yield on ``card`` ended with no pool it yielded to having run there (they
    left, or it yielded :data:`YIELD_S` in a row): it yields there no more for as long as
    the yield lasted."""
    if card.turns.yield_began_s is not None:
        card.turns.no_yield_until_s = now_s + (now_s - card.turns.yield_began_s)
        card.turns.yield_began_s = None


def _note_idle(card: Card, now_s: float) -> None:
    if card.runs:
        card.turns.idle_since_s = None
    elif card.turns.idle_since_s is None:
        card.turns.idle_since_s = now_s


def yields_to(card: Card, next_bytes: int, room_bytes: int | None, now_s: float) -> Yield | None:
    """The pool at the serial floor a start of ``next_bytes`` on ``card`` yields to (the one waiting
    longest), or ``None``. A pool is yielded to while, for less than :data:`YIELD_S` since this pool
    first saw it run nothing on the card and wait: the room its next task needs is more than this
    start leaves, that task would fit once the pools there drained, and (where this pool runs
    nothing there either) it came to wait before this pool last ran nothing there: of two such
    pools, only the younger yields. This pool yields on a card at most :data:`YIELD_S` in a row,
    whichever pools it yields to, and after a yield in which none of them ran there, not again there
    for as long as it lasted: rows that claim to wait under new pool ids, and never run, hold it at
    most half the time."""
    if room_bytes is None or not card.turns.starved_since_s or card.pools.others is None:
        return None
    _note_idle(card, now_s)
    if card.turns.yield_began_s is not None and now_s - card.turns.yield_began_s >= YIELD_S:
        _end_yield(card, now_s)
    if now_s < card.turns.no_yield_until_s:
        return None
    mine = card.sums.booked_bytes
    left = room_bytes - mine - next_bytes
    pools_room = room_bytes + card.pools.others_bytes + mine
    found: tuple[float, Yield] | None = None
    for pool in card.pools.others.pools:
        since = card.turns.starved_since_s.get(pool.pool_id)
        if (
            since is None
            or now_s - since >= YIELD_S
            or pool.tasks
            or not pool.waiting
            or not left < pool.need_bytes <= pools_room
            or (card.turns.idle_since_s is not None and since >= card.turns.idle_since_s)
        ):
            continue
        if found is None or since < found[0]:
            found = (
                since,
                Yield(
                    pool_id=pool.pool_id,
                    need_bytes=pool.need_bytes,
                    left_bytes=left,
                    pools_room_bytes=pools_room,
                    waited_s=now_s - since,
                ),
            )
    if found is None:
        return None
    if card.turns.yield_began_s is None:
        card.turns.yield_began_s = now_s
    return found[1]


def _wait_terms(card: Card, share: int, next_bytes: int, owed_bytes: int) -> dict[str, JsonValue]:
    """The terms every ``share_wait`` record states: this pool's share and bookings on ``card``, its
    next task's bytes, what another pool is owed or needs, and the pools there."""
    return {
        "share_bytes": share,
        "pool_booked_bytes": card.sums.booked_bytes,
        "next_bytes": next_bytes,
        "owed_bytes": owed_bytes,
        "other_pools_waiting": card.pools.others_waiting,
        "other_pools_active": card.pools.others_active,
    }


def yield_record(card: Card, wait: Yield, room_bytes: int) -> tuple[str, dict[str, JsonValue]]:
    """A yield to a pool at the serial floor, as a ``share_wait`` record: the sentence and
    the terms."""
    reason = (
        f"card {card.index}: pool {wait.pool_id} runs nothing here and waits for "
        f"{format_size(wait.need_bytes)} for its next task, which fits once the pools here "
        f"drain ({format_size(wait.pools_room_bytes)} between them); this start would leave "
        f"{format_size(wait.left_bytes)}, so this pool yields (it has for {wait.waited_s:.1f} "
        f"s, at most {YIELD_S:g} s)"
    )
    next_bytes = room_bytes - card.sums.booked_bytes - wait.left_bytes
    return reason, _wait_terms(card, share_bytes(card, room_bytes), next_bytes, wait.need_bytes) | {
        "yield_to_pool": wait.pool_id,
        "yield_waited_s": round(wait.waited_s, 3),
        "yield_limit_s": YIELD_S,
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class GiveWay:
    """Why a start leaves the room this pool's task freed to another waiting pool."""

    pool_id: str
    other_booked_bytes: int
    need_bytes: int
    left_bytes: int
    turn_left_s: float


def note_freed(card: Card, run: Run, now_s: float) -> None:
    """``run``, one of this pool's tasks on ``card``, ended at ``now_s`` (and is off the card's
    runs): the room it freed goes first, for as long as it ran and at most :data:`TURN_S`, to a
    waiting pool that holds less than this pool did before it ended (:func:`gives_way`). A turn
    still open is neither lengthened nor lowered, so each task that ends leaves its room idle at
    most as long as it ran. A turn that held a start and that no other pool took (none that waited
    when it opened books half its need more there since) is followed by as long without one: rows
    that say they wait and never start hold the room at most half the time, whatever the lengths of
    this pool's tasks."""
    if now_s < card.turns.give_way_until_s or now_s < card.turns.give_way_rest_until_s:
        return
    turn_s = min(max(0.0, now_s - run.started_s), TURN_S)
    card.turns.give_way_until_s = now_s + turn_s
    card.turns.give_way_turn_s = turn_s
    card.turns.give_way_below_bytes = card.sums.booked_bytes + run.booked_bytes
    pools = card.pools.others.pools if card.pools.others is not None else ()
    card.turns.give_way_booked = {
        pool.pool_id: (pool.booked_bytes, pool.need_bytes) for pool in pools if pool.waiting
    }


def note_turn_taken(card: Card) -> None:
    """The other pools' rows on ``card`` were read again: where a pool that waited there
    when this pool's last turn opened books at least half the room it waited for more now,
    it took the turn, and the next may open at once (a pool that came since cannot have
    taken it; a row that books a byte more has not)."""
    if card.pools.others is not None and any(
        _took(pool.booked_bytes, card.turns.give_way_booked.get(pool.pool_id))
        for pool in card.pools.others.pools
    ):
        card.turns.give_way_rest_until_s = float("-inf")


def _took(booked_bytes: int, opened: tuple[int, int] | None) -> bool:
    if opened is None:
        return False
    was_bytes, need_bytes = opened
    return need_bytes > 0 and booked_bytes - was_bytes >= (need_bytes + 1) // 2


def gives_way(card: Card, next_bytes: int, room_bytes: int | None, now_s: float) -> GiveWay | None:
    """The waiting pool a start of ``next_bytes`` on ``card`` leaves this pool's freed room to (the
    one holding least), or ``None``. Within the turn :func:`note_freed` opened, a start gives way to
    another pool that says it waits, holds less on the card than this pool did before its task
    ended, no more than it does now, and less than its share, and whose next task fits the room free
    now but not what this start would leave: the pool whose task ended passes on the room that put
    it above that pool, and a pool that ran no more than the others takes its room back at once. One
    task of its own always may run: with none running there, no start gives way."""
    if (
        now_s >= card.turns.give_way_until_s
        or not card.runs
        or room_bytes is None
        or card.pools.others is None
        or not card.pools.others_waiting
    ):
        return None
    mine = card.sums.booked_bytes
    free = room_bytes - mine
    left = free - next_bytes
    below = min(mine + 1, card.turns.give_way_below_bytes, share_bytes(card, room_bytes))
    found: GiveWay | None = None
    for pool in card.pools.others.pools:
        held = pool.booked_bytes
        if not pool.waiting or held >= below or not left < pool.need_bytes <= free:
            continue
        if found is None or held < found.other_booked_bytes:
            found = GiveWay(
                pool_id=pool.pool_id,
                other_booked_bytes=held,
                need_bytes=pool.need_bytes,
                left_bytes=left,
                turn_left_s=card.turns.give_way_until_s - now_s,
            )
    if found is not None:
        # This turn holds a start: unless a pool takes it, none opens for as long after it.
        card.turns.give_way_rest_until_s = card.turns.give_way_until_s + card.turns.give_way_turn_s
    return found


def give_way_record(card: Card, way: GiveWay, room_bytes: int) -> tuple[str, dict[str, JsonValue]]:
    """A start that leaves this pool's freed room to another waiting pool, as a
    ``share_wait`` record: the sentence and the terms."""
    reason = (
        f"card {card.index}: a task of this pool ended here, and pool {way.pool_id} waits "
        f"holding {format_size(way.other_booked_bytes)} (this pool: "
        f"{format_size(card.sums.booked_bytes)}) for {format_size(way.need_bytes)} for its next "
        f"task; this start would leave {format_size(way.left_bytes)}, so this pool leaves "
        f"it the room (for {way.turn_left_s:.1f} s more, at most {TURN_S:g} s and as long "
        f"as the task ran)"
    )
    next_bytes = room_bytes - card.sums.booked_bytes - way.left_bytes
    return reason, _wait_terms(card, share_bytes(card, room_bytes), next_bytes, way.need_bytes) | {
        "give_way_to_pool": way.pool_id,
        "give_way_pool_booked_bytes": way.other_booked_bytes,
        "give_way_left_s": round(way.turn_left_s, 3),
        "give_way_limit_s": TURN_S,
    }


def turn_wait(
    card: Card, next_bytes: int, room_bytes: int | None, now_s: float
) -> Yield | GiveWay | None:
    """Whose turn a start of ``next_bytes`` on ``card`` waits for: a pool at the serial floor
    (:func:`yields_to`), else a waiting pool this pool's freed room goes to
    (:func:`gives_way`), else ``None``."""
    found = yields_to(card, next_bytes, room_bytes, now_s)
    return found if found is not None else gives_way(card, next_bytes, room_bytes, now_s)


def turn_record(
    card: Card, wait: Yield | GiveWay, room_bytes: int
) -> tuple[str, dict[str, JsonValue]]:
    """A start that waits for another pool's turn, as a ``share_wait`` record."""
    if isinstance(wait, Yield):
        return yield_record(card, wait, room_bytes)
    return give_way_record(card, wait, room_bytes)
