"""A GPUPOOL_SIMULATOR that does not name a ledger is refused with the file's name, unread."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpupool import GpuPoolExecutor, SensorError
from gpupool._sensors.simulated import MAX_LEDGER_BYTES, forget_ledger
from gpupool._sensors.simulated_sensor import SimulatedSensor


def _refused(path: Path) -> SensorError:
    forget_ledger(str(path))
    with pytest.raises(SensorError) as info:
        SimulatedSensor(str(path)).read_devices()
    forget_ledger(str(path))
    assert str(path) in str(info.value)
    assert "does not name a simulated host's ledger" in str(info.value)
    return info.value


def _ledger_of(devices: list[dict[str, object]]) -> bytes:
    """A ledger's text with these devices and every host field well-formed."""
    ledger = {
        "version": 1,
        "driver": True,
        "container": False,
        "context": 0,
        "cpus": None,
        "ram": None,
        "next_fake_pid": 1,
        "ooms": [],
        "devices": devices,
    }
    return json.dumps(ledger).encode()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x00\xffgarbage", "it is not JSON"),
        (b"[1, 2, 3]", "not a ledger (no version)"),
        (json.dumps({"version": 1}).encode(), "the ledger has no 'driver'"),
        (
            _ledger_of([{"uuid": "GPU-x", "total": "lots"}]),
            "device 0's 'total' is 'lots'",
        ),
    ],
    ids=["binary", "json-list", "no-fields", "bad-field"],
)
def test_a_file_that_is_not_a_ledger_is_refused(tmp_path: Path, content: bytes, why: str) -> None:
    """Garbage, foreign JSON and malformed ledgers give a SensorError naming the file and why."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    assert why in str(_refused(path))


def _ledger_with(procs: dict, peaks: dict, trees: dict) -> bytes:
    """A well-formed ledger of one device, with these processes, peaks and tree windows."""
    device = {
        "uuid": "GPU-x",
        "total": 1 << 30,
        "unified": False,
        "readable": True,
        "tenants": {},
        "procs": procs,
        "peaks": peaks,
        "peak": 0,
        "trees": trees,
    }
    return _ledger_of([device])


_PROC = {"start": "1", "name": "x", "context": 0, "held": 5, "window": 5, "ancestors": []}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (_ledger_with({"\u00b2": _PROC}, {}, {}), "device 0's process '\u00b2'"),
        (_ledger_with({"\u0663": _PROC}, {}, {}), "device 0's process '\u0663'"),
        (_ledger_with({}, {"\u00b2": 5}, {}), "device 0's peak of '\u00b2'"),
        (_ledger_with({}, {}, {"\u00b2": {"start": "1", "window": 5}}), "tree window '\u00b2'"),
    ],
    ids=["superscript-pid", "arabic-indic-pid", "superscript-peak", "superscript-tree-root"],
)
def test_a_pid_that_is_not_ascii_digits_is_refused(
    tmp_path: Path, content: bytes, why: str
) -> None:
    """A PID key that ``str.isdigit`` takes but that is no decimal PID ("2" as a superscript,
    an Arabic-Indic "3") gives a SensorError naming it, never a ValueError from ``int``."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    assert why in str(_refused(path))


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (_ledger_with({"12": {**_PROC, "held": -(1 << 30)}}, {}, {}), "process 12's 'held'"),
        (_ledger_with({"12": {**_PROC, "context": -1}}, {}, {}), "process 12's 'context'"),
        (_ledger_with({}, {"12": -5}, {}), "device 0's peak of '12'"),
        (_ledger_with({}, {}, {"12": {"start": "1", "window": -5}}), "tree window '12'"),
    ],
    ids=["held", "context", "peak", "tree-window"],
)
def test_a_negative_size_is_refused(tmp_path: Path, content: bytes, why: str) -> None:
    """A negative byte count would be read as a card with more free bytes than it has: the
    ledger is refused with a SensorError naming the field."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    assert why in str(_refused(path))


def test_a_huge_sparse_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A 2 GB sparse file is refused by its size, before a byte of it is read."""
    path = tmp_path / "sparse.json"
    with open(path, "wb") as file:
        file.truncate(2 * 10**9)
    assert f"more than any ledger ({MAX_LEDGER_BYTES})" in str(_refused(path))


def test_a_directory_and_a_fifo_are_refused(tmp_path: Path) -> None:
    """A directory or a FIFO is not a ledger, and opening the FIFO does not hang."""
    assert "cannot be opened" in str(_refused(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in str(_refused(fifo))


def test_the_pool_refuses_a_garbage_simulator_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GpuPoolExecutor() with GPUPOOL_SIMULATOR at a garbage file raises a clear SensorError."""
    path = tmp_path / "garbage"
    path.write_text("not json at all")
    monkeypatch.setenv("GPUPOOL_SIMULATOR", str(path))
    with pytest.raises(SensorError, match=r"GPUPOOL_SIMULATOR='.*garbage' does not name"):
        GpuPoolExecutor(max_workers=1)
    forget_ledger(str(path))
