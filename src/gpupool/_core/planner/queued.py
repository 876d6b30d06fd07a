"""A short task queued behind a busy worker, in that worker's booking (pure core).

A worker that ends a task waits for the parent to hand it the next one: the
answer crosses the socket, the parent books the next start and sends it back.
For tasks that take milliseconds that round trip is most of the time, so the
next tasks of the same key may wait in the busy worker's socket, each starting
the moment the one before ends: as many as the key's recent mean run time fits
in :data:`QUEUED_WORK_S` (so the last of them waits about that long), at least
:data:`QUEUE_DEPTH_LEAST` and at most :data:`QUEUE_DEPTH` (:meth:`Queued.queue_depth`).
The planner allows it only where it books nothing new:

* the task is the queue's head (the start order is kept; no scan of the queue)
  and of the running task's key, with no size of its own (sized asks are priced
  one by one) and no card to avoid;
* the key is short: at least :data:`SHORT_MIN_TASKS` of its tasks were timed,
  the mean run time of its recent ones (:meth:`Queued.timed`) is under
  :data:`SHORT_TASK_S`, and none of its last
  :data:`LONG_MEMORY_TASKS` took :data:`LONG_TASK_S` or more (a key whose run
  times have a long tail, whose many short tasks would keep the mean low,
  would otherwise queue a long task behind a long one while a worker idles);
* no more tasks run than the pool's ceiling; on a card, nothing caps the card
  after an out-of-memory, the task's ask is not above the running task's
  booking, a task at the key's price now would fit the bound in the run's place
  beside the card's other runs (a price that rose, or other pools that took the
  room, stop queueing as they stop a start), and no room is held for a waiting
  task.

A queued task leaves the pending queue and holds its slot behind the run: it is
not counted as waiting, and no start is made for it. When the run ends, the
first queued task starts on that worker in the booking the run leaves, and the
others follow it (:meth:`Queued.run_queued`: the key's tasks on the card are
booked together as before, at the key's price then, so its total booking does
not grow unless the price did, as for any running task of a key whose ask
moved). Queued tasks whose worker is lost, or whose worker declines them
because the run before them ran out of device memory, go back to the head of
the queue in their order (:meth:`Queued.requeue`); one the pool fails or
withdraws leaves the planner as a pending one does.
"""

from __future__ import annotations

from gpupool._core.planner.fit import fit_counts
from gpupool._core.planner.starts import Starts
from gpupool._core.planner.state import Card, Run
from gpupool._core.planner.verdicts import TaskId

