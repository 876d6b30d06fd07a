"""What the suite repeats: census builders, the incident's figures, and a bounded wait.

Importable from every test folder as ``support`` (``tests/conftest.py`` puts
this folder's parent on ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking
from gpupool._core.census import CardCensus, Census, HostCensus
from gpupool._core.planner import Start
from gpupool._core.units import parse_size

if TYPE_CHECKING:
    from gpupool._core.planner import Planner

__all__ = [
    "INCIDENT_CO_TENANT_BYTES",
    "INCIDENT_ESTIMATE_BYTES",
    "INCIDENT_MEASURED_PEAK_BYTES",
    "INCIDENT_OWN_HIGH_WATER_BYTES",
    "INCIDENT_TOTAL_BYTES",
    "card_census",
    "census_of",
    "run_script",
    "wait_for",
]

#: The incident that defines the bound: a 44.39 GiB card, a 9.54 GiB serving
#: parent resident, this process's pipeline at 16.20 GiB, a 9.90 GiB estimate
#: per entry and a measured child peak of 6.02 GiB.
INCIDENT_TOTAL_BYTES = parse_size("44.39GiB")
INCIDENT_CO_TENANT_BYTES = parse_size("9.54GiB")
INCIDENT_OWN_HIGH_WATER_BYTES = parse_size("16.20GiB")
INCIDENT_ESTIMATE_BYTES = parse_size("9.90GiB")
INCIDENT_MEASURED_PEAK_BYTES = 6_461_325_312


def card_census(
    *,
    device: int = 0,
    total_bytes: int | None,
    free_bytes: int | None,
    own_bytes: int | None = 0,
    unified: bool = False,
    reason: str | None = None,
) -> CardCensus:
    """A census row with only the terms the bound reads."""
    return CardCensus(
        device=device,
        uuid=f"GPU-{device:08x}-0000-0000-0000-000000000000",
        name="test card",
        total_bytes=total_bytes,
        free_bytes=free_bytes,
        own_bytes=own_bytes,
        unified=unified,
        source="given",
        reason=reason,
    )


def census_of(
    cards: Sequence[CardCensus], *, cpus: int = 8, available_ram_bytes: int | None = None
) -> Census:
    """A whole census of ``cards`` on a host with ``cpus`` and ``available_ram_bytes``."""
    return Census(
        cards=tuple(cards),
        host=HostCensus(cpus=cpus, available_ram_bytes=available_ram_bytes),
        driver=True,
        sensor="given",
    )


def other_pools(planner: Planner, pid: int, card_uuid: str) -> OtherPools:
    """What another pool reading the booking table sees of ``planner`` (a pool whose
    process is ``pid``) on the card ``card_uuid``: its running tasks and what it waits for."""
    row = PoolBooking(
        pool_id=f"{pid}.1",
        pid=pid,
        start="s",
        label=f"pool{pid}",
        updated_s=0.0,
        tasks=tuple(
            TaskBooking(
                worker_pid=r.pid or 0, key=r.key, booked_bytes=r.booked_bytes, reached_bytes=0
            )
            for r in planner.state.running.values()
        ),
        waiting=planner.neighbours.waiting_count(),
        need_bytes=planner.neighbours.need_bytes(),
    )
    return OtherPools(card_uuid=card_uuid, pools=(row,))


def answered_in_a_fork(answer: Callable[[], bytes]) -> tuple[int, bytes]:
    """Run ``answer`` in a child made with ``os.fork``; the child's PID and what it answered
    (at most 64 bytes). The child leaves with ``os._exit`` whatever ``answer`` does."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write_end, answer())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        answered = os.read(read_end, 64)
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    return child, answered


def wait_for(condition: Callable[[], bool], *, timeout_s: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; fail the test with ``what`` after ``timeout_s``.

    A bounded wait for an event another process causes, never a stand-in for
    synchronisation the test could do itself.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or condition}")
        time.sleep(0.01)


def run_script(
    directory: Path, name: str, text: str, *args: str, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """Write ``text`` to ``directory / name`` and run it as ``__main__`` in a Python of its own
    (no simulator inherited from the test's environment; its temporary files in
    ``directory``), returning what it printed and its exit status."""
    script = directory / name
    script.write_text(text)
    env = dict(os.environ)
    env.pop("GPUPOOL_SIMULATOR", None)
    env["TMPDIR"] = str(directory)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=directory,
    )


def start_all(planner: Planner, now_s: float, pid_base: int = 100) -> list[Start]:
    """Start every task ``planner`` admits now, each on a worker of PID ``pid_base + task``;
    the starts, in order."""
    started = []
    while isinstance(verdict := planner.next_start(now_s), Start):
        planner.started(verdict.task, verdict.device, pid_base + verdict.task, now_s)
        started.append(verdict)
    return started
