"""A pool at the serial floor beside a busy pool gets its turn while that pool has work.

Two scripts, each with its own pool, on one simulated 24 GiB card: one runs many small tasks
(3 at a time, 4 GiB each), the other one task that needs 20 GiB, more than the card has
beside any of the small pool's tasks. The small pool yields to it (holds its starts, its
one task of its own included) until it has run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpupool.testing as gt

SCRIPT = str(Path(__file__).with_name("serial_floor_script.py"))
SMALL_TASKS = 60


@pytest.mark.slow
def test_the_big_task_starts_while_the_small_pool_has_tasks_pending(tmp_path: Path) -> None:
    """The 20 GiB task starts while the small pool still has tasks that have not started (it
    counts the small pool's started tasks when it starts); the small pool's log says it
    yielded, naming the waiting pool; every task of both pools ran, none out of memory."""
    with gt.SimulatedHost([gt.SimulatedDevice("24GiB")], cpus=16, host_ram="128GiB") as host:
        scripts = [
            subprocess.Popen([sys.executable, SCRIPT, role, str(tmp_path), str(SMALL_TASKS)])
            for role in ("small", "big")
        ]
        codes = [script.wait(timeout=600) for script in scripts]
        ooms = host.out_of_memory_events
    assert codes == [0, 0]
    assert ooms == []
    small = json.loads((tmp_path / "small.json").read_text())
    big = json.loads((tmp_path / "big.json").read_text())
    assert small["results"] == list(range(SMALL_TASKS))
    started = json.loads((tmp_path / "big-start.json").read_text())["small_started"]
    assert big["results"] == [started]
    assert 1 <= started < SMALL_TASKS, started
    yields = [r for r in small["records"] if r["event"] == "share_wait" and "yield_to_pool" in r]
    assert yields, [r["event"] for r in small["records"]]
    assert all(r["owed_bytes"] == 20 * 2**30 for r in yields)
    assert not [r for r in big["records"] if r["event"] == "serial_start"]