__all__ = [
    "LONG_MEMORY_TASKS",
    "LONG_TASK_S",
    "QUEUED_WORK_S",
    "QUEUE_DEPTH",
    "QUEUE_DEPTH_LEAST",
    "SHORT_MIN_TASKS",
    "SHORT_TASK_S",
    "Queued",
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


class Queued(Starts):
    """Tasks queued behind running ones (``self.queued``: queued task -> the run it follows)."""

    def _begin(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """``task``, off the pending queue, runs: the planner's own (:meth:`Planner._begin`)."""
        raise NotImplementedError

    def short(self, key: str) -> bool:
        """Whether ``key``'s measured tasks are short (:data:`SHORT_TASK_S`), with no long one
        among the last of them (:data:`LONG_TASK_S`); the mean is of its recent tasks (each
        of the last :data:`LONG_MEMORY_TASKS` weighs 1/8 of it), so a key whose tasks grew
        slower stops being short within a few of them, whatever ran before."""
        count, _ = self._durations_s.get(key, (0, 0.0))
        return (
            count >= SHORT_MIN_TASKS
            and self._recent_s.get(key, 0.0) < SHORT_TASK_S
            and key not in self._long_left
        )

    def timed(self, key: str, took_s: float) -> None:
        """A task of ``key`` ended after ``took_s``: a long one is remembered for the key's
        next :data:`LONG_MEMORY_TASKS` tasks; the key's recent mean follows ``took_s`` (the
        plain mean over its first :data:`LONG_MEMORY_TASKS`, a weight of
        1/:data:`LONG_MEMORY_TASKS` after them)."""
        count, _ = self._durations_s.get(key, (1, 0.0))
        weight = 1.0 / min(max(count, 1), LONG_MEMORY_TASKS)
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

    def queue_depth(self, key: str) -> int:
        """How many tasks of ``key`` may wait behind one of its runs: as many as its recent
        mean measured run time (:meth:`timed`) fits in :data:`QUEUED_WORK_S`, within
        :data:`QUEUE_DEPTH_LEAST` and :data:`QUEUE_DEPTH`."""
        mean_s = self._recent_s.get(key, 0.0)
        if mean_s * QUEUE_DEPTH <= QUEUED_WORK_S:
            return QUEUE_DEPTH
        return max(QUEUE_DEPTH_LEAST, int(QUEUED_WORK_S / mean_s))

    def queue_behind(self, behind: TaskId) -> TaskId | None:
        """The pending task to queue behind the running ``behind`` on its worker, taken off
        the pending queue; ``None`` when the queue's head may not follow it (or
        :meth:`queue_depth` tasks already follow it)."""
        run = self.running.get(behind)
        if (
            run is None
            or not self.pending
            or self.refused is not None
            or self.hold is not None
            or run.size is not None
            or len(self.running) > self.ceiling.value
            or sum(1 for followed in self.queued.values() if followed == behind)
            >= self.queue_depth(run.key)
        ):
            return None
        head = self.pending[0]
        state = self.tasks[head]
        if (
            state.key != run.key
            or state.size is not None
            or state.hint_bytes is not None
            or state.room_wait_until_s is not None
            or not self.short(run.key)
        ):
            return None
        if run.device is not None:
            card = self.cards[run.device]
            if (
                run.device in state.avoid
                or card.oom_cap is not None
                or self.asks.ask(run.key).ask_bytes > run.booked_bytes
                or not self._fits_in_place(card, run)
            ):
                return None
        self._unqueue(head)
        self.queued[head] = behind
        return head

    def _fits_in_place(self, card: Card, run: Run) -> bool:
        """Whether a task of ``run``'s key at its price now fits the bound on ``card`` in
        ``run``'s place, beside the card's other runs, as a start there would be checked:
        a price that rose past the card's room, or other pools that took it, stop the
        tasks queued behind the runs as they stop a start."""
        return (
            fit_counts(
                card,
                self.asks.ask(run.key),
                running=len(card.runs) - 1,
                booked_bytes=card.booked_bytes - run.booked_bytes,
                same=card.same_key(run.key) - 1,
                reserve_bytes=self.config.reserve_bytes,
                ceiling=self.ceiling,
                slots=1,
            ).more
            > 0
        )

    def run_queued(self, task: TaskId, device: int | None, pid: int | None, now_s: float) -> None:
        """The run ``task`` was queued behind has ended (and been told): ``task`` runs now on
        that worker, in the booking the run left; the tasks queued behind that run follow
        ``task`` now."""
        ended = self.queued.pop(task)
        for queued, followed in self.queued.items():
            if followed == ended:
                self.queued[queued] = task
        self._begin(task, device, pid, now_s)  # off the pending queue since it was queued

    def requeue(self, task: TaskId) -> None:
        """``task`` was queued behind a run whose worker is gone (or declined it): it never
        ran, so it goes back to the head of the pending queue; after the task queued behind
        the same run that went back just before it (told in their queue order, the tasks
        of one run keep it, whatever other runs' tasks are told between them)."""
        followed = self.queued.pop(task, None)
        if followed is None:
            return
        before = self._requeued_last.get(followed)
        if before is not None and before in self.pending:
            # Queued behind the same run after the one told before it: it follows that one.
            self.pending.insert(self.pending.index(before) + 1, task)
        else:
            self.pending.appendleft(task)
        self._pending_by_key[self.tasks[task].key] += 1
        self._requeued_last[followed] = task
        self._forget_requeued(followed)

    def _forget_requeued(self, followed: TaskId) -> None:
        """No task waits behind ``followed`` any more: none of its is sent back after now."""
        if followed in self._requeued_last and followed not in self.queued.values():
            del self._requeued_last[followed]

    def _drop_queued(self, task: TaskId) -> None:
        """``task`` left the planner (failed or withdrawn) while queued."""
        followed = self.queued.pop(task, None)
        if followed is not None:
            self._forget_requeued(followed)
