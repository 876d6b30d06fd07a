"""The card reader: one live reading of a card, free and per-process bytes together
(process layer).

It asks the sensor, and tells the pool's bytes (its workers' PIDs and the
processes their tasks started) from a co-tenant's. It returns readings: what
the planner makes of them is the loop's (:mod:`gpupool._pool.dispatcher`).
Only the dispatcher thread calls it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from gpupool._core.planner import SAMPLE_MIN_GAP_S, CardReading
from gpupool._sensors.host import read_ancestors

if TYPE_CHECKING:
    from gpupool._pool.dispatcher import DeviceState
    from gpupool._sensors.base import Sensor

__all__ = ["READ_WHILE_RUNNING_S", "CardReader"]

#: While tasks run, the cards are read at least this often (the planner samples
#: these readings into the decision log, coalesced: see ``card_read``).
READ_WHILE_RUNNING_S = SAMPLE_MIN_GAP_S


class CardReader:
    """Reads the pool's cards through ``sensor``; remembers when it last read them all, and
    per card the PIDs found not to be the pool's."""

    def __init__(self, sensor: Sensor) -> None:
        self.sensor = sensor
        # When every card was last read (monotonic seconds).
        self.read_s = 0.0
        # Per card, the rows of its readings found not to be under any worker (pool_pids).
        self.not_pool_pids: dict[int, set[int]] = {}

    def due_s(self) -> float:
        """How soon the cards are due to be read again while tasks run (<= 0: now)."""
        return self.read_s + READ_WHILE_RUNNING_S - time.monotonic()

    def reading_all(self) -> None:
        """The cards are being read, all of them, now."""
        self.read_s = time.monotonic()

    def read(self, device: DeviceState, workers: Collection[int]) -> CardReading | str:
        """One live snapshot of ``device``, its rows of ``workers`` (and of what they started)
        told as the pool's; the error's text when the sensor could not read it."""
        try:
            memory, rows = self.sensor.read_snapshot(device.info)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        process_bytes = None
        pool_pids: frozenset[int] = frozenset()
        if rows is not None:
            process_bytes = {r.pid: r.used_bytes or 0 for r in rows}
            pool_pids = self._pool_pids(device.index, process_bytes, frozenset(workers))
        return CardReading(
            free_bytes=memory.free_bytes,
            used_bytes=memory.used_bytes,
            process_bytes=process_bytes,
            pool_pids=pool_pids,
        )

    def _pool_pids(
        self, device: int, rows: Mapping[int, int], workers: frozenset[int]
    ) -> frozenset[int]:
        """The rows' PIDs that are the pool's workers (on any card) or were started under
        one (a task's subprocess): the pool's bytes, never a co-tenant's.

        A row found not to be under any worker is not walked again while it stays in the
        rows (a process is never re-parented under a worker), so the cards' readings every
        0.2 s walk ``/proc`` only for rows that are new."""
        strangers = self.not_pool_pids.setdefault(device, set())
        strangers &= rows.keys()
        ours = set()
        for pid in rows:
            if pid in workers:
                ours.add(pid)
            elif pid == os.getpid() or pid in strangers:
                continue
            elif workers.isdisjoint(read_ancestors(pid)):
                strangers.add(pid)
            else:
                ours.add(pid)
        return frozenset(ours)
