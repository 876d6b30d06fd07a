"""Other pools' bookings on a card: the values of the host-wide booking table (pure core).

Every gpupool pool on a host writes what it has booked on each card to a
small table (one file per card UUID, kept by :mod:`gpupool._sensors.bookings`)
and reads the other pools' rows from it. A pool's census and live reading
count what other processes *hold* now; the table adds what the other pools
have *booked* and not yet reached, which no reading can see::

    card 0 (GPU-...)        pool 2817.1 (train.py)      pool 3301.1 (eval.py)
      booked                  2 x 6.50 GiB                3 x 6.50 GiB
      reached (held now)      6.00 + 0.30 GiB             0.30 + 0 + 0 GiB
      unreached               0.20 + 6.20 GiB             6.20 + 6.50 + 6.50 GiB

This module holds the records and the file's text format; it opens nothing
and reads no clock. The time of an update and the liveness of a PID are
passed in by the edge.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar, cast

from gpupool._core.events import Decision, JsonValue
from gpupool._core.units import format_size

__all__ = [
    "MAX_DECISION_KIND_CHARS",
    "MAX_DECISION_REASON_CHARS",
    "MAX_WAIT_KEY_CHARS",
    "MAX_WAITS",
    "TABLE_VERSION",
    "LastDecision",
    "OtherPools",
    "PoolBooking",
    "TableNote",
    "TaskBooking",
    "WaitBooking",
    "format_booking_table",
    "group_waits",
    "last_decision",
    "parse_booking_table",
]

_T = TypeVar("_T")

#: Bumped when the file's layout changes; a file of another version is not read.
TABLE_VERSION = 1

#: Bounds of a row's optional fields (``waits``, ``last``): a field past any of them, or
#: of the wrong type, is left out when the table is read (read as none); its row, whose
#: bookings other pools price by, is kept.
MAX_WAITS = 16
MAX_WAIT_KEY_CHARS = 200
MAX_DECISION_KIND_CHARS = 64
MAX_DECISION_REASON_CHARS = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskBooking:
    """One running task of a pool: what its pool booked for it, and what it has reached.

    Attributes:
        worker_pid: the worker process running the task (the PID its card
            lists it under, so a reader can correct ``reached_bytes`` from its
            own live per-process rows).
        key: the task key, for people.
        booked_bytes: the device bytes its pool counts for it.
        reached_bytes: what its worker held on the card when its pool last
            published (0 when the pool had no reading).
    """

    worker_pid: int
    key: str
    booked_bytes: int
    reached_bytes: int

    @property
    def unreached_bytes(self) -> int:
        """``max(0, booked - reached)``: what the task may still allocate within its booking."""
        return max(0, self.booked_bytes - self.reached_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitBooking:
    """Tasks of one key a pool holds back for room, for people watching the card.

    Attributes:
        key: the task key (at most :data:`MAX_WAIT_KEY_CHARS` characters).
        ask_bytes: the device bytes the pool asks for one of them.
        count: how many of the pool's waiting tasks have this key and ask (at least 1).
    """

    key: str
    ask_bytes: int
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LastDecision:
    """A pool's latest decision record, for people watching the card.

    Attributes:
        kind: the record's event (``"narrowed"``, ``"live_gate_wait"``...).
        reason: its sentence, cut to :data:`MAX_DECISION_REASON_CHARS` characters.
        time_s: when it was made, in seconds since the epoch.
    """

    kind: str
    reason: str
    time_s: float


def group_waits(entries: Iterable[tuple[str, int]]) -> tuple[WaitBooking, ...]:
    """Waiting tasks ``(key, ask_bytes)``, in queue order, as :class:`WaitBooking` entries:
    one per key and ask, in order of first appearance, at most :data:`MAX_WAITS` (tasks of
    a key and ask met after that many are not counted); keys cut to
    :data:`MAX_WAIT_KEY_CHARS` characters."""
    groups: dict[tuple[str, int], int] = {}
    for key, ask_bytes in entries:
        name = key[:MAX_WAIT_KEY_CHARS]
        if (name, ask_bytes) in groups:
            groups[(name, ask_bytes)] += 1
        elif len(groups) < MAX_WAITS:
            groups[(name, ask_bytes)] = 1
    return tuple(
        WaitBooking(key=key, ask_bytes=ask_bytes, count=count)
        for (key, ask_bytes), count in groups.items()
    )


def last_decision(kind: str, reason: str, time_s: float) -> LastDecision:
    """A decision as a row carries it: ``kind`` and ``reason`` cut to their bounds (a reason
    that was cut ends in ``"..."``)."""
    if len(reason) > MAX_DECISION_REASON_CHARS:
        reason = reason[: MAX_DECISION_REASON_CHARS - 3] + "..."
    return LastDecision(kind=kind[:MAX_DECISION_KIND_CHARS], reason=reason, time_s=time_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolBooking:
    """One pool's row in a card's table.

    Attributes:
        pool_id: unique among the live pools of the host (``"<pid>.<n>"``).
        pid: the process that owns the pool.
        start: that process's start token (its start time, as the edge reads
            it), so that a reused PID is not mistaken for the pool's process.
        label: the pool's program, for people (``train.py``).
        updated_s: when the row was written, in seconds since the epoch.
        tasks: the pool's running tasks on this card.
        waiting: how many of the pool's tasks wait for room (0: it starts all it has),
            so that pools sharing the card share it (see :attr:`OtherPools.waiting_pools`).
        need_bytes: the ask of the first of them (0 when none waits): the room the pool
            needs to start its next task.
        waits: the waiting tasks by key and ask, in queue order (at most
            :data:`MAX_WAITS`; optional, for people: no pool prices by it).
        last: the pool's latest decision, or ``None`` (optional, for people).
    """

    pool_id: str
    pid: int
    start: str
    label: str
    updated_s: float
    tasks: tuple[TaskBooking, ...] = ()
    waiting: int = 0
    need_bytes: int = 0
    waits: tuple[WaitBooking, ...] = ()
    last: LastDecision | None = None

    @property
    def booked_bytes(self) -> int:
        """The sum of the pool's booked asks on this card."""
        return sum(task.booked_bytes for task in self.tasks)

    @property
    def reached_bytes(self) -> int:
        """The sum of what the pool's tasks had reached when it last published."""
        return sum(task.reached_bytes for task in self.tasks)

    @property
    def unreached_bytes(self) -> int:
        """The sum of ``max(0, booked - reached)`` over the pool's tasks."""
        return sum(task.unreached_bytes for task in self.tasks)


