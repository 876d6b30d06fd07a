"""Implausible per-process rows are not measurements: real pynvml.py over fake C entry points."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "sensors"))
from fake_nvml_lib import FakeNvmlCard, install

from gpupool._child.probe import Probe
from gpupool._core.units import GiB, MiB
from gpupool._sensors.nvml import NvmlSensor

pytest.importorskip("pynvml", reason="nvidia-ml-py (a gpupool dependency) is not installed")

NO_PID = 0xFFFFFFFF


def _probe(monkeypatch: pytest.MonkeyPatch, card: FakeNvmlCard) -> Probe:
    """A probe over NvmlSensor, the installed pynvml.py answering from ``card``."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    install(monkeypatch, card)
    sensor = NvmlSensor()
    info = sensor.read_devices()[0]
    assert info.uuid == card.uuid  # the real binding read the fake driver
    return Probe(sensor, info, 0, os.getpid())


def test_a_row_smaller_than_any_context_is_not_the_childs_peak(monkeypatch):
    """A 16,040-byte row for the child (the early R535 struct break) is rejected, with why."""
    card = FakeNvmlCard(used_bytes=20 * GiB, rows=[(os.getpid(), 16_040)])
    probe = _probe(monkeypatch, card)
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert report.device_source == "none"
    assert any("16040 bytes" in r and "context" in r for r in report.rejected_readings), (
        report.rejected_readings
    )


@pytest.mark.parametrize("bad_pid", [0, NO_PID], ids=["pid-0", "pid-0xffffffff"])
def test_a_list_with_an_impossible_pid_is_not_a_measurement(monkeypatch, bad_pid):
    """A row with PID 0 or 0xFFFFFFFF shows the list was misread: none of its rows is taken."""
    card = FakeNvmlCard(
        used_bytes=20 * GiB, rows=[(bad_pid, 3 * GiB), (os.getpid(), 2 * GiB + 300 * MiB)]
    )
    probe = _probe(monkeypatch, card)
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert any(f"PID {bad_pid}" in r for r in report.rejected_readings), report.rejected_readings


def test_a_driver_struct_wider_than_the_bindings_is_caught(monkeypatch):
    """32-byte driver entries read as the binding's 24-byte ones yield no measurement.

    Read at the binding's stride, the second entry's PID is the first entry's
    protected-memory word (here, by chance, the child's PID) and its bytes are
    the next process's PID: the child "holds" 16,040 bytes.
    """
    card = FakeNvmlCard(
        used_bytes=30 * GiB,
        raw_rows=[(4_000_123, 9 * GiB, os.getpid()), (16_040, 7 * GiB, 0)],
    )
    lib = install(monkeypatch, card)
    pynvml = pytest.importorskip("pynvml")
    misread = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(None)]
    assert (os.getpid(), 16_040) in misread  # what the real binding makes of it
    assert lib.calls == ["compute_v3", "compute_v3"]
    probe = _probe(monkeypatch, card)
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert any("16040 bytes" in r for r in report.rejected_readings), report.rejected_readings


def test_a_row_above_the_devices_used_bytes_is_rejected(monkeypatch):
    """A child's row larger than everything the card holds disagrees with the device: rejected."""
    card = FakeNvmlCard(used_bytes=4 * GiB, rows=[(os.getpid(), 9 * GiB)])
    probe = _probe(monkeypatch, card)
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert any("in use on the whole device" in r for r in report.rejected_readings), (
        report.rejected_readings
    )


def test_a_plausible_row_is_the_childs_peak(monkeypatch):
    """A row of a context's size or more, within the card's used bytes, is measured."""
    card = FakeNvmlCard(used_bytes=20 * GiB, rows=[(os.getpid(), 2 * GiB + 300 * MiB)])
    probe = _probe(monkeypatch, card)
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes == 2 * GiB + 300 * MiB
    assert report.device_source == "nvml-sampled"
    assert report.rejected_readings == ()
