"""``gpupool top``: every pool on the host's cards, read from the booking table and the sensor.

One snapshot is a JSON-ready dict (:func:`take_snapshot`); the plain text and the
live view (:mod:`gpupool._observe.top_view`, with ``rich``) are drawn from it::

    device 0  GPU-1234  40.00 GiB total, 22.00 GiB used, 3.00 GiB co-tenants, 12.00 GiB room
      pool 2817.1  pid 2817  train.py   booked 13.00 GiB  measured 12.30 GiB  2 running, 3 waiting
        task  fit          pid 2830     booked 6.50 GiB   measured 6.00 GiB
        waiting 3, first needs 6.50 GiB: fit 6.50 GiB x3
        last  narrowed, 4 s ago: ...

Per card: ``used`` and ``free`` from the sensor's reading; a pool's ``measured``
bytes are its workers' per-process rows (the workers its row lists, and any
other child of the pool's process on the card); ``co_tenants`` is ``used`` less
every pool's measured bytes; ``room`` is ``free`` less what the pools have booked
and their tasks have not yet reached (each task's reach taken from its worker's
row where it has one).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from gpupool._core.units import format_size
from gpupool._errors import SensorError

if TYPE_CHECKING:
    from gpupool._core.bookings import OtherPools, PoolBooking
    from gpupool._core.census import Census
    from gpupool._sensors.base import DeviceInfo, Sensor
    from gpupool._sensors.bookings import BookingTable

__all__ = [
    "DEFAULT_INTERVAL_S",
    "INSTALL_HINT",
    "SNAPSHOT_VERSION",
    "Gatherer",
    "interval_type",
    "plain_text",
    "shown",
    "take_snapshot",
]

#: The layout of the JSON snapshot; bumped when a field changes meaning or goes.
SNAPSHOT_VERSION = 1
DEFAULT_INTERVAL_S = 1.0
#: The shortest and longest refresh ``--interval`` takes.
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 3600.0
INSTALL_HINT = "pip install 'gpupool[top]'"


def interval_type(text: str) -> float:
    """``--interval``: seconds between refreshes, a number from 0.1 to 3600."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--interval {text!r} is not a number of seconds (e.g. --interval 0.5)"
        ) from None
    if not math.isfinite(value) or not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"--interval {text!r}: give seconds from {MIN_INTERVAL_S} to {MAX_INTERVAL_S:g}"
        )
    return value


# -- gathering ----------------------------------------------------------------------------


class Gatherer:
    """The sensor, the cards and the booking table, opened once; :meth:`snapshot` per refresh.

    The cards are those a pool started here would see (``CUDA_VISIBLE_DEVICES``
    narrows them, as in ``gpupool census``).

    Raises:
        SensorError: the sensor could not list the cards.
        ConfigurationError: ``LOKY_MAX_CPU_COUNT`` is not a whole number of at least 1.
    """

    def __init__(self) -> None:
        from gpupool._sensors.bookings import open_booking_table
        from gpupool._sensors.census import live_census

        self.sensor, self.census, self.infos = live_census()
        try:
            self.table: BookingTable | None = open_booking_table(
                share=True, directory=None, sensor=self.sensor
            )
        except BaseException:
            self.sensor.close()
            raise

    def snapshot(self) -> dict[str, Any]:
        """Every card and every pool on it, now."""
        return take_snapshot(self.sensor, self.census, self.infos, self.table)

    def close(self) -> None:
        if self.table is not None:
            self.table.close()
        self.sensor.close()


def take_snapshot(
    sensor: Sensor, census: Census, infos: tuple[DeviceInfo, ...], table: BookingTable | None
) -> dict[str, Any]:
    """One snapshot as a JSON-ready dict (the fields are listed in the CLI docs)."""
    now_s = time.time()
    return {
        "version": SNAPSHOT_VERSION,
        "time_s": now_s,
        "sensor": census.sensor,
        "driver": census.driver,
        "reason": census.reason,
        "bookings_table": None if table is None else str(table.directory),
        "cards": [
            _card(sensor, card.device, info, table, now_s)
            for card, info in zip(census.cards, infos, strict=False)
        ],
    }


