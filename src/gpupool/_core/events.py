"""Decision records: every width decision as data, with every term it was made from (pure core).

A record is a frozen value; :meth:`Decision.to_dict` gives the JSON-able
dict that the decision log writes, one per line. Its keys are the names of
the terms (``total_bytes``, ``co_tenant_bytes``, ``own_high_water_bytes``,
``reserve_bytes``, ``ask_bytes``, ``ask_basis``, ``room_bytes``), so a log
line explains itself. The clock is passed in (``time_s``), never read here.

This module is the one definition of the log's schema: the writer
(:class:`Decision`, :func:`run_record`) and the readers (``gpupool
postmortem``, ``gpupool plot``, :mod:`gpupool._core.attribution`) take the
event names, the schema version and the out-of-memory terms from here.

A log file may hold several runs (a ``log_path`` appended to by two
pools): each run opens with a ``run_started`` record, and every record of
a run carries its ``run_id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Union

if TYPE_CHECKING:
    # Named by the records' fields only: what imports the records (a pool's submitting
    # side, which a worker imports with the user's script) loads no policy.
    from gpupool._core.bound import Bound, Ceiling, WidthDecision
    from gpupool._core.policy import Ask

__all__ = [
    "ERROR_TEXT_CHARS",
    "EVENTS",
    "OOM_TERMS",
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "SETTING_PREFIX",
    "TASK_KEY_CHARS",
    "TASK_LABEL_CHARS",
    "TASK_TERMS",
    "Decision",
    "EventName",
    "JsonScalar",
    "JsonTable",
    "JsonValue",
    "TABLE_COLUMNS",
    "TABLE_ROWS",
    "TaskIdentity",
    "describe_task",
    "run_record",
    "truncate_text",
]

#: Version of the decision log's schema; readers refuse newer ones by name.
#: 2 added ``run_id`` on every record and the ``run_started`` record; 3 added
#: the ``card_read`` record and tables (:data:`JsonTable`) as values.
SCHEMA_VERSION = 3

#: The schema versions this gpupool reads (1: logs without run ids, split at
#: each ``constructed`` record).
READABLE_SCHEMAS = (1, 2, 3)

#: The most rows a table value holds, and the most columns of a row: a record
#: stays bounded whatever the pool runs (a reader refuses larger ones).
TABLE_ROWS = 256
TABLE_COLUMNS = 16

#: The most characters of free text (an exception's message) a record copies.
#: A message can carry what its author did not mean to log (a path, a token):
#: the log keeps its start, marked as cut.
ERROR_TEXT_CHARS = 200

#: The most characters of a task's label (``options(label=...)``).
TASK_LABEL_CHARS = 200

#: The most characters of a task key a caller names (``options(key=...)``): a key is on
#: every record about its tasks, and a card's table holds up to ``TABLE_ROWS`` of them, so
#: a record stays far below the line a reader takes (``gpupool postmortem``: 1 MiB).
TASK_KEY_CHARS = 1000

#: The terms naming the task a record is about (:class:`TaskIdentity`), by name: on every
#: record of one task (``serial_start``, ``measured``, ``out_of_memory``, which is also the
#: retry's record, ``worker_lost``, ``worker_replaced``, and a deadline's record).
TASK_TERMS: Mapping[str, str] = {
    "task_id": "the pool's number for the task (unique in the parent process)",
    "task_entry": "optional: its position in map's iterables, counted from 0 (its result's index)",
    "task_entries": "optional: how many positions from task_entry one task of a chunked map covers",
    "task_label": "optional: the label given with options(label=...)",
}

#: The prefix of the pool's settings in a ``run_started`` record
#: (``setting_max_workers``, ``setting_task_peak_bytes``, ...).
SETTING_PREFIX = "setting_"

#: The terms an ``out_of_memory`` record carries for the attribution, by name
#: (see :mod:`gpupool._core.attribution`). ``live_pool_bytes`` and
#: ``live_own_bytes`` are optional: a record without them is attributed from
#: the others.
OOM_TERMS: Mapping[str, str] = {
    "total_bytes": "the card's capacity",
    "census_co_tenant_bytes": "everything not the pool's, read once at construction",
    "own_high_water_bytes": "the parent's device high-water as the pool knew it",
    "reserve_bytes": "kept free on purpose",
    "booked_bytes": "the asks of the tasks running on the card, the failing one's included",
    "running": "how many tasks ran on the card",
    "task_ask_bytes": "the failing task's own ask (its price)",
    "task_booked_bytes": "what the failing task was booked at when it started (its share of "
    "its key's price where its key's tasks are priced together)",
    "ask_bytes": "the key's ask when it failed",
    "reached_bytes": "what the failing child held at its peak",
    "requested_bytes": "the allocation the card refused",
    "live_used_bytes": "the card's used bytes, read after the child reported",
    "live_free_bytes": "the card's free bytes, read with it",
    "live_pool_bytes": "optional: the pool's children as read",
    "live_own_bytes": "optional: the parent's device bytes at the out-of-memory",
    "priced_own_high_water_bytes": "optional: the own high-water the running tasks were priced at",
    "other_pools_bytes": "optional: what other gpupool pools had booked on the card",
    "other_pools_held_bytes": "optional: what other gpupool pools' tasks held on the card",
    "other_pools_overrun_bytes": "optional: how far they held past their bookings",
    "retry": "whether the pool retried the task",
}

EventName = Literal[
    "run_started",
    "constructed",
    "narrowed",
    "widened",
    "widen_refused",
    "bound_changed",
    "live_gate_wait",
    "share_wait",
    "critical_wait",
    "head_wait",
    "cap_lifted",
    "serial_start",
    "out_of_memory",
    "worker_lost",
    "task_timeout",
    "worker_replaced",
    "fixed_width_over_bound",
    "measured",
    "sensor_error",
    "bookings_skipped",
    "bookings_unavailable",
    "shutdown",
    "card_read",
    "peaks_vary",
    "unexplained_memory",
    "predicted",
    "outlier",
]

#: Every event a decision record can carry, and what it means.
EVENTS: Mapping[str, str] = {
    "run_started": "a pool run began: its run id, its settings, the gpupool that wrote it",
    "constructed": "the census was taken and the first width decided",
    "narrowed": "a device's width went down (a larger measured ask, or an out-of-memory)",
    "widened": "a device's width went up (a smaller measured ask), within the room",
    "widen_refused": "a measurement asked for more width than the room holds",
    "bound_changed": "a term of the bound changed (own high-water, an ask) without moving a width",
    "live_gate_wait": "a task was held back: the card's live free bytes did not cover it",
    "share_wait": "a task was held back: another pool waits for room on a card this pool "
    "holds more than its share of",
    "critical_wait": "tasks of other keys were held back so that the key whose pending work "
    "would take longest can run one more at once",
    "head_wait": "room was held on a card for the task at the queue's head, which smaller "
    "tasks had passed a ceiling's worth of times; others start only beside that room",
    "cap_lifted": "the cap an out-of-memory set on a card lifted: the live reading shows the "
    "room it was set for back",
    "serial_start": "a task started although the live gate was shut: nothing else ran",
    "out_of_memory": "a task ran its card out of memory",
    "worker_lost": "a worker process died while running a task",
    "task_timeout": "a task ran past its deadline (timeout_s): its process tree was ended",
    "worker_replaced": "a worker could not set up its next task (descriptors or memory "
    "used up by a task before it): the task goes to a fresh worker",
    "fixed_width_over_bound": "a fixed width is wider than the bound allows",
    "measured": "a task key's ask changed basis or value without changing any width",
    "sensor_error": "a live reading failed; what the pool does while it fails",
    "bookings_skipped": "the host's booking table, or part of a shared one, was passed over "
    "for a step (its lock was held past the wait, it could not be read or written, or another "
    "user's file was refused or left for the read budget); tried again later",
    "bookings_unavailable": "the host's booking table cannot be used here: the pool no longer "
    "sees other pools' bookings, and prices its cards by live readings alone",
    "shutdown": "the pool shut down; the run's totals",
    "card_read": "a sample of a card as the pool read it: its used bytes, the parent's, the "
    "pool's workers', everything else's, and what the pool had booked there, by key",
    "peaks_vary": "a task key's measured peaks vary a lot (the largest more than twice the "
    "least and more than the margin floor above it, from three on): its margin is held to "
    "their range; give its tasks size= or keys of their own",
    "unexplained_memory": "the card's used bytes that no process's row explains rose while "
    "the pool's tasks ran: managed memory, a process the driver does not list, or a spike",
    "predicted": "a feature of the calls (an argument's length, nbytes or value) began or "
    "stopped explaining a task key's peaks: its tasks are priced one by one from it",
    "outlier": "a task's peak lay far outside its key's distribution: kept apart, priced for "
    "that task (and calls like it) while the key's other tasks keep their price",
}

JsonScalar = Union[int, float, str, bool, None]  # noqa: UP007 (a runtime alias on 3.10)
#: A table: rows of scalars (each task running on a card, each key booked there).
JsonTable = list[dict[str, JsonScalar]]
JsonValue = Union[JsonScalar, JsonTable]  # noqa: UP007


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskIdentity:
    """Which task a record is about: the pool's number for it, its ``map`` position and the
    label the caller gave it.

    Attributes:
        task_id: the pool's number for the task, unique in the parent process.
        entry: its position in ``map``'s iterables, counted from 0 (the index of its result);
            ``None`` for a task given to ``submit``.
        entries: how many positions from ``entry`` it covers (a chunk of ``map``).
        label: the caller's label (``options(label=...)``), or ``None``.
    """

    task_id: int
    entry: int | None = None
    entries: int = 1
    label: str | None = None

    def terms(self) -> dict[str, JsonValue]:
        """The record's terms (:data:`TASK_TERMS`): those that are set."""
        out: dict[str, JsonValue] = {"task_id": self.task_id}
        if self.entry is not None:
            out["task_entry"] = self.entry
            if self.entries > 1:
                out["task_entries"] = self.entries
        if self.label is not None:
            out["task_label"] = self.label
        return out

    def describe(self) -> str:
        """``"entry 25, label 'resnet-ckpt-7'"``; ``"task 12"`` without either."""
        return describe_task(self.terms()) or f"task {self.task_id}"