@dataclass(frozen=True, slots=True, kw_only=True)
class OtherPools:
    """What every other live pool has booked on one card (what a pool must price beside its own).

    Attributes:
        card_uuid: the card.
        pools: the other pools' rows, by pool id (pools without a running
            task included, with no tasks).
    """

    card_uuid: str
    pools: tuple[PoolBooking, ...] = ()

    @property
    def booked_bytes(self) -> int:
        """The other pools' booked asks on the card."""
        return sum(pool.booked_bytes for pool in self.pools)

    @property
    def reached_bytes(self) -> int:
        """What the other pools' tasks had reached when each pool last published."""
        return sum(pool.reached_bytes for pool in self.pools)

    @property
    def unreached_bytes(self) -> int:
        """``sum(max(0, booked - reached))`` over every other pool's task, as published."""
        return sum(pool.unreached_bytes for pool in self.pools)

    @property
    def tasks(self) -> int:
        """How many tasks the other pools run on the card."""
        return sum(len(pool.tasks) for pool in self.pools)

    @property
    def waiting_pools(self) -> int:
        """How many other pools' processes have tasks waiting for room (the pools of one
        process count once: rows are cheap to write, processes are what a user runs)."""
        return len({pool.pid for pool in self.pools if pool.waiting})

    @property
    def active_pools(self) -> int:
        """How many other pools' processes run a task on the card or have tasks waiting
        (the pools of one process count once, so that a process cannot claim many shares
        by writing many rows)."""
        return len({pool.pid for pool in self.pools if pool.waiting or pool.tasks})

    @property
    def overrun_bytes(self) -> int:
        """``sum(max(0, reached - booked))``: how far the other pools' tasks grew past their
        bookings, as published (what a postmortem names as "another pool")."""
        return sum(
            max(0, task.reached_bytes - task.booked_bytes)
            for pool in self.pools
            for task in pool.tasks
        )

    def unreached_given(self, current_bytes: Mapping[int, int | None]) -> int:
        """Unreached bytes with each task's reach taken from a live reading where it has one.

        A published ``reached_bytes`` is as old as its pool's last update; a
        reader that has just read the card's per-process rows knows better.
        For each task whose worker PID is in ``current_bytes`` (with a known
        value), its reach is that reading; otherwise its published reach.

        Args:
            current_bytes: device bytes by PID, from this reader's own reading
                of the card's per-process rows.
        """
        total = 0
        for pool in self.pools:
            for task in pool.tasks:
                live = current_bytes.get(task.worker_pid)
                reached = task.reached_bytes if live is None else live
                total += max(0, task.booked_bytes - reached)
        return total

    def describe(self) -> str:
        """``"2 other pools: 13.00 GiB booked, 6.30 GiB reached, 6.70 GiB unreached"``."""
        if not self.pools:
            return "no other pool"
        noun = "pool" if len(self.pools) == 1 else "pools"
        return (
            f"{len(self.pools)} other {noun}: {format_size(self.booked_bytes)} booked, "
            f"{format_size(self.reached_bytes)} reached, "
            f"{format_size(self.unreached_bytes)} unreached"
        )

    def terms(self) -> dict[str, int]:
        """The figures as decision-log terms (``other_pools_*_bytes``, ``other_pools``)."""
        return {
            "other_pools": len(self.pools),
            "other_pools_tasks": self.tasks,
            "other_pools_booked_bytes": self.booked_bytes,
            "other_pools_reached_bytes": self.reached_bytes,
            "other_pools_unreached_bytes": self.unreached_bytes,
            "other_pools_overrun_bytes": self.overrun_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TableNote:
    """Something the booking table could not do, for the pool's decision log.

    Attributes:
        event: ``"bookings_skipped"`` (the table was passed over for some
            steps: its lock was held past the wait, or a read or write failed;
            it is tried again later) or ``"bookings_unavailable"`` (the table
            cannot be used here: the pool no longer sees other pools' bookings).
        reason: a sentence saying what happened and what the pool does.
        terms: the record's terms (``bookings_dir``, ``card_uuid``,
            ``lock_wait_s``, ``retry_after_s``, ``skipped_steps``...).
    """

    event: Literal["bookings_skipped", "bookings_unavailable"]
    reason: str
    terms: Mapping[str, JsonValue] = field(default_factory=dict)

    def decision(self, time_s: float) -> Decision:
        """The record, at ``time_s`` (seconds since the pool was constructed)."""
        return Decision(
            event=self.event,
            time_s=time_s,
            device=None,
            width_before=None,
            width_after=None,
            reason=self.reason,
            extra=dict(self.terms),
        )


# -- the file's text ------------------------------------------------------------------------


def format_booking_table(
    card_uuid: str,
    pools: Sequence[PoolBooking],
    fragments: dict[int, tuple[PoolBooking, str]] | None = None,
) -> bytes:
    """The table file's text for ``pools`` (compact JSON, one object).

    Args:
        card_uuid: the card the file is for.
        pools: its rows.
        fragments: a memo of each row's encoded text by the row's identity,
            kept by the caller between calls, so that a row object met again
            is not encoded again; it is left holding exactly ``pools``' rows.
    """
    memo: dict[int, tuple[PoolBooking, str]] = {}
    parts = []
    for pool in pools:
        known = fragments.get(id(pool)) if fragments is not None else None
        fragment = known[1] if known is not None and known[0] is pool else _format_pool(pool)
        memo[id(pool)] = (pool, fragment)
        parts.append(f"{json.dumps(pool.pool_id)}:{fragment}")
    if fragments is not None:
        fragments.clear()
        fragments.update(memo)
    head = f'{{"version":{TABLE_VERSION},"card_uuid":{json.dumps(card_uuid)},"pools":{{'
    return (head + ",".join(parts) + "}}").encode()


def _format_pool(pool: PoolBooking) -> str:
    row: dict[str, object] = {
        "pid": pool.pid,
        "start": pool.start,
        "label": pool.label,
        "updated_s": pool.updated_s,
        "waiting": pool.waiting,
        "need_bytes": pool.need_bytes,
        "tasks": [
            [task.worker_pid, task.key, task.booked_bytes, task.reached_bytes]
            for task in pool.tasks
        ],
    }
    if pool.waits:
        row["waits"] = [[wait.key, wait.ask_bytes, wait.count] for wait in pool.waits]
    if pool.last is not None:
        row["last"] = [pool.last.kind, pool.last.reason, pool.last.time_s]
    return json.dumps(row, separators=(",", ":"))


def parse_booking_table(
    data: bytes,
    *,
    card_uuid: str,
    max_pools: int | None = None,
    max_tasks: int | None = None,
) -> dict[str, PoolBooking]:
    """The rows of a table file, by pool id; an empty or blank file has none.

    Args:
        data: the file's bytes.
        card_uuid: the card the file must be for.
        max_pools: the most rows the file may hold (``None``: no limit). Applied while the
            text is decoded: decoding stops at the first row past it.
        max_tasks: the most tasks a row may hold (``None``: no limit), applied likewise.

    Raises:
        ValueError: the text is not a table of this version for ``card_uuid``, or is past
            a limit, naming what is wrong.
    """
    if not data.strip():
        return {}
    try:
        if max_pools is None and max_tasks is None:
            raw = json.loads(data)
        else:
            raw = json.loads(data, object_pairs_hook=_RowLimits(max_pools, max_tasks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("not a table (nested deeper than any table is)") from None
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if raw.get("version") != TABLE_VERSION:
        raise ValueError(f"version {raw.get('version')!r}; this gpupool reads {TABLE_VERSION}")
    if raw.get("card_uuid") != card_uuid:
        raise ValueError(f"it is the table of {raw.get('card_uuid')!r}, not {card_uuid!r}")
    pools = raw.get("pools")
    if not isinstance(pools, dict):
        raise ValueError("'pools' is not an object")
    return {
        str(pool_id): _parse_pool(str(pool_id), row)
        for pool_id, row in cast("dict[object, object]", pools).items()
    }


class _RowLimits:
    """A JSON object hook that counts rows (objects with ``tasks``) as they are decoded and
    stops the decoding at the first one past the limits (a ``ValueError``)."""

    def __init__(self, max_pools: int | None, max_tasks: int | None) -> None:
        self.max_pools = max_pools
        self.max_tasks = max_tasks
        self.rows = 0

    def __call__(self, pairs: list[tuple[str, object]]) -> dict[str, object]:
        obj = dict(pairs)
        tasks = obj.get("tasks")
        if tasks is None:
            return obj
        self.rows += 1
        if self.max_pools is not None and self.rows > self.max_pools:
            raise ValueError(f"more than {self.max_pools} rows")
        if (
            self.max_tasks is not None
            and isinstance(tasks, list)
            and len(cast("list[object]", tasks)) > self.max_tasks
        ):
            raise ValueError(f"a row of more than {self.max_tasks} tasks")
        return obj


class _BadOptional(ValueError):
    """A row's optional field is past its bound or of the wrong type: the field is left out."""


def _parse_pool(pool_id: str, row: object) -> PoolBooking:
    if not isinstance(row, dict):
        raise ValueError(f"pool {pool_id!r}: not an object")
    fields = cast("dict[str, object]", row)
    tasks_raw = fields.get("tasks")
    if not isinstance(tasks_raw, list):
        raise ValueError(f"pool {pool_id!r}: 'tasks' is not a list")
    tasks: list[TaskBooking] = []
    for entry in cast("list[object]", tasks_raw):
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ValueError(f"pool {pool_id!r}: a task is not [pid, key, booked, reached]")
        worker_pid, key, booked, reached = cast("list[object]", entry)
        tasks.append(
            TaskBooking(
                worker_pid=_pid(worker_pid, pool_id),
                key=str(key),
                booked_bytes=_count(booked, pool_id, "booked_bytes"),
                reached_bytes=_count(reached, pool_id, "reached_bytes"),
            )
        )
    updated = fields.get("updated_s")
    if (
        isinstance(updated, bool)
        or not isinstance(updated, (int, float))
        or not math.isfinite(updated)
    ):
        raise ValueError(f"pool {pool_id!r}: 'updated_s' is not a number")
    return PoolBooking(
        pool_id=pool_id,
        pid=_count(fields.get("pid"), pool_id, "pid"),
        start=str(fields.get("start")),
        label=str(fields.get("label", "")),
        updated_s=float(updated),
        tasks=tuple(tasks),
        waiting=_count(fields.get("waiting", 0), pool_id, "waiting"),
        need_bytes=_count(fields.get("need_bytes", 0), pool_id, "need_bytes"),
        waits=_optional(_parse_waits, fields.get("waits", []), ()),
        last=_optional(_parse_last, fields.get("last"), None),
    )


def _optional(parse: Callable[[object], _T], value: object, missing: _T) -> _T:
    """An optional field (for people: no pool prices by it), or ``missing`` where it is bad:
    a newer writer's or a hostile one's field never hides the row's bookings."""
    try:
        return parse(value)
    except _BadOptional:
        return missing


def _parse_waits(value: object) -> tuple[WaitBooking, ...]:
    """``[[key, ask_bytes, count], ...]``, at most :data:`MAX_WAITS` entries."""
    if not isinstance(value, list) or len(value) > MAX_WAITS:
        raise _BadOptional(f"'waits' is not a list of at most {MAX_WAITS} entries")
    waits: list[WaitBooking] = []
    for entry in cast("list[object]", value):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise _BadOptional("a wait is not [key, ask_bytes, count]")
        key, ask, count = cast("list[object]", entry)
        if not isinstance(key, str) or len(key) > MAX_WAIT_KEY_CHARS:
            raise _BadOptional("a wait's key is not a short string")
        if not (_is_count(ask) and _is_count(count)) or count == 0:
            raise _BadOptional("a wait's ask or count is not a count")
        waits.append(WaitBooking(key=key, ask_bytes=cast("int", ask), count=cast("int", count)))
    return tuple(waits)


def _parse_last(value: object) -> LastDecision | None:
    """``[kind, reason, time_s]`` or absent."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3):
        raise _BadOptional("'last' is not [kind, reason, time_s]")
    kind, reason, time_s = cast("list[object]", value)
    if not (isinstance(kind, str) and len(kind) <= MAX_DECISION_KIND_CHARS):
        raise _BadOptional("the last decision's kind is not a short string")
    if not (isinstance(reason, str) and len(reason) <= MAX_DECISION_REASON_CHARS):
        raise _BadOptional("the last decision's reason is not a short string")
    if isinstance(time_s, bool) or not isinstance(time_s, (int, float)):
        raise _BadOptional("the last decision's time_s is not a number")
    try:
        seconds = float(time_s)
    except OverflowError:
        raise _BadOptional("the last decision's time_s is out of range") from None
    if not math.isfinite(seconds):
        raise _BadOptional("the last decision's time_s is not finite")
    return LastDecision(kind=kind, reason=reason, time_s=seconds)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _pid(value: object, pool_id: str) -> int:
    """A worker PID: positive (0 and negatives name process groups, or every process)."""
    pid = _count(value, pool_id, "worker pid")
    if pid == 0:
        raise ValueError(f"pool {pool_id!r}: worker pid 0 is not a process")
    return pid


def _count(value: object, pool_id: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"pool {pool_id!r}: {name} {value!r} is not a non-negative integer")
    return value
