"""Where the driver hides the rows (a container, rows of 0, MIG), a task's peak that could not
read its descendants' bytes is flagged incomplete and never lowers its key's ask: real spawned
processes on a simulated card as strict as such a card."""

from __future__ import annotations

import json

import pytest
import tree_tasks

import standin_torch
from gpupool import GpuPoolExecutor
from gpupool._core.units import GiB, MiB
from gpupool._observe.postmortem import format_postmortem, read_postmortem
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = pytest.mark.slow

KEY = "tree_tasks.torch_and_a_subprocess"


def _records(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("rows", ["hidden", "zero", "unavailable", "mig"])
def test_a_child_whose_rows_are_hidden_flags_the_peak_and_keeps_the_ask(tmp_path, rows):
    """A worker whose torch holds 768 MiB and whose child holds 5 GiB, rows hidden: the
    peak (torch plus the estimated context) is flagged incomplete in the record, with the
    card's used bytes as its upper bound, and the key's ask stays at task_peak (7 GiB)
    instead of falling to about 1.4 GiB."""
    log = tmp_path / "log.jsonl"
    mig = rows == "mig"  # a MIG instance lists rows without a figure, whatever the host's mode
    host = SimulatedHost(
        [SimulatedDevice("24GiB", mig=mig)], context="500MiB", rows="listed" if mig else rows
    )
    with host:
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="7GiB",
            reserve=0,
            log_path=log,
            initializer=standin_torch.install_in_worker,
            initargs=(24 * GiB, True),
        ) as ex:
            for _ in range(2):
                assert (
                    ex.submit(tree_tasks.torch_and_a_subprocess, 768 * MiB, "5GiB").result(
                        timeout=60
                    )
                    == 0
                )
    measured = [r for r in _records(log) if r.get("key") == KEY and "peak_bytes" in r]
    assert measured, "the partial view is recorded once"
    record = measured[-1]
    assert record["key_ask_bytes"] >= 7 * GiB, record["reason"]
    assert record["peak_incomplete"] is True
    assert record["peak_bytes"] < 2 * GiB  # what the worker alone could say
    assert "could not tell their device bytes" in record["incomplete_reason"]
    # The card's used bytes are kept beside it, at least what the worker itself held.
    assert record["card_used_peak_bytes"] >= record["peak_bytes"] - 640 * MiB
    assert "partial view" in record["reason"]
    postmortem = "\n".join(format_postmortem(read_postmortem(log)))
    assert f"  {KEY}: 1 process(es) ran under the worker" in postmortem


def test_a_child_whose_rows_are_listed_is_measured_whole(tmp_path):
    """The same task on a card that lists the rows (bare metal) is measured whole: its peak
    counts the child's 5 GiB and is not flagged."""
    log = tmp_path / "log.jsonl"
    with SimulatedHost([SimulatedDevice("24GiB")], context="500MiB"):
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="7GiB",
            reserve=0,
            log_path=log,
            initializer=standin_torch.install_in_worker,
            initargs=(24 * GiB, True),
        ) as ex:
            assert (
                ex.submit(tree_tasks.torch_and_a_subprocess, 768 * MiB, "5GiB").result(timeout=60)
                == 0
            )
    measured = [r for r in _records(log) if r.get("key") == KEY and "peak_bytes" in r]
    assert measured and measured[0]["peak_incomplete"] is False
    assert measured[0]["peak_bytes"] >= 5 * GiB + 768 * MiB