def describe_task(record: Mapping[str, object]) -> str:
    """The task a record (as read back from a log) is about, in words: ``"entry 25, label
    'resnet-ckpt-7'"``, ``"entries 8-11"``, ``"task 12"``; empty when it names none."""
    parts = []
    entry, entries = record.get("task_entry"), record.get("task_entries")
    if isinstance(entry, int) and not isinstance(entry, bool):
        if isinstance(entries, int) and not isinstance(entries, bool) and entries > 1:
            parts.append(f"entries {entry}-{entry + entries - 1}")
        else:
            parts.append(f"entry {entry}")
    label = record.get("task_label")
    if isinstance(label, str):
        parts.append(f"label {truncate_text(label, TASK_LABEL_CHARS)!r}")
    task_id = record.get("task_id")
    if not parts and isinstance(task_id, int) and not isinstance(task_id, bool):
        parts.append(f"task {task_id}")
    return ", ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One decision and every term it was made from.

    Attributes:
        event: what happened (one of ``EVENTS``; see the decision log page).
        time_s: seconds since the pool was constructed.
        device: the device it concerns, or ``None`` for the whole pool.
        width_before: the device's (or pool's) width before.
        width_after: the width after.
        reason: a sentence with every number in it.
        bound: the memory bound's terms, where one applies.
        ceiling: the ceiling's terms, where one applies.
        limit: which limit set the width (``"memory"``, ``"cpus"``, ...).
        key: the task key concerned, if any.
        extra: further terms (``live_free_bytes``, ``exitcode``, ...); values
            are JSON scalars or tables of them (at most 256 rows of 16 scalars),
            and byte counts end in ``_bytes``.
        task: the one task the record is about, where it is about one (written as the
            terms ``task_id``, ``task_entry``, ``task_entries`` and ``task_label``).
        key_ask: the ask of the record's ``key`` itself (the bound's ``ask_bytes``
            is the ask the width was priced at, which for mixed keys is the
            largest current one); written as ``key_ask_bytes``, ``key_ask_basis``,
            ``key_estimate_bytes``, ``key_measured_peak_bytes``.
        run_id: the run this record belongs to; the decision log sets it
            (the code that makes a record leaves it ``None``).
    """

    event: EventName
    time_s: float
    device: int | None
    width_before: int | None
    width_after: int | None
    reason: str
    bound: Bound | None = None
    ceiling: Ceiling | None = None
    limit: str | None = None
    key: str | None = None
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    key_ask: Ask | None = None
    run_id: str | None = None
    task: TaskIdentity | None = None

    @classmethod
    def from_width(
        cls,
        event: EventName,
        decision: WidthDecision,
        *,
        time_s: float,
        width_before: int | None,
        reason: str,
        key: str | None = None,
        extra: Mapping[str, JsonValue] | None = None,
        key_ask: Ask | None = None,
    ) -> Decision:
        """A record for a width decision, carrying its bound and ceiling."""
        return cls(
            event=event,
            time_s=time_s,
            device=decision.device,
            width_before=width_before,
            width_after=decision.width,
            reason=reason,
            bound=decision.bound,
            ceiling=decision.ceiling,
            limit=decision.limit,
            key=key,
            extra=dict(extra or {}),
            key_ask=key_ask,
        )

    def to_dict(self) -> dict[str, JsonValue]:
        """A flat JSON-able dict: the schema version, the event, and every term."""
        out: dict[str, JsonValue] = {
            "schema": SCHEMA_VERSION,
            "run_id": self.run_id,
            "event": self.event,
            "time_s": round(self.time_s, 6),
            "device": self.device,
            "width_before": self.width_before,
            "width_after": self.width_after,
            "limit": self.limit,
            "key": self.key,
        }
        if self.task is not None:
            out.update(self.task.terms())
        if self.bound is not None:
            out.update(
                total_bytes=self.bound.total_bytes,
                co_tenant_bytes=self.bound.co_tenant_bytes,
                other_pools_bytes=self.bound.other_pools_bytes,
                own_high_water_bytes=self.bound.own_high_water_bytes,
                reserve_bytes=self.bound.reserve_bytes,
                ask_bytes=self.bound.ask_bytes,
                ask_basis=self.bound.ask_basis,
                room_bytes=self.bound.room_bytes,
                tasks_fit=self.bound.tasks_fit,
            )
            if self.bound.together_bytes is not None:
                out["together_tasks"] = self.bound.together_tasks
                out["together_bytes"] = self.bound.together_bytes
            if self.bound.host_per_task_bytes:
                out["host_per_task_bytes"] = self.bound.host_per_task_bytes
        if self.ceiling is not None:
            out.update(
                ceiling=self.ceiling.value,
                ceiling_limit=self.ceiling.limit,
                max_workers=self.ceiling.max_workers,
                cpus=self.ceiling.cpus,
                host_ram_bytes=self.ceiling.host_ram_bytes,
                child_rss_bytes=self.ceiling.child_rss_bytes,
                pending_items=self.ceiling.pending_items,
            )
        if self.key_ask is not None:
            out.update(
                key_ask_bytes=self.key_ask.ask_bytes,
                key_ask_basis=self.key_ask.basis,
                key_estimate_bytes=self.key_ask.estimate_bytes,
                key_measured_peak_bytes=self.key_ask.measured_peak_bytes,
            )
        for name, value in self.extra.items():
            if isinstance(value, list):
                value = [
                    {c: truncate_text(v) if isinstance(v, str) else v for c, v in row.items()}
                    for row in value[:TABLE_ROWS]
                ]
            out.setdefault(name, truncate_text(value) if isinstance(value, str) else value)
        out["reason"] = self.reason
        return out


def truncate_text(text: str, limit: int = ERROR_TEXT_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked as cut when it was longer."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"... [cut: {len(text) - limit} more characters]"


def run_record(
    *,
    run_id: str,
    started_at: str,
    pid: int,
    gpupool_version: str,
    settings: Mapping[str, JsonValue],
) -> dict[str, JsonValue]:
    """The record that opens a run in a decision log (the file only; not a decision).

    Args:
        run_id: the run's id, carried by every record of the run.
        started_at: when the run began (ISO 8601, UTC), as read by the caller.
        pid: the parent process.
        gpupool_version: the gpupool that wrote the log.
        settings: the pool's settings as given (``max_workers``, ``task_peak_bytes``,
            ...), written with :data:`SETTING_PREFIX`.
    """
    out: dict[str, JsonValue] = {
        "schema": SCHEMA_VERSION,
        "run_id": run_id,
        "event": "run_started",
        "time_s": 0.0,
        "device": None,
        "started_at": started_at,
        "pid": pid,
        "gpupool_version": gpupool_version,
    }
    for name, value in settings.items():
        out[SETTING_PREFIX + name] = truncate_text(value) if isinstance(value, str) else value
    out["reason"] = f"run {run_id} started by process {pid} (gpupool {gpupool_version})"
    return out


# Re-exported by gpupool, which may not have imported this module yet (it loads it on
# first use): the public path is set here, so reprs, docs and pickles name it whenever used.
Decision.__module__ = TaskIdentity.__module__ = "gpupool"
