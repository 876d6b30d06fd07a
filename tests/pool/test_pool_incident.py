"""The incident end to end, with real processes on a simulated 44.39 GiB card."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing

import pytest
import tasks

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost, SimulatedOutOfMemory, hold

ENTRIES = 36


def incident_host() -> SimulatedHost:
    return SimulatedHost(
        devices=[SimulatedDevice(total="44.39GiB", co_tenants={"serve": "9.54GiB"})],
        cpus=16,
        host_ram="128GiB",
    )


@pytest.mark.slow
def test_incident_never_widens_past_the_card(tmp_path):
    """36 entries come back, no OOM, width 1 (estimated) then 2 (measured), never 4."""
    log_path = tmp_path / "run.jsonl"
    with incident_host() as host, hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="9.9GiB", log_path=log_path) as ex:
            results = list(ex.map(tasks.entry, range(ENTRIES), [0.15] * ENTRIES))
            decisions = ex.decisions
            stats = ex.statistics()
        events = host.out_of_memory_events
        peak = host.device_peak(0)
    assert results == [i * i for i in range(ENTRIES)]
    assert events == []
    assert peak <= int(44.39 * 2**30)
    constructed = [d for d in decisions if d.event == "constructed"]
    assert len(constructed) == 1
    assert constructed[0].width_after == 1
    assert constructed[0].bound is not None
    assert constructed[0].bound.ask_basis == "estimated"
    widened = [d for d in decisions if d.event == "widened"]
    assert [(d.width_before, d.width_after) for d in widened] == [(1, 2)]
    assert widened[0].bound is not None and widened[0].bound.ask_basis == "measured"
    assert max(width for _, width in stats.widths) == 2
    assert stats.out_of_memory == 0
    assert stats.tasks_completed == ENTRIES
    header, *lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert header["event"] == "run_started"
    decided = [line["event"] for line in lines if line["event"] != "card_read"]
    assert decided[:2] == ["constructed", "widened"]
    assert lines[0]["total_bytes"] == int(44.39 * 2**30)
    assert lines[0]["co_tenant_bytes"] == int(9.54 * 2**30)
    assert all(line["width_after"] != 4 for line in lines)
    # The log's decisions grow with decisions, not with tasks (its samples of the card
    # grow with time: tests/core/test_card_samples.py).
    assert len(decided) < 10


def _stdlib_entry(i: int) -> str:
    try:
        tasks.entry(i, 0.4)
    except SimulatedOutOfMemory:
        return "oom"
    return "ok"


@pytest.mark.slow
def test_stdlib_pool_of_four_runs_the_card_out_of_memory():
    """The control: ProcessPoolExecutor(max_workers=4) on the same card does run out."""
    with incident_host() as host, hold("16.20GiB"):
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(4, mp_context=context) as pool:
            outcomes = list(pool.map(_stdlib_entry, range(8)))
        events = host.out_of_memory_events
    assert "oom" in outcomes
    assert len(events) >= 1
