"""Every record about one task names it: its ``map`` entry and its label (real processes).

Measured before: a 40-entry pipeline with one out-of-memory (entry 25) gave records that named
the task's key and its worker's PID only; the postmortem said what and why, but not which
entry.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import observe_tasks
import pytest

from gpupool import ConfigurationError, DeviceOutOfMemoryError, GpuPoolExecutor, WorkerLostError
from gpupool._commands.cli import main
from gpupool._observe.log_reader import iter_records
from gpupool.testing import SimulatedDevice, SimulatedHost


def _drain(results: Iterator[int], into: list[int]) -> None:
    """Put each of ``results`` in ``into``, until one raises."""
    for value in results:
        into.append(value)


def _records(log: Path, event: str) -> list[dict[str, Any]]:
    return [r for _, r in iter_records(log) if r["event"] == event]


@pytest.fixture(scope="module")
def pipeline_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 40-entry map whose entry 25 runs the card out of memory (map raises there, as the
    standard pool's does), then a labelled task that does too, then a 6-entry map whose entry
    4 kills its worker, then a map in chunks of 4 whose entry 9 runs out."""
    log = tmp_path_factory.mktemp("identity") / "pipeline.jsonl"
    host = SimulatedHost([SimulatedDevice("8GiB")], cpus=4, host_ram="32GiB")
    with host, GpuPoolExecutor(max_workers=2, task_peak="1GiB", log_path=log) as ex:
        mapped = ex.options(label="pipeline").map(observe_tasks.entry_or_oom, range(40), [25] * 40)
        done: list[int] = []
        with pytest.raises(DeviceOutOfMemoryError):
            _drain(mapped, done)
        assert done == list(range(25))
        labelled = ex.options(label="resnet-ckpt-7").submit(observe_tasks.entry_or_oom, 7, 7)
        # The future's error names the task too.
        with pytest.raises(DeviceOutOfMemoryError, match=r"entry_or_oom \(label 'resnet-ckpt-7'\)"):
            labelled.result(timeout=120)
        seen: list[int] = []
        with pytest.raises(WorkerLostError, match=r"entry_or_die \(entry 4\) "):
            _drain(ex.map(observe_tasks.entry_or_die, range(6), [4] * 6), seen)
        assert seen == [0, 1, 2, 3]
        chunked = ex.options(label="chunks").map(
            observe_tasks.entry_or_oom, range(12), [9] * 12, chunksize=4
        )
        with pytest.raises(DeviceOutOfMemoryError):
            list(chunked)
    return log


def test_every_out_of_memory_record_names_its_entry_and_label(pipeline_log: Path) -> None:
    """The out-of-memory records (the retries' included) name entry 25 of the map with its
    label, or the labelled task submitted alone."""
    ooms = _records(pipeline_log, "out_of_memory")
    named = {(r.get("task_entry"), r.get("task_entries"), r.get("task_label")) for r in ooms}
    assert named == {(25, None, "pipeline"), (None, None, "resnet-ckpt-7"), (8, 4, "chunks")}
    assert all(isinstance(r["task_id"], int) for r in ooms)


def test_the_lost_worker_record_names_its_entry(pipeline_log: Path) -> None:
    """The record of the worker that died names the entry it ran (4), with no label."""
    lost = _records(pipeline_log, "worker_lost")
    assert [(r.get("task_entry"), r.get("task_label")) for r in lost] == [(4, None)]


def test_a_measured_record_names_the_task_it_states(pipeline_log: Path) -> None:
    """A key's first measurement names the task whose peak it states."""
    measured = _records(pipeline_log, "measured")
    assert measured
    assert all(isinstance(r.get("task_id"), int) for r in measured)


def test_postmortem_names_the_entry_and_label(
    pipeline_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpupool postmortem`` says which entry ran out ("entry 25, label 'pipeline'"), which
    task was labelled, and which entry's worker was lost; ``--json`` carries the same."""
    assert main(["postmortem", str(pipeline_log)]) == 0
    text = capsys.readouterr().out
    assert "(entry 25, label 'pipeline')" in text
    assert "(label 'resnet-ckpt-7')" in text
    assert "(entries 8-11, label 'chunks')" in text
    assert "worker_lost" in text and "entry 4" in text
    assert main(["postmortem", "--json", str(pipeline_log)]) == 0
    report = json.loads(capsys.readouterr().out)["runs"][0]
    assert {oom["task"] for oom in report["ooms"]} >= {"entry 25, label 'pipeline'"}
    assert [t["task"] for t in report["tasks"]] == ["entry 4"]


def test_plot_names_the_task_of_each_out_of_memory(pipeline_log: Path, tmp_path: Path) -> None:
    """``gpupool plot`` names the task of each out-of-memory in its hover text."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.svg"
    assert main(["plot", str(pipeline_log), "-o", str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    assert "entry 25, label" in svg and "pipeline" in svg


@pytest.mark.parametrize(
    ("label", "pattern"),
    [
        (7, r"^label=7: a task's label is a str"),
        ("", r"^label='' has 0 characters: a task's label has 1 to 200"),
        ("x" * 201, r"has 201 characters: a task's label has 1 to 200"),
        ("two\nlines", r"holds a control character"),
    ],
    ids=["int", "empty", "long", "newline"],
)
def test_a_bad_label_is_refused(label: object, pattern: str) -> None:
    """A label that is not a short one-line str is refused by ``options()``, naming the fix;
    nothing is submitted."""
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
            with pytest.raises(ConfigurationError, match=pattern):
                ex.options(label=label)  # type: ignore[arg-type]
            assert ex.statistics().tasks_submitted == 0
