"""How long each key's tasks take: their mean, their recent mean, and whether they are short.

The start order reads the means (the critical key, when a running task is
expected to end); queueing behind a run reads whether a key is short and how
deep its tasks may queue (:mod:`~gpupool._core.planner.queued`).
"""

from __future__ import annotations

from gpupool._core.planner.state import Run

__all__ = [
    "LONG_MEMORY_TASKS",
    "LONG_TASK_S",
    "QUEUED_WORK_S",
    "QUEUE_DEPTH",
    "QUEUE_DEPTH_LEAST",
    "SHORT_MIN_TASKS",
    "SHORT_TASK_S",
    "Durations",
]

#: A key's tasks are short when their mean measured run time is under this: a task queued
#: behind one of them waits at most about that long while another worker may be idle.
SHORT_TASK_S = 0.02
#: At most this many tasks wait behind one worker's run, each starting as the one before ends
#: (tasks of a few milliseconds: the parent hands over a few per turn, not one) ...
QUEUE_DEPTH = 8
#: ... as many as the key's mean run time fits in this (the last waits about this long) ...
QUEUED_WORK_S = SHORT_TASK_S
#: ... and at least this many.
QUEUE_DEPTH_LEAST = 2
#: How many of a key's tasks are timed before it may be found short.
SHORT_MIN_TASKS = 3
#: A task of a key that took this long is a long one, whatever the key's mean ...
LONG_TASK_S = 0.1
#: ... and the key is not short until this many of its tasks ended after it.
LONG_MEMORY_TASKS = 8


class Durations:
    """Each key's measured task durations (the only writer of them)."""

    def __init__(self) -> None:
        # By key: how many of its tasks were timed, and their mean seconds.
        self._timed: dict[str, tuple[int, float]] = {}
        # By key, the mean run time of its last tasks (the last LONG_MEMORY_TASKS weigh most),
        # which decides whether it is short and how deep it queues.
        self._recent_s: dict[str, float] = {}
        # Keys with a long task among their last ones: how many more must end before it is
        # forgotten.
        self._long_left: dict[str, int] = {}

    def timed(self, key: str, took_s: float) -> None:
        """A task of ``key`` ended after ``took_s``: it joins the key's mean; a long one is
        remembered for the key's next :data:`LONG_MEMORY_TASKS` tasks; the key's recent mean
        follows ``took_s`` (the plain mean over its first :data:`LONG_MEMORY_TASKS`, a weight
        of 1/:data:`LONG_MEMORY_TASKS` after them)."""
        count, mean_s = self._timed.get(key, (0, 0.0))
        self._timed[key] = (count + 1, mean_s + (took_s - mean_s) / (count + 1))
        weight = 1.0 / min(count + 1, LONG_MEMORY_TASKS)
        recent_s = self._recent_s.get(key, took_s)
        self._recent_s[key] = recent_s + (took_s - recent_s) * weight
        if took_s >= LONG_TASK_S:
            self._long_left[key] = LONG_MEMORY_TASKS
        elif key in self._long_left:
            left = self._long_left[key] - 1
            if left > 0:
                self._long_left[key] = left
            else:
                del self._long_left[key]

    def mean_s(self, key: str) -> float | None:
        """The mean duration of ``key``'s timed tasks (``None``: none was timed)."""
        return self._timed[key][1] if key in self._timed else None

    def expected_end_s(self, run: Run) -> float:
        """When ``run`` is expected to end: its start plus its key's mean duration (its start
        alone until its key has a timed task, so the oldest ends first)."""
        return run.started_s + self._timed.get(run.key, (0, 0.0))[1]

    def short(self, key: str) -> bool:
        """Whether ``key``'s measured tasks are short (:data:`SHORT_TASK_S`), with no long one
        among the last of them (:data:`LONG_TASK_S`); the mean is of its recent tasks (each
        of the last :data:`LONG_MEMORY_TASKS` weighs 1/8 of it), so a key whose tasks grew
        slower stops being short within a few of them, whatever ran before."""
        count, _ = self._timed.get(key, (0, 0.0))
        return (
            count >= SHORT_MIN_TASKS
            and self._recent_s.get(key, 0.0) < SHORT_TASK_S
            and key not in self._long_left
        )

    def queue_depth(self, key: str) -> int:
        """How many tasks of ``key`` may wait behind one of its runs: as many as its recent
        mean measured run time (:meth:`timed`) fits in :data:`QUEUED_WORK_S`, within
        :data:`QUEUE_DEPTH_LEAST` and :data:`QUEUE_DEPTH`."""
        mean_s = self._recent_s.get(key, 0.0)
        if mean_s * QUEUE_DEPTH <= QUEUED_WORK_S:
            return QUEUE_DEPTH
        return max(QUEUE_DEPTH_LEAST, int(QUEUED_WORK_S / mean_s))
