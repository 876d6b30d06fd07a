"""A short task queued behind a busy worker, in that worker's booking (pure core).

A worker that ends a task waits for the parent to hand it the next one: the answer crosses the
socket, the parent books the next start and sends it back. For tasks that take milliseconds that
round trip is most of the time, so the next tasks of the same key may wait in the busy worker's
socket, each starting the moment the one before ends: as many as the key's recent mean run time fits
in :data:`~.base.QUEUED_WORK_S` (so the last of them waits about that long), at least
:data:`~.base.QUEUE_DEPTH_LEAST` and at most :data:`~.base.QUEUE_DEPTH`
(:meth:`~.base.Durations.queue_depth`). The planner allows it only where it books nothing new:

* the task is the queue's head (the start order is kept; no scan of the queue) and of the running
  task's key, with no size of its own (sized asks are priced one by one) and no card to avoid;
* the key is short (:meth:`~.base.Durations.short`: a key whose run times have a
  long tail would otherwise queue a long task behind a long one while a worker idles);
* no more tasks run than the pool's ceiling; on a card, nothing caps the card after an
  out-of-memory, the task's ask is not above the running task's booking, a task at the key's price
  now would fit the bound in the run's place beside the card's other runs (a price that rose, or
  other pools that took the room, stop queueing as they stop a start), and no room is held for a
  waiting task.

A queued task leaves the pending queue and holds its slot behind the run: it is not counted as
waiting, and no start is made for it. When the run ends, the first queued task starts on that worker
in the booking the run leaves, and the others follow it (:meth:`Queue.run_queued`), booked as any
running task of its key; a queued task whose worker is lost or declines it goes back to the queue's
head (:meth:`Queue.requeue`).
"""

from __future__ import annotations

from gpupool._core.planner.base import Durations, PlannerState
from gpupool._core.planner.fit import fit_counts
from gpupool._core.planner.order import Order
from gpupool._core.planner.state import Card, Run
from gpupool._core.planner.verdicts import TaskId
from gpupool._core.planner.views import Views

__all__ = ["Queue"]


class Queue:
    """Tasks queued behind running ones (the only writer of :attr:`queued`: queued task ->
    the run it follows). Reads which keys are short (the durations), and queues nothing
    while room is held for the head (the order) or once strict mode refused (the views)."""

    def __init__(
        self, state: PlannerState, durations: Durations, order: Order, views: Views
    ) -> None:
        self._state = state
        self._durations = durations
        self._order = order
        self._views = views
        self.queued: dict[TaskId, TaskId] = {}
        # By run with tasks still queued behind it, the last of them sent back to the queue:
        # the next one sent back from that run goes after it.
        self._requeued_last: dict[TaskId, TaskId] = {}

    def queue_behind(self, behind: TaskId) -> TaskId | None:
        """The pending task to queue behind the running ``behind`` on its worker, taken off
        the pending queue; ``None`` when the queue's head may not follow it (or
        :meth:`~.base.Durations.queue_depth` tasks already follow it)."""
        state = self._state
        run = state.running.get(behind)
        if (
            run is None
            or not state.pending
            or self._views.refused is not None
            or self._order.hold is not None
            or run.size is not None
            or len(state.running) > state.ceiling.value
            or sum(1 for followed in self.queued.values() if followed == behind)
            >= self._durations.queue_depth(run.key)
        ):
            return None
        head = state.pending[0]
        task = state.tasks[head]
        if (
            task.key != run.key
            or task.size is not None
            or task.hint_bytes is not None
            or task.room_wait_until_s is not None
            or not self._durations.short(run.key)
        ):
            return None
        if run.device is not None:
            card = state.cards[run.device]
            if (
                run.device in task.avoid
                or card.cap.oom_cap is not None
                or state.asks.ask(run.key).ask_bytes > run.booked_bytes
                or not self._fits_in_place(card, run)
            ):
                return None
        state.unqueue(head)
        self.queued[head] = behind
        return head

    def _fits_in_place(self, card: Card, run: Run) -> bool:
        """Whether a task of ``run``'s key at its price now fits the bound on ``card`` in
        ``run``'s place, beside the card's other runs, as a start there would be checked:
        a price that rose past the card's room, or other pools that took it, stop the
        tasks queued behind the runs as they stop a start."""
        same, together = card.key_counts(run.key)
        return (
            fit_counts(
                card,
                self._state.asks.ask(run.key),
                running=len(card.runs) - 1,
                booked_bytes=card.sums.booked_bytes - run.booked_bytes,
                same=same - 1,
                together=together - (not run.solo),
                reserve_bytes=self._state.config.reserve_bytes,
                ceiling=self._state.ceiling,
                slots=1,
            ).more
            > 0
        )

    def run_queued(self, task: TaskId) -> None:
        """The run ``task`` was queued behind has ended: ``task`` runs now (the caller begins
        it), and the tasks queued behind that run follow ``task`` now."""
        ended = self.queued.pop(task)
        for queued, followed in self.queued.items():
            if followed == ended:
                self.queued[queued] = task

    def requeue(self, task: TaskId) -> None:
        """``task`` was queued behind a run whose worker is gone (or declined it): it never
        ran, so it goes back to the head of the pending queue; after the task queued behind
        the same run that went back just before it (told in their queue order, the tasks
        of one run keep it, whatever other runs' tasks are told between them)."""
        followed = self.queued.pop(task, None)
        if followed is None:
            return
        self._state.put_back(task, after=self._requeued_last.get(followed))
        self._requeued_last[followed] = task
        self._forget_requeued(followed)

    def _forget_requeued(self, followed: TaskId) -> None:
        """No task waits behind ``followed`` any more: none of its is sent back after now."""
        if followed in self._requeued_last and followed not in self.queued.values():
            del self._requeued_last[followed]

    def drop(self, task: TaskId) -> None:
        """``task`` left the planner (failed or withdrawn) while queued."""
        followed = self.queued.pop(task, None)
        if followed is not None:
            self._forget_requeued(followed)
