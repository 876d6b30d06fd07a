"""Bad input to ``gpupool postmortem``: a clear message and an exit status, never a traceback."""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import pytest

from gpupool._postmortem import read_postmortem
from gpupool.cli import main


def _run(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["postmortem", str(path)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.err


def test_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty file: exit 1 and a message saying no records were written."""
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    status, err = _run(path, capsys)
    assert status == 1
    assert re.search(r"empty\.jsonl: empty, no decision records", err)


def test_binary_garbage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Binary bytes: exit 2, line 1, not a decision log."""
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    status, err = _run(path, capsys)
    assert status == 2
    assert re.search(r"line 1: not JSON; not a gpupool decision log", err)


def test_foreign_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON that is not a decision record: exit 2, naming the line."""
    path = tmp_path / "foreign.jsonl"
    path.write_text('{"level": "info", "msg": "hello"}\n')
    status, err = _run(path, capsys)
    assert status == 2
    assert re.search(r"line 1: not a gpupool decision record", err)


def test_truncated_last_line(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log cut in the middle of its last record: exit 2, that line named as truncated."""
    lines = logs["incident"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])
    status, err = _run(path, capsys)
    assert status == 2
    assert re.search(rf"line {len(lines)}: truncated", err)


def test_newer_schema(
    logs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record from schema 2: exit 2, naming both versions."""
    lines = logs["incident"].read_text().splitlines()
    newer = json.loads(lines[1])
    newer["schema"] = 2
    path = tmp_path / "newer.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(newer), *lines[2:]]) + "\n")
    status, err = _run(path, capsys)
    assert status == 2
    assert re.search(
        r"line 2: written with decision-log schema 2; this gpupool reads schema 1", err
    )


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path that does not exist: exit 2 and the reason."""
    status, err = _run(tmp_path / "nope.jsonl", capsys)
    assert status == 2
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
    """Records built to crash a reader (nesting, huge numbers, wrong types) exit 2, no traceback."""
    path = tmp_path / "hostile.jsonl"
    path.write_text(text)
    status, err = _run(path, capsys)
    assert status == 2
    assert re.search(pattern, err)


def test_a_wrongly_typed_time_is_read_as_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A scalar of the wrong type (time_s "abc") is read as unknown, not a crash."""
    path = tmp_path / "odd.jsonl"
    path.write_text('{"schema":1,"event":"out_of_memory","device":0,"time_s":"abc"}\n')
    status, _ = _run(path, capsys)
    assert status == 0
