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
from gpupool._core.units import GiB
from gpupool._postmortem import read_postmortem
from gpupool.cli import main
from gpupool.testing import SimulatedDevice, SimulatedHost


def records_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_booked_is_what_was_booked_at_the_time_and_never_above_the_card(
    logs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    pm = read_postmortem(logs["oom_off"])
    assert pm.ooms, "six tasks of 6.3 GiB on a 30 GiB card: at least one runs out"
    price = int(3.15 * GiB)
    for analysis in pm.ooms:
        assert analysis.booked_bytes == (analysis.running or 0) * price
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
