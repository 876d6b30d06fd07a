"""Decision logs from real runs on the simulated host, shared by the observe tests."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import observe_tasks
import pytest

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost, hold

#: The incident's card: 44.39 GiB beside a 9.54 GiB serving co-tenant.
CARD = {"total": "44.39GiB", "co_tenants": {"serve": "9.54GiB"}}


def incident_host() -> SimulatedHost:
    """The incident's host: one card, 16 CPUs, 128 GiB of RAM."""
    card = SimulatedDevice(CARD["total"], co_tenants=CARD["co_tenants"])  # type: ignore[arg-type]
    return SimulatedHost([card], cpus=16, host_ram="128GiB")


def two_cards_host() -> SimulatedHost:
    """Two cards of their own sizes: 24 GiB beside a 4 GiB co-tenant (room for 3 tasks at
    5 GiB), and 12 GiB (room for 2); the pool-wide ceiling (max_workers=8) is above both."""
    cards = [SimulatedDevice("24GiB", co_tenants={"other": "4GiB"}), SimulatedDevice("12GiB")]
    return SimulatedHost(cards, cpus=16, host_ram="128GiB")


def _sampled_running(log: Path, running: int) -> bool:
    """Whether the decision log holds a ``card_read`` sample with ``running`` tasks on the card."""
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if record.get("event") == "card_read" and record.get("running") == running:
            return True
    return False


def _staged_run(
    log: Path, change: Callable[[SimulatedHost], AbstractContextManager[object]]
) -> int:
    """Two-stage tasks; once two are in their first stage, ``change`` the card, then let them go."""
    gate = log.parent / (log.name + ".gate")
    gate.mkdir()
    with incident_host() as host, hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="6.5GiB", log_path=log) as pool:
            futures = [
                pool.submit(observe_tasks.staged, i, "1GiB", "5GiB", str(gate)) for i in range(6)
            ]
            deadline = time.monotonic() + 30
            # Both in their first stage, and the pool's log has sampled the card with both
            # running (a reading every 0.2 s while tasks run): the account draws them.
            while (
                len(list(gate.glob("ready-*"))) < 2 or not _sampled_running(log, 2)
            ) and time.monotonic() < deadline:
                time.sleep(0.01)
            with change(host):
                (gate / "go").touch()
                for future in futures:
                    future.result()
                pool.shutdown()
        return len(host.out_of_memory_events)


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real decision logs: an underestimated ask, a growing co-tenant, a growing parent, two
    cards, the incident."""
    root = tmp_path_factory.mktemp("logs")
    out: dict[str, Path] = {}

    ask = root / "ask.jsonl"
    ask_gate = root / "ask.gate"
    ask_gate.mkdir()
    with incident_host(), hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="2GiB", log_path=ask) as pool:
            # The first four start together, all booked at 2 GiB: 4 x 6.02 GiB overflows.
            list(pool.map(observe_tasks.entry_together, range(12), [str(ask_gate)] * 12, [4] * 12))
    out["ask"] = ask

    def grow_co_tenant(host: SimulatedHost) -> AbstractContextManager[object]:
        host.grow("serve", "6GiB")
        return nullcontext()

    co_tenant = root / "co_tenant.jsonl"
    _staged_run(co_tenant, grow_co_tenant)
    out["co_tenant"] = co_tenant

    own = root / "own.jsonl"
    _staged_run(own, lambda host: hold("6GiB"))
    out["own"] = own

    # The 30 GiB card, retries off: six tasks priced 3.15 GiB start together, each holds
    # 6.3 GiB, so the card runs out and the tasks that ran out fail.
    oom_off = root / "oom_off.jsonl"
    oom_gate = root / "oom_off.gate"
    oom_gate.mkdir()
    with SimulatedHost([SimulatedDevice("30GiB")], cpus=16, host_ram="128GiB"):
        with GpuPoolExecutor(
            max_workers=6, task_peak="3.15GiB", retry_oom=False, log_path=oom_off
        ) as pool:
            futures = [
                pool.submit(observe_tasks.entry_together, i, str(oom_gate), 6, "6.3GiB")
                for i in range(12)
            ]
            concurrent.futures.wait(futures)
    out["oom_off"] = oom_off

    two_cards = root / "two_cards.jsonl"
    with (
        two_cards_host(),
        GpuPoolExecutor(max_workers=8, task_peak="5GiB", log_path=two_cards) as pool,
    ):
        list(pool.map(observe_tasks.entry, range(12), ["4GiB"] * 12))
    out["two_cards"] = two_cards

    incident = root / "incident.jsonl"
    with incident_host(), hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="9.9GiB", log_path=incident) as pool:
            list(pool.map(observe_tasks.entry, range(8)))
    out["incident"] = incident
    return out
