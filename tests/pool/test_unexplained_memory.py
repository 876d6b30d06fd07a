"""Memory that no row explains: a warning record and a postmortem line when the card's used
bytes less every process's row rise while the pool's tasks run (real workers, a simulated
card with memory that no row lists)."""

from __future__ import annotations

import pytest
import tree_tasks

from gpupool import GpuPoolExecutor
from gpupool._core.units import GiB
from gpupool._observe.postmortem import format_postmortem, read_postmortem
from gpupool.testing import SimulatedDevice, SimulatedHost
from support import wait_for

pytestmark = pytest.mark.slow


def test_memory_no_row_explains_is_named(tmp_path):
    """Two tasks hold 2 GiB each; meanwhile 3 GiB appear on the card in no row (managed
    memory, a process the driver does not list): an unexplained_memory warning names the
    rise, and the postmortem says it; a card whose rows explain it all warns of nothing."""
    log = tmp_path / "log.jsonl"
    gate = tmp_path / "gate"
    gate.mkdir()
    with SimulatedHost([SimulatedDevice("24GiB")], cpus=4, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=2, task_peak="3GiB", log_path=log) as ex:
            futures = [
                ex.submit(tree_tasks.hold_until_released, "2GiB", str(gate)) for _ in range(2)
            ]
            try:
                wait_for(lambda: len(list(gate.glob("ready-*"))) == 2, what="two tasks hold")
                host.grow("listed", "1GiB")  # a co-tenant in the rows: explained
                host.grow("managed", "3GiB", listed=False)
                wait_for(
                    lambda: any(d.event == "unexplained_memory" for d in ex.decisions),
                    what="the warning",
                )
            finally:
                (gate / "go").touch()
            assert [f.result(timeout=60) for f in futures] == [0, 0]
            warnings = [d.to_dict() for d in ex.decisions if d.event == "unexplained_memory"]
    assert len(warnings) == 1
    assert warnings[0]["unexplained_rise_bytes"] == 3 * GiB
    text = "\n".join(format_postmortem(read_postmortem(log)))
    assert "memory no row explains: rose by up to 3.00 GiB while tasks ran (1 warning" in text


def test_rows_that_explain_the_card_warn_of_nothing(tmp_path):
    """The same tasks beside a co-tenant that grows by 3 GiB in its own row: no warning."""
    log = tmp_path / "log.jsonl"
    gate = tmp_path / "gate"
    gate.mkdir()
    with SimulatedHost([SimulatedDevice("24GiB")], cpus=4, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=2, task_peak="3GiB", log_path=log) as ex:
            futures = [
                ex.submit(tree_tasks.hold_until_released, "2GiB", str(gate)) for _ in range(2)
            ]
            try:
                wait_for(lambda: len(list(gate.glob("ready-*"))) == 2, what="two tasks hold")
                host.grow("server", "3GiB")
            finally:
                (gate / "go").touch()
            assert [f.result(timeout=60) for f in futures] == [0, 0]
            events = {d.event for d in ex.decisions}
    assert "unexplained_memory" not in events
    assert "memory no row explains" not in "\n".join(format_postmortem(read_postmortem(log)))
