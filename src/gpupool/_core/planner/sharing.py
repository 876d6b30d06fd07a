"""Sharing a card with the host's other pools: their bookings, the share, the room owed.

Pools on one host publish their bookings in a shared table (read by the
process layer, :mod:`gpupool._sensors.bookings`). Here those rows become terms
of a card (:func:`others_terms`), and while another pool waits for room on a
card a start must keep two rules (:func:`share_wait`):

* its share: this pool takes no more than an equal share of the room the pools
  have between them (``(room + other pools' bookings) / pools running or
  waiting there``), rounded to the nearest task (a start is admitted while the
  middle of its booking is within the share, so two pools that each stop just
  short of it do not leave a task's room idle);
* the room it owes: a waiting pool that holds less than this pool and less than
  its share is owed the room for its next task (its ``need_bytes``), so this
  start must leave that much free; a task larger than a share waits for the
  others to shrink, not forever.

One task of its own always may run; with no other pool waiting, the bound alone
decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpupool._core.bookings import OtherPools
from gpupool._core.planner.state import Card

__all__ = ["OthersTerms", "ShareWait", "others_terms", "owed_bytes", "owes_room", "share_wait"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OthersTerms:
    """The other pools' tasks on one card, each priced at the larger of its booking and
    what its worker holds."""

    priced_bytes: int
    unreached_bytes: int
    held_bytes: int
    overrun_bytes: int
    tasks: int


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
    return (room_bytes + card.others_bytes) // (1 + card.others_active)


def owed_bytes(card: Card, room_bytes: int, mine_bytes: int, share: int) -> int:
    """The most room a waiting pool on ``card`` is owed for its next task: one that holds
    less than this pool (``mine_bytes``) and less than its share, whose task could fit the
    room the pools have between them."""
    if card.others is None:
        return 0
    pools_room = room_bytes + card.others_bytes + mine_bytes
    return max(
        (
            pool.need_bytes
            for pool in card.others.pools
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
    if not card.others_waiting or not card.runs or room_bytes is None or card.others is None:
        return None
    share = share_bytes(card, room_bytes)
    mine = card.booked_bytes
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


def owes_room(card: Card, room_bytes: int | None) -> bool:
    """A waiting pool is owed room on ``card`` that is not free now."""
    if not card.others_waiting or room_bytes is None:
        return False
    mine = card.booked_bytes
    owed = owed_bytes(card, room_bytes, mine, share_bytes(card, room_bytes))
    return owed > 0 and room_bytes - mine < owed
