"""Reading a log a crash cut short, or one a pool is still writing: every complete record.

A pool writes one record per ``os.write``, newline included. A file whose last
line has no newline was cut there (the pool was killed mid-write) or is being
written now; either way the records before it are whole, and the readers read
them and say on stderr what they dropped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import observe_tasks
import pytest

from gpupool import GpuPoolExecutor
from gpupool._commands.cli import EXIT_EMPTY_LOG, main
from gpupool._observe.log_reader import CutLine, CutLogWarning, iter_records
from gpupool._observe.postmortem import read_runs
from gpupool.testing import SimulatedDevice, SimulatedHost, hold
from support import wait_for


def _cut(logs: dict[str, Path], tmp_path: Path, keep_bytes: int = 40) -> tuple[Path, int]:
    """The incident's log with its last record cut after ``keep_bytes``; and its line count."""
    lines = logs["incident"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:keep_bytes])
    return path, len(lines)


def _postmortem_in_a_child(path: Path) -> subprocess.CompletedProcess[str]:
    """``gpupool postmortem --json`` in a process of its own, as a user would run it."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "gpupool", "postmortem", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_the_library_reports_the_cut_line_to_its_callback(
    logs: dict[str, Path], tmp_path: Path
) -> None:
    """``read_runs(on_cut=...)`` reads every whole record and hands over the line it dropped."""
    path, count = _cut(logs, tmp_path)
    cuts: list[CutLine] = []
    (run,) = read_runs(path, on_cut=cuts.append)
    assert run.records == count - 1
    assert [(c.path, c.line, c.dropped_bytes) for c in cuts] == [(str(path), count, 40)]
    assert re.fullmatch(rf".*cut\.jsonl, line {count}: .*dropped its 40 bytes.*", str(cuts[0]))


def test_without_a_callback_the_cut_is_a_warning(logs: dict[str, Path], tmp_path: Path) -> None:
    """Called without ``on_cut``, the readers warn (CutLogWarning) rather than drop in silence."""
    path, count = _cut(logs, tmp_path)
    with pytest.warns(CutLogWarning, match=rf"line {count}: .*dropped its 40 bytes"):
        numbers = [number for number, _ in iter_records(path)]
    assert numbers == list(range(1, count))


def test_plot_draws_a_cut_log(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpupool plot`` draws the records before the cut line and names it on stderr."""
    pytest.importorskip("matplotlib")
    path, count = _cut(logs, tmp_path)
    out = tmp_path / "cut.svg"
    assert main(["plot", str(path), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"gpupool plot: .*cut\.jsonl, line {count}: .*dropped its 40 bytes.*\n", err
    )
    assert out.read_bytes().lstrip().startswith(b"<?xml")


def test_a_log_of_one_cut_line_is_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool killed during its first write leaves no whole record: exit 4, and the note."""
    path = tmp_path / "first.jsonl"
    path.write_bytes(b'{"schema": 3, "event": "run_sta')
    assert main(["postmortem", str(path)]) == EXIT_EMPTY_LOG
    err = capsys.readouterr().err
    assert re.search(r"first\.jsonl, line 1: .*dropped its 31 bytes", err)
    assert "empty, no decision records" in err


def test_a_reader_during_a_write_reads_the_whole_records_then_the_finished_one(
    logs: dict[str, Path], tmp_path: Path
) -> None:
    """A writer the test controls appends half a record: a reader in another process reads
    every whole record before it (exit 0); once the writer ends the line, a reader reads it."""
    lines = logs["incident"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "live.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"".join(lines[:-1]))
        half = len(lines[-1]) // 2
        os.write(fd, lines[-1][:half])

        during = _postmortem_in_a_child(path)
        assert during.returncode == 0, during.stderr
        (run,) = json.loads(during.stdout)["runs"]
        assert run["records"] == len(lines) - 1
        assert re.search(rf"line {len(lines)}: .*dropped its {half} bytes", during.stderr)

        os.write(fd, lines[-1][half:])
    finally:
        os.close(fd)
    after = _postmortem_in_a_child(path)
    assert after.returncode == 0, after.stderr
    assert after.stderr == ""
    (run,) = json.loads(after.stdout)["runs"]
    assert run["records"] == len(lines)
    assert run["shutdown"] is not None


def test_a_log_a_live_pool_is_writing_reads_in_another_process(tmp_path: Path) -> None:
    """While a real pool holds its log open (tasks waiting on a gate), ``gpupool postmortem``
    in another process reads the records written so far: no shutdown yet, exit 0."""
    log = tmp_path / "live.jsonl"
    gate = tmp_path / "gate"
    gate.mkdir()
    card = SimulatedDevice("44.39GiB", co_tenants={"serve": "9.54GiB"})
    with SimulatedHost([card], cpus=16, host_ram="128GiB"), hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="6.5GiB", log_path=log) as pool:
            futures = [
                pool.submit(observe_tasks.staged, i, "1GiB", "1GiB", str(gate)) for i in range(2)
            ]
            try:
                wait_for(lambda: any(gate.glob("ready-*")), what="a task in its first stage")
                during = _postmortem_in_a_child(log)
            finally:
                (gate / "go").touch()
            assert [f.result() for f in futures] == [0, 1]
    assert during.returncode == 0, during.stderr
    (run,) = json.loads(during.stdout)["runs"]
    assert run["events"]["constructed"] == 1
    assert run["shutdown"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (finished,) = read_runs(log)
    assert finished.shutdown is not None
    assert finished.records > run["records"]


def test_a_run_appended_after_a_cut_run_reads_both(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pool killed mid-write leaves its last record cut; the next run of the script
    appends to the same file, so its first record follows the cut bytes on the same line.
    Both runs are read: the first up to its cut record, which is named, then the second."""
    path, count = _cut(logs, tmp_path)
    with SimulatedHost([SimulatedDevice("24GiB")], cpus=4, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="2GiB", log_path=path) as pool:
            assert list(pool.map(observe_tasks.entry, range(2), ["1GiB"] * 2)) == [0, 1]
    cuts: list[CutLine] = []
    first, second = read_runs(path, on_cut=cuts.append)
    assert first.records == count - 1
    assert second.events["run_started"] == 1 and second.shutdown is not None
    assert [(c.line, c.dropped_bytes) for c in cuts] == [(count, 40)]
    assert "a later record was appended after it" in str(cuts[0])
    assert main(["postmortem", str(path)]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"line {count}: .*dropped its 40 bytes", err)
