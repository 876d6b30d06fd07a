"""Decision records: every width decision as data, with every term it was made from (pure core).

A record is a frozen value; :meth:`Decision.to_dict` gives the JSON-able
dict that the decision log writes, one per line. Its keys are the names of
the terms (``total_bytes``, ``co_tenant_bytes``, ``own_high_water_bytes``,
``reserve_bytes``, ``ask_bytes``, ``ask_basis``, ``room_bytes``), so a log
line explains itself. The clock is passed in (``time_s``), never read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Union

from gpupool._core.bound import Bound, Ceiling, WidthDecision

__all__ = ["EVENTS", "SCHEMA_VERSION", "Decision", "EventName", "JsonValue"]

#: Version of the decision log's schema; readers refuse newer ones by name.
SCHEMA_VERSION = 1

EventName = Literal[
    "constructed",
    "narrowed",
    "widened",
    "widen_refused",
    "bound_changed",
    "live_gate_wait",
    "serial_start",
    "out_of_memory",
    "worker_lost",
    "fixed_width_over_bound",
    "measured",
    "sensor_error",
    "shutdown",
]

#: Every event a decision record can carry, and what it means.
EVENTS: Mapping[str, str] = {
    "constructed": "the census was taken and the first width decided",
    "narrowed": "a device's width went down (a larger measured ask, or an out-of-memory)",
    "widened": "a device's width went up (a smaller measured ask), within the room",
    "widen_refused": "a measurement asked for more width than the room holds",
    "bound_changed": "a term of the bound changed (own high-water, an ask) without moving a width",
    "live_gate_wait": "a task was held back: the card's live free bytes did not cover it",
    "serial_start": "a task started although the live gate was shut: nothing else ran",
    "out_of_memory": "a task ran its card out of memory",
    "worker_lost": "a worker process died while running a task",
    "fixed_width_over_bound": "a fixed width is wider than the bound allows",
    "measured": "a task key's ask changed basis or value without changing any width",
    "sensor_error": "a live reading failed; what the pool does while it fails",
    "shutdown": "the pool shut down; the run's totals",
}

JsonValue = Union[int, float, str, bool, None]  # noqa: UP007 (a runtime alias on 3.10)


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
            are JSON scalars and byte counts end in ``_bytes``.
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
        )

    def to_dict(self) -> dict[str, JsonValue]:
        """A flat JSON-able dict: the schema version, the event, and every term."""
        out: dict[str, JsonValue] = {
            "schema": SCHEMA_VERSION,
            "event": self.event,
            "time_s": round(self.time_s, 6),
            "device": self.device,
            "width_before": self.width_before,
            "width_after": self.width_after,
            "limit": self.limit,
            "key": self.key,
        }
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
            )
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
        for name, value in self.extra.items():
            out.setdefault(name, value)
        out["reason"] = self.reason
        return out
