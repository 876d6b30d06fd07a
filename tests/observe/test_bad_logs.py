"""Bad input to ``gpupool postmortem``: a clear message and an exit status, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from gpupool._commands.cli import EXIT_BAD_LOG, EXIT_EMPTY_LOG, main
from gpupool._core.events import SCHEMA_VERSION
from gpupool._observe.postmortem import read_postmortem


def _run(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["postmortem", str(path)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.err


def test_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty file: exit 4 (EXIT_EMPTY_LOG) and a message saying no records were written."""
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    status, err = _run(path, capsys)
    assert status == EXIT_EMPTY_LOG
    assert re.search(r"empty\.jsonl: empty, no decision records", err)


def test_binary_garbage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Binary bytes: exit 2, line 1, not a decision log."""
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    status, err = _run(path, capsys)
    assert status == EXIT_BAD_LOG
    assert re.search(r"line 1: not JSON; not a gpupool decision log", err)


def test_foreign_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON that is not a decision record: exit 2, naming the line."""
    path = tmp_path / "foreign.jsonl"
    path.write_text('{"level": "info", "msg": "hello"}\n')
    status, err = _run(path, capsys)
    assert status == EXIT_BAD_LOG
    assert re.search(r"line 1: not a gpupool decision record", err)


def test_a_cut_last_line_is_dropped_and_the_records_before_it_read(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log cut in the middle of its last record (a killed pool): exit 0, every earlier
    record read, and one line on stderr naming the file, the line and the bytes dropped."""
    lines = logs["incident"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])
    status = main(["postmortem", "--json", str(path)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "Traceback" not in captured.err
    notes = captured.err.splitlines()
    assert len(notes) == 1, captured.err
    assert re.search(rf"cut\.jsonl, line {len(lines)}: .*dropped its 40 bytes", notes[0])
    (run,) = json.loads(captured.out)["runs"]
    assert run["records"] == len(lines) - 1
    assert run["shutdown"] is None  # the shutdown record was the one cut


def test_a_cut_line_before_the_last_stays_an_error(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record cut short with more lines after it is not a crash's tail: exit 3, line named."""
    lines = logs["incident"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "middle.jsonl"
    path.write_bytes(b"".join(lines[:2]) + lines[2][:40] + b"\n" + b"".join(lines[3:]))
    status, err = _run(path, capsys)
    assert status == EXIT_BAD_LOG
    assert re.search(r"middle\.jsonl, line 3: not JSON", err)


@pytest.mark.parametrize(
    "tail",
    [b'{"schema": 1, "event": "nope"}', b"[1, 2", b"\xff\xfe junk"],
    ids=["complete-but-unknown", "not-an-object", "not-json"],
)
def test_a_bad_last_line_that_is_not_a_cut_record_stays_an_error(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], tail: bytes
) -> None:
    """Only a cut JSON object is dropped: a whole bad record, or text that never was a
    record, at the end of the file is still refused (exit 3), naming the line."""
    lines = logs["incident"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "tail.jsonl"
    path.write_bytes(b"".join(lines) + tail)
    status, err = _run(path, capsys)
    assert status == EXIT_BAD_LOG
    assert f"line {len(lines) + 1}: " in err


def test_newer_schema(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record from a newer schema: exit 3, naming both versions."""
    lines = logs["incident"].read_text().splitlines()
    newer = json.loads(lines[1])
    newer["schema"] = SCHEMA_VERSION + 1
    path = tmp_path / "newer.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(newer), *lines[2:]]) + "\n")
    status, err = _run(path, capsys)
    assert status == EXIT_BAD_LOG
    assert re.search(
        rf"line 2: written with decision-log schema {SCHEMA_VERSION + 1}; this gpupool reads "
        rf"schema {SCHEMA_VERSION} at most",
        err,
    )


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path that does not exist: exit 2 and the reason."""
    status, err = _run(tmp_path / "nope.jsonl", capsys)
    assert status == EXIT_BAD_LOG
    assert "cannot be read" in err


@pytest.mark.slow
def test_100_mb_log_streams_in_bounded_memory(logs: dict[str, Path], tmp_path: Path) -> None:
    """A 100 MB log is read streaming: the traced peak stays far below the file's size."""
    source = [json.loads(line) for line in logs["ask"].read_text().splitlines()]
    body = [r for r in source if r["event"] != "shutdown"]
    path = tmp_path / "big.jsonl"
    size = 0
    time_s = 0.0
    rounds = 0
    with path.open("w") as out:
        while size < 100 * 1024 * 1024:
            chunk = []
            for record in body:
                time_s += 0.001
                chunk.append(json.dumps({**record, "time_s": round(time_s, 6)}))
            text = "\n".join(chunk) + "\n"
            out.write(text)
            size += len(text)
            rounds += 1
    assert path.stat().st_size >= 100 * 1024 * 1024
    tracemalloc.start()
    try:
        pm = read_postmortem(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pm.records == rounds * len(body)
    assert pm.out_of_memory == rounds * sum(1 for r in body if r["event"] == "out_of_memory")
    assert peak < 16 * 1024 * 1024, f"peak {peak} bytes while reading a 100 MB log"


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"schema":1,"event":[]}\n', r"line 1: 'event' holds list"),
        ("[" * 200_000 + "\n", r"line 1: not JSON"),
        ('{"schema":1,"event":"constructed","time_s":' + "9" * 400 + "}\n", r"'time_s' holds int"),
        (
            '{"schema":1,"event":"out_of_memory","device":0,"time_s":[1]}\n',
            r"line 1: 'time_s' holds list",
        ),
    ],
    ids=["event-not-a-string", "deep-nesting", "huge-int", "list-value"],
)
def test_hostile_records_get_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, pattern: str
) -> None:
    """Records built to crash a reader (nesting, huge numbers, wrong types) exit 3, no traceback."""
    path = tmp_path / "hostile.jsonl"
    path.write_text(text)
    status, err = _run(path, capsys)
    assert status == EXIT_BAD_LOG
    assert re.search(pattern, err)


