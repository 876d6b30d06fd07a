"""The planner: every price, admission and width decision of one pool, as a package of rules.

* :mod:`~gpupool._core.planner.verdicts`: what the caller asked for, a live
  reading, and the verdicts (``Start``, ``Wait``, ``Retry``, ``Fail``, ``Refuse``);
* :mod:`~gpupool._core.planner.state`: tasks, runs and cards (each card holds its runs);
* :mod:`~gpupool._core.planner.fit`: the one fit every width is a view of, and the live gate;
* :mod:`~gpupool._core.planner.sharing`: the host's other pools on a card;
* :mod:`~gpupool._core.planner.order`: the start order and the room held for a waiting task;
* :mod:`~gpupool._core.planner.oom`: an out-of-memory judged against the task's own booking;
* :mod:`~gpupool._core.planner.records`: what each record says;
* :mod:`~gpupool._core.planner.samples`: whose bytes a reading shows, and the
  ``card_read`` samples of it;
* :mod:`~gpupool._core.planner.base`, :mod:`~.views`, :mod:`~.starts`,
  :mod:`~gpupool._core.planner.planner`: the state, the widths (views of the fit),
  the next start, the events;
* :mod:`~gpupool._core.planner.what_if`: a what-if census asked of the planner
  (``gpupool plan``).
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
