"""The planner: every price, admission and width decision of one pool, as rooms and rules.

One :class:`Planner` (:mod:`~gpupool._core.planner.planner`) is the process layer's
whole surface; it composes rooms that each own their fields:

* :mod:`~gpupool._core.planner.base`: the state (cards with their runs, tasks, the
  pending queue, the ceiling, the counts);
* :mod:`~gpupool._core.planner.views`: every width, a view of the one fit, and strict
  mode's refusal;
* :mod:`~gpupool._core.planner.order`: the start order and the room held for a waiting task;
* :mod:`~gpupool._core.planner.starts`: the next start;
* :mod:`~gpupool._core.planner.queued`: tasks queued behind a run on its worker;
* :mod:`~gpupool._core.planner.learning`: what ended tasks' peaks teach the asks;
* :mod:`~gpupool._core.planner.durations`: each key's task durations;
* :mod:`~gpupool._core.planner.out_of_memory`: an out-of-memory carried out, and the caps;
* :mod:`~gpupool._core.planner.samples`: the records, the ``card_read`` samples and
  whose bytes a reading shows.

The rules on numbers are functions: :mod:`~gpupool._core.planner.fit` (the one fit, the
live gate), :mod:`~gpupool._core.planner.sharing` (the host's other pools on a card),
:mod:`~gpupool._core.planner.oom` (an out-of-memory judged against the task's own
booking), :mod:`~gpupool._core.planner.records` (what each record says) and
:mod:`~gpupool._core.planner.evidence`; :mod:`~gpupool._core.planner.state` and
:mod:`~gpupool._core.planner.verdicts` hold the records and the verdicts, and
:mod:`~gpupool._core.planner.what_if` asks a planner for a what-if census (``gpupool plan``).
"""

from gpupool._core.planner.durations import QUEUE_DEPTH
from gpupool._core.planner.planner import CAP_LIFT_AFTER_S, Planner
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
from gpupool._core.planner.what_if import WhatIf, what_if

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
