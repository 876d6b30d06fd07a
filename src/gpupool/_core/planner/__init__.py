"""The planner: every price, admission and width decision of one pool, as rooms and rules.

:class:`Planner` is the process layer's whole surface; :mod:`~gpupool._core.planner.planner`
maps its rooms, the rules they apply and the events between them. :func:`what_if` asks a
planner for a what-if census (``gpupool plan``).
"""

from gpupool._core.planner.base import QUEUE_DEPTH
from gpupool._core.planner.out_of_memory import CAP_LIFT_AFTER_S
from gpupool._core.planner.planner import Planner, WhatIf, what_if
from gpupool._core.planner.samples import SAMPLE_INTERVAL_S, SAMPLE_MIN_GAP_S
from gpupool._core.planner.verdicts import (
    DEFAULT_CHILD_RSS_PRIOR_BYTES,
    DEFAULT_MAX_RETRIES,
    DEFAULT_ROOM_WAIT_S,
    GATE_RECORD_INTERVAL_S,
    LIVE_POLL_S,
    LOOKAHEAD,
    RETIRE_AFTER_SHUT_S,
    CardReading,
    Fail,
    PlannerConfig,
    Refuse,
    Retry,
    Start,
    Wait,
    Warm,
    Workers,
)

__all__ = [
    "CAP_LIFT_AFTER_S",
    "DEFAULT_CHILD_RSS_PRIOR_BYTES",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_ROOM_WAIT_S",
    "GATE_RECORD_INTERVAL_S",
    "LIVE_POLL_S",
    "LOOKAHEAD",
    "QUEUE_DEPTH",
    "RETIRE_AFTER_SHUT_S",
    "SAMPLE_INTERVAL_S",
    "SAMPLE_MIN_GAP_S",
    "CardReading",
    "Fail",
    "Planner",
    "PlannerConfig",
    "Refuse",
    "Retry",
    "Start",
    "Wait",
    "Warm",
    "WhatIf",
    "Workers",
    "what_if",
]
