"""The decision log is this user's file: never another's, never one others can write, and a
file deleted or replaced during the run is noticed (counted, warned, and the log goes on in a
new file)."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import observe_tasks
import pytest

from gpupool import ConfigurationError, GpuPoolExecutor
from gpupool._core.events import Decision
from gpupool._observe.log import DecisionLog, check_log_path
from gpupool.testing import SimulatedDevice, SimulatedHost

#: A line another user could add to a file they can write.
FORGED = {"event": "out_of_memory", "time_s": 1.0, "device": 0, "run_id": "forged"}


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``predicate`` (a file the tasks write) until true or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _decision(i: int) -> Decision:
    return Decision(
        event="measured", time_s=float(i), device=None, width_before=1, width_after=1, reason="r"
    )


def _host() -> SimulatedHost:
    return SimulatedHost([SimulatedDevice("16GiB")], cpus=4, host_ram="64GiB")


def test_a_file_others_can_write_is_refused(tmp_path: Path) -> None:
    """An existing 0666 file (anyone could add a forged record) is refused, untouched."""
    path = tmp_path / "shared.jsonl"
    path.write_text(json.dumps(FORGED) + "\n")
    path.chmod(0o666)
    with _host():
        with pytest.raises(ConfigurationError) as info:
            GpuPoolExecutor(max_workers=1, task_peak="1GiB", log_path=path)
    message = str(info.value)
    assert f"log_path={str(path)!r}" in message
    assert "mode 0666" in message
    assert f"chmod go-w {path}" in message
    assert path.read_text() == json.dumps(FORGED) + "\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_file_is_refused(tmp_path: Path) -> None:
    """An existing file another user owns (they read the log, they can forge records) is refused."""
    path = tmp_path / "theirs.jsonl"
    path.write_text("")
    path.chmod(0o644)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigurationError) as info:
        check_log_path(path)
    message = str(info.value)
    assert f"log_path={str(path)!r} is owned by uid 65534" in message
    assert f"not by this process's user (uid {os.geteuid()}" in message
    assert "Pass a path of your own" in message
    assert path.read_text() == ""


def test_an_own_file_not_writable_by_others_is_appended_to(tmp_path: Path) -> None:
    """The check refuses only what it must: this user's 0644 file is appended to."""
    path = tmp_path / "mine.jsonl"
    path.write_text("")
    path.chmod(0o644)
    log = DecisionLog(check_log_path(path))
    log.close()
    assert json.loads(path.read_text().splitlines()[0])["event"] == "run_started"


def test_a_log_deleted_during_the_run_is_counted_and_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The file deleted while a task runs: the pool says so once and counts the lost records."""
    path = tmp_path / "run.jsonl"
    gate = tmp_path / "gate"
    gate.mkdir()
    caplog.set_level(logging.WARNING, logger="gpupool")
    with _host():
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB", log_path=path) as pool:
            futures = [
                pool.submit(observe_tasks.staged, i, "1GiB", "1GiB", str(gate)) for i in range(2)
            ]
            assert wait_until(lambda: len(list(gate.glob("ready-*"))) == 2, 60)
            path.unlink()
            (gate / "go").touch()
            assert [f.result(timeout=60) for f in futures] == [0, 1]
        statistics = pool.statistics()
    assert statistics.log_write_errors >= 1
    said = [r.getMessage() for r in caplog.records if "was deleted" in r.getMessage()]
    assert len(said) == 1, said
    assert str(path) in said[0]


def test_a_deleted_log_is_reopened_as_a_new_file(tmp_path: Path) -> None:
    """Deleted between two records: the next write starts a new 0600 file at the path, opened by
    the run's header, and the record that went to the deleted file is counted."""
    path = tmp_path / "run.jsonl"
    log = DecisionLog(check_log_path(path), check_every_s=0.0)
    log.append(_decision(1))
    path.unlink()
    with pytest.warns(RuntimeWarning, match=r"was deleted during the run"):
        log.append(_decision(2))
    log.append(_decision(3))
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["run_started", "measured", "measured"]
    assert [r["time_s"] for r in records[1:]] == [2.0, 3.0]
    assert {r["run_id"] for r in records} == {log.run_id}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert log.write_errors == 2  # the header and record 1 were in the deleted file


def test_a_log_replaced_by_a_file_others_can_write_is_not_followed(tmp_path: Path) -> None:
    """Replaced mid-run by a 0666 file: nothing is written there; records are counted."""
    path = tmp_path / "run.jsonl"
    log = DecisionLog(check_log_path(path), check_every_s=0.0)
    path.unlink()
    path.write_text("")
    path.chmod(0o666)
    with pytest.warns(RuntimeWarning, match=r"mode 0666"):
        log.append(_decision(1))
    log.append(_decision(2))
    log.close()
    assert path.read_text() == ""
    assert log.write_errors == 3  # the header, lost with the deleted file, and both records
    assert len(log.records()) == 2


def test_a_directory_swapped_above_the_log_does_not_redirect_it(tmp_path: Path) -> None:
    """The log's directory is renamed and a link to another directory put in its place (as
    anyone who can write the directory above could): no record goes to the other directory,
    every one goes on to the file the run opened (before: the log was "replaced", and a new
    one was created in the linked directory)."""
    above = tmp_path / "open-to-all"
    above.mkdir()
    above.chmod(0o777)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (above / "mine").mkdir()
    path = above / "mine" / "run.jsonl"
    log = DecisionLog(check_log_path(path), check_every_s=0.0)
    log.append(_decision(1))
    (above / "mine").rename(above / "moved")
    (above / "mine").symlink_to(elsewhere, target_is_directory=True)
    log.append(_decision(2))
    log.close()
    assert list(elsewhere.iterdir()) == []
    records = [
        json.loads(line) for line in (above / "moved" / "run.jsonl").read_text().splitlines()
    ]
    assert [r.get("time_s") for r in records[1:]] == [1.0, 2.0]
    assert log.write_errors == 0


def test_a_hard_link_to_another_file_is_refused(tmp_path: Path) -> None:
    """An existing log file with a second name (a hard link to another file of this user's, or
    where protected_hardlinks is off, to anyone's) is refused, untouched (before: appended to,
    which wrote the records into the other file)."""
    other = tmp_path / "other.txt"
    other.write_text("not a log\n")
    other.chmod(0o600)
    path = tmp_path / "run.jsonl"
    os.link(other, path)
    with pytest.raises(ConfigurationError) as info:
        check_log_path(path)
    message = str(info.value)
    assert f"log_path={str(path)!r} has 2 links" in message
    assert "a path of its own" in message
    assert other.read_text() == "not a log\n"
