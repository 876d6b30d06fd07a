"""An out-of-memory, judged against the task's own booking: a verdict and the record's terms.

A task that ran its card out of memory either passed its own price (an
underestimate: its key's ask rises, and no card is capped for it), or stayed
within it while it shared the card (something else grew: the card runs fewer
at once until the live reading shows the room back), or ran alone (it waits
for room others hold, moves to a roomier card, or fails). "Its own price" is
the ask it was started at, never a price an earlier out-of-memory of the same
wave raised since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpupool._core.planner.samples import ReadingSplit
from gpupool._core.planner.state import Card, Run
from gpupool._core.planner.verdicts import PlannerConfig
from gpupool._core.policy import Ask
from gpupool._core.units import MiB, format_size

__all__ = ["CAP_LIFT_MARGIN_BYTES", "CapLift", "Facts", "Judgement", "cap_lift_terms", "judge"]

#: A cap an out-of-memory set lifts once the bytes on the card that are not the
#: pool's are back within this much of what the bound prices them at.
CAP_LIFT_MARGIN_BYTES = 256 * MiB

Kind = Literal[
    "larger_than_card",
    "retries_off",
    "retries_exhausted",
    "fixed_width",
    "underestimate",
    "something_grew",
    "pooled",
    "held",
    "elsewhere",
    "alone",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    """What an out-of-memory means (the rule it fell under), and what the planner does about
    it: run the task again (else its future fails), at most ``cap`` at once on its card from
    now on (``None``: no cap); ``why`` is the sentence for the record and the error."""

    kind: Kind
    retry: bool
    why: str
    cap: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What was known when the task ran out."""

    run: Run
    tries: int
    running_then: int
    shared: bool
    reached_bytes: int | None
    requested_bytes: int | None
    key_ask_before: Ask
    key_ask_after: Ask
    held: bool
    elsewhere: int | None
    # What the card's runs were booked at when it ran out (before any re-pricing), and the
    # least own high-water they were priced at.
    booked_bytes: int
    priced_own_high_water_bytes: int | None
    # The largest total of the pool's cards: a task that needs more never runs.
    largest_total_bytes: int | None = None


def judge(facts: Facts, config: PlannerConfig, card: Card | None) -> Judgement:
    """The rule an out-of-memory falls under (the caller applies the cap and the retry)."""
    run = facts.run
    lower = (facts.reached_bytes or 0) + (facts.requested_bytes or 0)
    largest = facts.largest_total_bytes
    if largest is not None and lower > largest:
        return Judgement(
            kind="larger_than_card",
            retry=False,
            why=f"it needs at least {format_size(lower)} ({format_size(facts.reached_bytes)} "
            f"held + {format_size(facts.requested_bytes)} refused), more than the "
            f"{format_size(largest)} total of the largest card; it was priced at "
            f"{format_size(run.ask_bytes)}, but no price or width runs it on these cards, so "
            "it is not retried",
        )
    if not config.retry_oom:
        return Judgement(kind="retries_off", retry=False, why="retries are off")
    if facts.tries > config.max_retries:
        return Judgement(
            kind="retries_exhausted",
            retry=False,
            why=f"it ran out of memory {facts.tries} times, more than max_retries="
            f"{config.max_retries}",
        )
    if facts.shared:
        cap = max(1, facts.running_then - 1)
        if config.fixed_width is not None:
            return Judgement(
                kind="fixed_width",
                retry=True,
                why=f"retrying once its card runs at most {cap - 1} other task(s) (the fixed "
                f"width {config.fixed_width} stays)",
                cap=cap,
            )
        if lower > run.ask_bytes:
            return Judgement(
                kind="underestimate",
                retry=True,
                why=f"the ask was underestimated: started at {format_size(run.ask_bytes)} "
                f"(booked {format_size(run.booked_at_start_bytes)}), it reached "
                f"{format_size(facts.reached_bytes)} and asked for "
                f"{format_size(facts.requested_bytes)} more; {run.key} is priced "
                f"{facts.key_ask_after.describe()} from now on (no card is capped for it)",
            )
        assert card is not None
        cap = cap if card.oom_cap is None else min(card.oom_cap, cap)
        if run.booked_at_start_bytes < run.ask_bytes:
            return Judgement(
                kind="pooled",
                retry=True,
                why=f"it stayed within its ask ({format_size(run.ask_bytes)}), but {run.key}'s "
                "tasks were priced together (their peaks counted on not coinciding): either "
                f"they, or something else on the card, grew past that; {run.key} is priced "
                f"{format_size(facts.key_ask_after.ask_bytes)} per task from now on, and at "
                f"most {cap} run at once there until the room is back",
                cap=cap,
            )
        return Judgement(
            kind="something_grew",
            retry=True,
            why=f"it stayed within its ask ({format_size(run.ask_bytes)}), so something else "
            f"on the card grew; at most {cap} at once there until the live reading shows the "
            "room back",
            cap=cap,
        )
    return _alone(facts, config)


def _alone(facts: Facts, config: PlannerConfig) -> Judgement:
    where = f"card {facts.run.device if facts.run.device is not None else '-'}"
    if facts.held:
        return Judgement(
            kind="held",
            retry=True,
            why=f"it ran out alone while the card's live free bytes did not cover its ask "
            f"{format_size(facts.key_ask_after.ask_bytes)} + "
            f"{format_size(config.reserve_bytes)} reserve: others' bytes hold the card, so it "
            "waits for room and retries",
        )
    if facts.elsewhere is not None:
        return Judgement(
            kind="elsewhere",
            retry=True,
            why=f"it ran out alone on {where}; card {facts.elsewhere} has room for its ask "
            f"{facts.key_ask_after.describe()}, so it is retried there",
        )
    return Judgement(
        kind="alone",
        retry=False,
        why="it ran out alone on the card with its ask's room free",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CapLift:
    """Whether a card's out-of-memory cap may lift, with the terms."""

    lifts: bool
    not_pool_bytes: int
    priced_not_pool_bytes: int
    pool_bytes: int


def cap_lift_terms(card: Card, split: ReadingSplit) -> CapLift | None:
    """Whether the bytes on ``card`` that are not the pool's (its workers', the processes
    their tasks started) are back within :data:`CAP_LIFT_MARGIN_BYTES` of what the bound
    prices them at (co-tenants at the census, other pools, the own high-water). ``None``
    where the card's total or co-tenant bytes are unknown. The pool's bytes are its rows
    where the reading lists them, else its runs' bookings."""
    total = card.census.total_bytes
    co_tenant = card.census.co_tenant_bytes
    if total is None or co_tenant is None:
        return None
    pool = split.pool_bytes if split.pool_bytes is not None else card.booked_bytes
    priced = (
        max(0, co_tenant - card.others_at_census_bytes)
        + card.others_bytes
        + card.own_high_water_bytes
    )
    not_pool = max(0, split.used_bytes - pool)
    return CapLift(
        lifts=not_pool <= priced + CAP_LIFT_MARGIN_BYTES,
        not_pool_bytes=not_pool,
        priced_not_pool_bytes=priced,
        pool_bytes=pool,
    )