def test_a_wrongly_typed_time_is_read_as_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A scalar of the wrong type (time_s "abc") is read as unknown, not a crash."""
    path = tmp_path / "odd.jsonl"
    path.write_text('{"schema":1,"event":"out_of_memory","device":0,"time_s":"abc"}\n')
    status, _ = _run(path, capsys)
    assert status == 0


@pytest.mark.parametrize("command", ["postmortem", "plot"])
def test_a_fifo_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A FIFO with no writer is refused at once (exit 3): reading it would block forever."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    argv = [command, str(fifo)] + (["-o", str(tmp_path / "out.png")] if command == "plot" else [])
    assert main(argv) == EXIT_BAD_LOG
    err = capsys.readouterr().err
    assert re.search(r"log\.fifo: a FIFO, not a decision log file; to read a stream, pass -", err)
    assert err.count("postmortem") == (command == "postmortem")  # plot's hint names no other


def test_a_device_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A character device (/dev/zero, endless) is refused before any read."""
    assert main(["postmortem", "/dev/zero"]) == EXIT_BAD_LOG
    assert "a device, not a decision log file" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_an_unreadable_regular_file_is_a_clear_error() -> None:
    """/proc/self/mem opens but every read fails (EIO): exit 3 and a message, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "postmortem", "/proc/self/mem"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_BAD_LOG, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(r"/proc/self/mem, line 1: cannot be read", done.stderr)


def test_standard_input_is_read_with_a_dash(logs: dict[str, Path]) -> None:
    """``postmortem -`` reads the log from standard input, as from the file."""
    text = logs["incident"].read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "postmortem", "--json", "-"],
        input=text,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["path"] == "<stdin>"
    assert report["runs"][0]["events"]["constructed"] == 1