def _card(
    sensor: Sensor, device: int, info: DeviceInfo, table: BookingTable | None, now_s: float
) -> dict[str, Any]:
    card: dict[str, Any] = {
        "device": device,
        "index": info.index,
        "uuid": info.uuid,
        "name": info.name,
        "total_bytes": None,
        "used_bytes": None,
        "free_bytes": None,
        "co_tenant_bytes": None,
        "room_bytes": None,
        "processes": None,
        "pools": None,
        "pools_source": "no booking table (sharing is off)",
        "reason": None,
    }
    try:
        memory = sensor.read_memory(info)
        rows = sensor.read_processes(info)
    except SensorError as exc:
        card["reason"] = f"unreadable: {exc}"
        return card
    card.update(
        total_bytes=memory.total_bytes, used_bytes=memory.used_bytes, free_bytes=memory.free_bytes
    )
    held = None if rows is None else {row.pid: row.used_bytes or 0 for row in rows}
    card["processes"] = None if held is None else len(held)
    others = None if table is None else table.others(info.uuid, total_bytes=memory.total_bytes)
    if table is not None:
        card["pools_source"] = (
            f"booking table in {table.directory}"
            if others is not None
            else f"unknown: {table.unavailable_reason or 'the booking table was busy or failed'}"
        )
    if others is None:
        return card
    card["pools"] = pools = [_pool(pool, held, now_s) for pool in others.pools]
    card["room_bytes"] = _room(memory.free_bytes, others, held)
    if held is not None:
        measured = sum(pool["measured_bytes"] or 0 for pool in pools)
        card["co_tenant_bytes"] = max(0, memory.used_bytes - measured)
    return card


def _room(free_bytes: int, others: OtherPools, held: dict[int, int] | None) -> int:
    """Free bytes less what the pools booked and their tasks have not yet reached."""
    return free_bytes - others.unreached_given(held or {})


def _workers(pool: PoolBooking, held: dict[int, int]) -> set[int]:
    """The pool's workers on the card: those its row lists, and the pool's other children
    that have a row (idle workers keep their context)."""
    from gpupool._sensors.host import read_parent_pid

    listed = {task.worker_pid for task in pool.tasks}
    children = {pid for pid in held if pid not in listed and read_parent_pid(pid) == pool.pid}
    return listed | children


def _pool(pool: PoolBooking, held: dict[int, int] | None, now_s: float) -> dict[str, Any]:
    workers = set() if held is None else _workers(pool, held)
    last = pool.last
    return {
        "pool_id": pool.pool_id,
        "pid": pool.pid,
        "label": pool.label,
        "updated_s": pool.updated_s,
        "booked_bytes": pool.booked_bytes,
        "measured_bytes": None if held is None else sum(held.get(w, 0) for w in workers),
        "workers_on_card": None if held is None else len(workers & held.keys()),
        "running": [
            {**asdict(task), "measured_bytes": None if held is None else held.get(task.worker_pid)}
            for task in pool.tasks
        ],
        "waiting": pool.waiting,
        "need_bytes": pool.need_bytes,
        "waits": [asdict(wait) for wait in pool.waits],
        "last": None if last is None else {**asdict(last), "age_s": max(0.0, now_s - last.time_s)},
    }


# -- the plain text -----------------------------------------------------------------------


def card_heading(card: dict[str, Any]) -> str:
    """``device 0  GPU-...  <name>: 40.00 GiB total, ... room`` (the card's line)."""
    head = f"device {card['device']}  {shown(card['uuid'])}  {shown(card['name'])}"
    if card["total_bytes"] is None:
        return f"{head}: {card['reason']}"
    return (
        f"{head}: {format_size(card['total_bytes'])} total, "
        f"{format_size(card['used_bytes'])} used, "
        f"{_size_or(card['co_tenant_bytes'], 'unknown')} co-tenants, "
        f"{_size_or(card['room_bytes'], 'unknown')} room left"
    )


