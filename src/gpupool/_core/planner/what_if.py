"""A what-if census, asked of the planner: the widths a pool would decide before any task runs.

``gpupool plan`` prices nothing itself: it builds the census it was given (or
read), and asks a planner built on it, with the configuration a pool would
have, what it decides at an ask. So the plan and the pool cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool._core.bound import Ceiling, WidthDecision
from gpupool._core.census import Census
from gpupool._core.planner.planner import Planner
from gpupool._core.planner.verdicts import PlannerConfig
from gpupool._core.policy import Ask, AskTable

__all__ = ["WhatIf", "what_if"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIf:
    """The planner's answer for one ask: every card's decision and the ceiling."""

    decisions: tuple[WidthDecision, ...]
    ceiling: Ceiling

    @property
    def width(self) -> int:
        """The pool's width: its cards' widths together, or the ceiling without a card."""
        return sum(d.width for d in self.decisions) if self.decisions else self.ceiling.value


def what_if(census: Census, asks: AskTable, config: PlannerConfig, ask: Ask | None) -> WhatIf:
    """What a pool on ``census`` with ``config`` decides for tasks priced at ``ask`` (``None``:
    no price given, only the ceiling), before any of its tasks runs (the planner's records of
    it are not kept)."""
    planner = Planner(census=census, asks=asks, config=config, emit=lambda _record: None)
    decisions = planner.views.decide(ask) if ask is not None and census.cards else ()
    return WhatIf(decisions=decisions, ceiling=planner.state.ceiling)
