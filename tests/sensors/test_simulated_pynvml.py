"""The simulator-fed pynvml double: the real NVML sensor reads a simulated host through it as the
simulator's own sensor does, rows hidden, 0 or without a figure where the host says so."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_pynvml import FAKE_ONLY, FakePynvml
from simulated_pynvml import SimulatedPynvml, parent_uuid_of

import gpupool.testing as gt
from gpupool import DeviceUnreadableError, NoDriverError
from gpupool._sensors.nvml import NvmlSensor
from gpupool._sensors.simulated_sensor import SimulatedSensor

GiB = 1024**3
MiB = 1024**2
HERE = Path(__file__).resolve().parent


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> NvmlSensor:
    monkeypatch.setitem(sys.modules, "pynvml", SimulatedPynvml())
    sensor = NvmlSensor()
    yield sensor
    sensor.close()


def _public(module: object) -> set[str]:
    return {n for n in [*vars(module), *vars(type(module))] if not n.startswith("_")} - FAKE_ONLY


def test_the_double_adds_no_name_to_the_fake() -> None:
    """Every public name of the double is the fake's (held to nvidia-ml-py by the fidelity
    test), and the functions it overrides take the fake's parameters."""
    assert _public(SimulatedPynvml()) <= _public(FakePynvml([]))
    overridden = [n for n in vars(SimulatedPynvml) if n.startswith("nvml")]
    assert overridden
    for name in overridden:
        ours = inspect.signature(getattr(SimulatedPynvml, name))
        assert ours == inspect.signature(getattr(FakePynvml, name)), name


@pytest.mark.parametrize(
    ("rows", "mig", "expected"),
    [
        ("listed", False, "bytes"),
        ("hidden", False, "absent"),
        ("zero", False, 0),
        ("unavailable", False, None),
        ("listed", True, None),
    ],
)
def test_nvml_reads_the_simulated_card_as_the_simulator_does(
    nvml: NvmlSensor, rows: str, mig: bool, expected: object
) -> None:
    """Memory equals the simulator's reading; this process's row follows the host's rows mode;
    a co-tenant's row is listed with its bytes in every mode."""
    card = gt.SimulatedDevice("24GiB", co_tenants={"server": "3GiB"}, mig=mig)
    with gt.SimulatedHost([card], context="300MiB", rows=rows) as host, gt.hold("1GiB"):
        (device,) = nvml.read_devices()
        assert device.uuid == host.device_uuid(0) and device.mig is mig
        if mig:
            assert device.parent_uuid == parent_uuid_of(device.uuid)
        simulated = SimulatedSensor(host.ledger_path)
        truth = simulated.read_memory(simulated.read_devices()[0])
        memory = nvml.read_memory(device)
        assert (memory.total_bytes, memory.free_bytes, memory.used_bytes) == (
            truth.total_bytes,
            truth.free_bytes,
            truth.used_bytes,
        )
        listed = {row.pid: row.used_bytes for row in nvml.read_processes(device) or ()}
        assert 3 * GiB in listed.values()
        if expected == "absent":
            assert os.getpid() not in listed
        elif expected == "bytes":
            assert listed[os.getpid()] == 1 * GiB + 300 * MiB
        else:
            assert listed[os.getpid()] == expected
        with gt.hold("2GiB"):  # read again at the next call: nothing is cached
            assert nvml.read_memory(device).used_bytes == truth.used_bytes + 2 * GiB


def test_an_unreadable_card_fails_its_readings_and_no_host_is_no_driver(
    nvml: NvmlSensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unreadable simulated device fails memory readings with an NVML error (mapped to
    DeviceUnreadableError); outside a simulated host the double is a host without a driver."""
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB", readable=False)]):
        (device,) = nvml.read_devices()
        with pytest.raises(DeviceUnreadableError, match="Unknown Error"):
            nvml.read_memory(device)
    monkeypatch.delenv("GPUPOOL_SIMULATOR", raising=False)
    with pytest.raises(NoDriverError, match="Driver Not Loaded"):
        NvmlSensor().read_devices()


def test_the_shim_installs_the_double_as_pynvml_in_a_new_process(tmp_path: Path) -> None:
    """With nvml_double/ and tests/sensors first on PYTHONPATH, a fresh interpreter's
    ``import pynvml`` is the double, and it reads the simulated host's card."""
    code = (
        "import pynvml, gpupool.testing as gt\n"
        "with gt.SimulatedHost([gt.SimulatedDevice('8GiB')]) as host, gt.hold('1GiB'):\n"
        "    pynvml.nvmlInit()\n"
        "    info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))\n"
        "    print(type(pynvml).__name__, info.total, info.used)\n"
    )
    path = os.pathsep.join([str(HERE / "nvml_double"), str(HERE), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("GPUPOOL_SIMULATOR", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SimulatedPynvml", str(8 * GiB), str(1 * GiB + 300 * MiB)]
