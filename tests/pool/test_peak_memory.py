"""A pool that remembers: each key's measured peak per card model, kept between runs in a file
of the user's (bounded, validated), dropped where a new measurement contradicts it."""

from __future__ import annotations

import json
from pathlib import Path

import predict_tasks
import pytest

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._pool.memory import (
    MAX_FILE_BYTES,
    PeakMemory,
    code_digest,
    forget_peaks,
    memory_path,
)

GiB = 1024**3
SPEC = "{:020d}".format


def run_pipeline(hold_bytes: int, count: int = 6) -> list[str]:
    """One run of a pipeline of ``count`` tasks holding ``hold_bytes`` each, estimated at
    9.5 GiB, on a 32 GiB card; returns its records' reasons."""
    with gt.SimulatedHost([gt.SimulatedDevice("32GiB")], cpus=8, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=6, task_peak="9.5GiB") as ex:
            futures = [
                ex.submit(predict_tasks.hold_spec, i, SPEC(hold_bytes)) for i in range(count)
            ]
            assert [f.result(timeout=120) for f in futures] == list(range(count))
            return [d.reason for d in ex.decisions]


def entries(path: Path) -> list[dict[str, object]]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    found = data["entries"]
    assert isinstance(found, list)
    return found


def test_a_second_run_prices_its_first_wave_from_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("GPUPOOL_MEMORY", str(path))
    first = run_pipeline(int(4.2 * GiB))
    assert not any("earlier run" in reason for reason in first)
    (entry,) = entries(path)
    assert str(entry["key"]).startswith("predict_tasks.hold_spec@")
    assert entry["model"] == "Simulated GPU" and entry["samples"] == 6
    second = run_pipeline(int(4.2 * GiB))
    recalled = [reason for reason in second if "earlier run" in reason]
    assert len(recalled) == 1 and "estimated at 4.9" in recalled[0], recalled


def test_memory_the_first_measurement_contradicts_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Remembered at 1.5 GiB, the tasks now hold 6.3 GiB: the first measurement drops the
    memory, and the file holds this run's peak afterwards."""
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("GPUPOOL_MEMORY", str(path))
    run_pipeline(int(1.2 * GiB), count=2)
    reasons = run_pipeline(6 * GiB, count=4)
    assert any("earlier run" in reason for reason in reasons)
    (entry,) = entries(path)
    assert isinstance(entry["peak_bytes"], int) and entry["peak_bytes"] > 6 * GiB


def test_off_remembers_nothing_and_forget_clears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUPOOL_MEMORY", "off")
    assert memory_path({"GPUPOOL_MEMORY": "off"}) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    run_pipeline(GiB, count=2)
    assert list(tmp_path.iterdir()) == []
    assert memory_path({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "gpupool" / "peaks.json"
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("GPUPOOL_MEMORY", str(path))
    run_pipeline(GiB, count=2)
    assert path.exists()
    assert forget_peaks() is True
    assert not path.exists() and forget_peaks() is False


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe",
        b"[1, 2, 3]",
        b'{"entries": 5}',
        b" " * (MAX_FILE_BYTES + 1),
        json.dumps(
            {
                "entries": [
                    {"key": "k", "model": "Simulated GPU", "peak_bytes": -1, "samples": 1},
                    {"key": "k", "model": "Simulated GPU", "peak_bytes": 2**60, "samples": 1},
                    {"key": 5, "model": "Simulated GPU", "peak_bytes": 1, "samples": 1},
                    {"key": "k", "model": "Simulated GPU", "peak_bytes": True, "samples": 1},
                    {"key": "k" * 10_000, "model": "M", "peak_bytes": 1, "samples": 1},
                    "entry",
                ]
            }
        ).encode(),
    ],
)
def test_a_hostile_file_is_bounded_and_validated(tmp_path: Path, body: bytes) -> None:
    """What a stranger wrote: nothing believed, no error, and the next save replaces it."""
    path = tmp_path / "peaks.json"
    path.write_bytes(body)
    memory = PeakMemory(path, ("Simulated GPU",))
    assert memory.recall("k") is None
    memory.learned("k", GiB, 3)
    memory.save()
    (entry,) = entries(path)
    assert entry["peak_bytes"] == GiB


def test_a_new_version_of_a_task_is_a_new_key() -> None:
    """The key a peak is remembered under changes with the function's code."""
    namespace: dict[str, object] = {}
    exec("def task(x):\n    return x + 1\n", namespace)
    before = code_digest(namespace["task"])  # type: ignore[arg-type]
    exec("def task(x):\n    return x + 2\n", namespace)
    after = code_digest(namespace["task"])  # type: ignore[arg-type]
    exec("def task(x):\n    return x + 2\n", namespace)
    assert before != after == code_digest(namespace["task"])  # type: ignore[arg-type]
    assert code_digest(print) == ""
