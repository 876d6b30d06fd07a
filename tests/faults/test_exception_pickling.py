"""Every exception gpupool defines survives pickle, alone and on its way back from a task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import faulty
import pytest

from gpupool import GpuPoolExecutor, InvalidSizeError
from gpupool._observe.log_reader import DecisionLogError
from gpupool.testing import SimulatedDevice, SimulatedHost

_SCRIPT = Path(__file__).with_name("exception_roundtrip.py")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, str]]:
    """The round trip of every gpupool exception, judged in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, str(_SCRIPT)], capture_output=True, text=True, timeout=120, check=True
    )
    value: dict[str, dict[str, str]] = json.loads(done.stdout)
    return value


def test_the_walk_finds_the_whole_tree(outcomes: dict[str, dict[str, str]]) -> None:
    """The walk reaches the documented tree and the errors defined outside _errors.py."""
    names = {name.rsplit(".", 1)[1] for name in outcomes}
    assert {
        "GpuPoolError",
        "ConfigurationError",
        "InvalidSizeError",
        "SensorError",
        "NoDriverError",
        "DeviceUnreadableError",
        "WidthError",
        "DeviceOutOfMemoryError",
        "WorkerLostError",
        "DecisionLogError",
        "EmptyLogError",
        "LedgerGoneError",
        "PlotUnavailableError",
        "SimulatedOutOfMemory",
    } <= names


def test_every_exception_round_trips(outcomes: dict[str, dict[str, str]]) -> None:
    """Type, message, args and every attribute survive pickle and cloudpickle, for each class."""
    wrong = {
        f"{name} ({how})": result
        for name, by in outcomes.items()
        for how, result in by.items()
        if result != "ok"
    }
    assert wrong == {}


@pytest.mark.parametrize(
    ("raiser", "cls", "attribute", "value"),
    [
        (faulty.raise_invalid_size, InvalidSizeError, "value", "12 parsecs"),
        (faulty.raise_decision_log_error, DecisionLogError, "line", 7),
    ],
    ids=["InvalidSizeError", "DecisionLogError"],
)
def test_a_gpupool_error_raised_by_a_task_reaches_the_caller_intact(
    raiser: object, cls: type[BaseException], attribute: str, value: object
) -> None:
    """A task raising gpupool's own error: the caller gets it with its attributes, not
    a BrokenProcessPool saying it failed to un-serialize."""
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
            error = ex.submit(raiser, "12 parsecs").exception(timeout=60)
    assert type(error) is cls
    assert getattr(error, attribute) == value