def pool_lines(pool: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """A pool's rows as ``(kind, cells)``: kind ``"pool"``, ``"task"``, ``"waiting"`` or
    ``"last"``; cells: what, pid, booked, measured, notes."""
    running = len(pool["running"])
    lines = [
        _row(
            "pool",
            f"pool {shown(pool['pool_id'])} {shown(pool['label']) or '-'}",
            f"{running} running, {pool['waiting']} waiting",
            pid=str(pool["pid"]),
            booked=format_size(pool["booked_bytes"]),
            measured=_size_or(pool["measured_bytes"], "?"),
        )
    ]
    for task in pool["running"]:
        lines.append(
            _row(
                "task",
                f"  task {shown(task['key'])}",
                pid=str(task["worker_pid"]),
                booked=format_size(task["booked_bytes"]),
                measured=_size_or(task["measured_bytes"], "-"),
            )
        )
    if pool["waiting"]:
        asks = ", ".join(
            f"{shown(wait['key'])} {format_size(wait['ask_bytes'])} x{wait['count']}"
            for wait in pool["waits"]
        )
        needs = f"first needs {format_size(pool['need_bytes'])}"
        lines.append(
            _row(
                "waiting",
                f"  waiting {pool['waiting']}",
                needs + (f"; asks: {asks}" if asks else ""),
            )
        )
    last = pool["last"]
    if last is not None:
        said = f"{shown(last['kind'])}, {_age(last['age_s'])}: {shown(last['reason'])}"
        lines.append(_row("last", "  last decision", said))
    return lines


def _row(
    kind: str, what: str, notes: str = "", *, pid: str = "", booked: str = "", measured: str = ""
) -> tuple[str, list[str]]:
    """One row of a pool's table, in :data:`COLUMNS` order (a cell not given is blank)."""
    return kind, [what, pid, booked, measured, notes]


#: The columns of a card's table.
COLUMNS = ("pool / task", "pid", "booked", "measured", "")


def plain_text(snapshot: dict[str, Any]) -> str:
    """The snapshot as plain text: a heading per card, then its pools' rows in columns."""
    out: list[str] = [
        f"gpupool top  {time.strftime('%H:%M:%S', time.localtime(snapshot['time_s']))}"
    ]
    no_device = no_device_line(snapshot)
    if no_device is not None:
        out.append(no_device)
    for card in snapshot["cards"]:
        out.append("")
        out.append(card_heading(card))
        note = pools_note(card)
        if note is not None:
            out.append(note)
            continue
        rows = [list(COLUMNS)] + [cells for pool in card["pools"] for _, cells in pool_lines(pool)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
        for row in rows:
            fixed = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            out.append(f"  {fixed}  {row[-1]}".rstrip())
    return "\n".join(out) + "\n"


def no_device_line(snapshot: dict[str, Any]) -> str | None:
    """``no device: <why>`` where the snapshot has no card to show, else ``None``."""
    if snapshot["driver"] and snapshot["cards"]:
        return None
    return f"no device: {shown(snapshot['reason'] or 'none visible')}"


def pools_note(card: dict[str, Any]) -> str | None:
    """The line shown in place of a card's pools where it has none to list (the table was
    not read, or no pool booked), else ``None``."""
    if card["pools"] is None:
        return f"  pools: {shown(card['pools_source'])}"
    if not card["pools"]:
        return "  no pool booked"
    return None


def shown(text: str) -> str:
    """``text`` safe to print on a terminal: every character that is not printable (escape
    sequences, newlines) as ``?``. Keys and labels come from any process that can write
    the table."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _size_or(nbytes: int | None, missing: str) -> str:
    return missing if nbytes is None else format_size(nbytes)


def _age(age_s: float) -> str:
    if age_s < 60:
        return f"{age_s:.0f} s ago"
    if age_s < 3600:
        return f"{age_s / 60:.0f} min ago"
    return f"{age_s / 3600:.1f} h ago"
