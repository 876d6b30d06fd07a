"""The account after an incident, from real runs on the simulated host: what was booked at
the time, whose bytes the card held, every width move a record, a co-tenant's growth in the
samples, and a task larger than the card named as such."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import observe_tasks
import pytest

from gpupool import DeviceOutOfMemoryError, GpuPoolExecutor
from gpupool._commands.cli import main
from gpupool._core.units import GiB
from gpupool._observe.postmortem import read_postmortem
from gpupool.testing import SimulatedDevice, SimulatedHost, hold
from support import wait_for


def records_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_booked_is_what_was_booked_at_the_time_and_never_above_the_card(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    pm = read_postmortem(logs["oom_off"])
    assert pm.ooms, "six tasks of 6.3 GiB on a 30 GiB card: at least one runs out"
    price = int(3.15 * GiB)
    for analysis in pm.ooms:
        # Each running task was booked at the told price, or (where one had finished and
        # taught the key first, as a loaded machine allows) at the learned ask: what is
        # booked is the sum of what the record says each was booked at, never a guess.
        bookings = [b for _, each in analysis.run_bookings for b in each]
        assert len(bookings) == analysis.running
        assert analysis.booked_bytes == sum(bookings)
        assert all(b >= price for b in bookings)
        assert (analysis.booked_bytes or 0) <= 30 * GiB
        assert analysis.verdict == "ask"
        # The workers' bytes are read from the rows: no co-tenant blamed.
        assert analysis.pool_read and analysis.own_separable
        assert analysis.co_tenant_growth_bytes == 0 and analysis.own_growth_bytes == 0
    assert main(["postmortem", str(logs["oom_off"])]) == 0
    text = capsys.readouterr().out
    assert "co_tenant" not in text
    assert "x observe_tasks.entry_together: " in text  # the runs, per key


def test_each_out_of_memory_is_followed_by_its_width_move_with_retries_off(
    logs: dict[str, Path],
) -> None:
    records = [r for r in records_of(logs["oom_off"]) if r["event"] != "card_read"]
    for index, record in enumerate(records):
        if record["event"] != "out_of_memory":
            continue
        assert record["retry"] is False
        after = records[index + 1]
        width = after["width_after"]
        # The record after it states the card's width at the raised ask: the width times
        # that ask fits the room, or the width is the tasks still running there.
        assert after["event"] in ("narrowed", "bound_changed", "out_of_memory")
        if after["event"] == "narrowed":
            assert width * after["ask_bytes"] <= after["room_bytes"] or width == after["running"]


def test_a_co_tenant_that_grew_mid_run_is_in_the_samples(logs: dict[str, Path]) -> None:
    samples = [r for r in records_of(logs["co_tenant"]) if r["event"] == "card_read"]
    co_tenant = [r["live_co_tenant_bytes"] for r in samples]
    assert min(co_tenant) <= int(9.6 * GiB)  # the serving co-tenant at the census
    assert max(co_tenant) >= int(15.5 * GiB)  # after it grew by 6 GiB
    # The pool's own bytes are not in it.
    assert all(r["live_own_bytes"] is not None for r in samples)


def test_a_task_larger_than_the_card_fails_saying_so(tmp_path: Path) -> None:
    log = tmp_path / "big.jsonl"
    with SimulatedHost([SimulatedDevice("24GiB")], cpus=4, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB", log_path=log) as pool:
            future = pool.submit(observe_tasks.entry, 0, "30GiB")
            with pytest.raises(DeviceOutOfMemoryError) as caught:
                future.result()
            stats = pool.statistics()
    message = str(caught.value)
    assert "more than the 24.00 GiB total of the largest card" in message
    assert "Run it on a larger card" in message
    assert "larger task_peak" not in message
    assert stats.retries == 0
    analysis = read_postmortem(log).ooms[0]
    assert analysis.verdict == "larger_than_card"


def test_in_a_container_the_pools_bytes_are_never_read_as_a_co_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A container's driver lists the co-tenant's row but none of the pool's processes (nor
    the parent's 16.2 GiB): the co-tenant grows by 6 GiB while two tasks are between their
    stages. The account does not
    read the pool's workers as 0 (all of the card a co-tenant's): it derives them from the
    bookings (the failing task at its ask, since its child could not read its own peak
    either) and names the term it lacks."""
    log = tmp_path / "container.jsonl"
    gate = tmp_path / "gate"
    gate.mkdir()
    card = SimulatedDevice("44.39GiB", co_tenants={"serve": "9.54GiB"})
    host = SimulatedHost([card], cpus=16, host_ram="128GiB", container=True)
    with host, hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="6.5GiB", log_path=log) as pool:
            futures = [
                pool.submit(observe_tasks.staged, i, "1GiB", "5GiB", str(gate)) for i in range(4)
            ]
            try:
                wait_for(lambda: len(list(gate.glob("ready-*"))) >= 2, what="two first stages")
                host.grow("serve", "6GiB")
            finally:
                (gate / "go").touch()
            assert sorted(f.result() for f in futures) == [0, 1, 2, 3]
    samples = [r for r in records_of(log) if r["event"] == "card_read" and r["running"]]
    assert samples, "tasks ran: the card was sampled beside them"
    assert all(r["live_pool_bytes"] is None and r["live_co_tenant_bytes"] is None for r in samples)
    pm = read_postmortem(log)
    assert pm.ooms, "two tasks' second stage beside a co-tenant grown by 6 GiB: one runs out"
    for analysis in pm.ooms:
        assert not analysis.pool_read and not analysis.own_separable
        # A lower bound on the growth, never the pool's own bytes named a co-tenant's.
        assert analysis.co_tenant_growth_bytes <= 6 * GiB
    assert main(["postmortem", str(log)]) == 0
    text = capsys.readouterr().out
    assert "read: the card's rows" not in text
    # As on a real card in a container, the child cannot read its own peak (no row, no
    # framework counter): the analysis names the missing term rather than blame anyone.
    assert "the record lacks reached_bytes" in text
