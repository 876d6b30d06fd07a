"""Bad inputs refused where they are given, with a message that names the argument (or the
variable) and the fix: never a bare AttributeError from deep inside, a task that fails with no
cause, an option silently ignored, or a CLI that plans what the pool would refuse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tasks

from gpupool import ConfigurationError, GpuPoolExecutor
from gpupool._commands.cli import EXIT_USAGE, main
from gpupool.testing import SimulatedDevice, SimulatedHost


@pytest.fixture(scope="module")
def host():
    with SimulatedHost([SimulatedDevice("16GiB")], cpus=4, host_ram="64GiB") as h:
        yield h


def test_a_sensor_that_is_not_one_is_refused(host: SimulatedHost) -> None:
    """sensor=object(): named, with what a sensor is, not an AttributeError from the census."""
    with pytest.raises(ConfigurationError, match=r"^sensor=<object object at .*>: not a sensor"):
        GpuPoolExecutor(max_workers=1, task_peak="1GiB", sensor=object())  # type: ignore[arg-type]


def test_a_pythonhome_that_points_nowhere_is_refused(host: SimulatedHost, tmp_path: Path) -> None:
    """env={'PYTHONHOME': ...} naming no Python: refused at construction with the cause (before:
    every task failed with 'exited with code 1' and no reason)."""
    missing = str(tmp_path / "nonexistent")
    with pytest.raises(ConfigurationError) as info:
        GpuPoolExecutor(max_workers=1, task_peak="1GiB", env={"PYTHONHOME": missing})
    message = str(info.value)
    assert message.startswith(f"env: PYTHONHOME={missing!r}")
    assert "no worker could start" in message
    assert "sys.prefix" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigurationError, match=r"PYTHONHOME=.*has no lib/python3\.\d+"):
        GpuPoolExecutor(max_workers=1, task_peak="1GiB", env={"PYTHONHOME": str(empty)})


def test_pythonhome_of_this_python_is_accepted(host: SimulatedHost) -> None:
    """The check refuses only what cannot boot: this interpreter's own prefix is accepted."""
    home = f"{sys.base_prefix}:{sys.base_exec_prefix}"
    ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB", env={"PYTHONHOME": home})
    ex.shutdown()


def test_an_empty_pythonhome_is_accepted(host: SimulatedHost) -> None:
    """PYTHONHOME='' is ignored by Python (as every empty PYTHON* variable): a worker under it
    starts and runs its task, so the check lets it through."""
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB", env={"PYTHONHOME": ""}) as ex:
        assert ex.submit(tasks.sleep_return, 1, 0.0).result(timeout=60) == 1


def test_an_empty_key_is_refused(host: SimulatedHost) -> None:
    """options(key='') was silently the default key: now refused, naming the fix."""
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        with pytest.raises(ConfigurationError, match=r"^key='': a task key must be a non-empty"):
            ex.options(key="")
        assert ex.options(key="k").submit(tasks.sleep_return, 1, 0.0).result(timeout=60) == 1


def test_a_missing_simulator_file_says_what_sets_it(tmp_path: Path) -> None:
    """GPUPOOL_SIMULATOR naming no file: the message says the file is missing and what sets the
    variable (before: 'the SimulatedHost block has exited', outside any block)."""
    missing = tmp_path / "no-ledger"
    code = "from gpupool import GpuPoolExecutor\nGpuPoolExecutor(max_workers=1, task_peak='1GiB')\n"
    env = {**os.environ, "GPUPOOL_SIMULATOR": str(missing)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert f"GPUPOOL_SIMULATOR={str(missing)!r} names a file that does not exist" in done.stderr
    assert "set by gpupool.testing.SimulatedHost" in done.stderr
    assert "unset GPUPOOL_SIMULATOR" in done.stderr


def test_plan_refuses_what_the_pool_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    """gpupool plan --task-peak 1e30: a usage error naming the 1 PiB bound, as the pool says."""
    with pytest.raises(SystemExit) as info:
        main(["plan", "--total", "44GiB", "--task-peak", "1e30"])
    assert info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--task-peak='1e30'" in err
    assert "more than the 2**50 bytes (1 PiB) gpupool accepts" in err
    with pytest.raises(ConfigurationError, match=r"more than the 2\*\*50 bytes \(1 PiB\)"):
        GpuPoolExecutor(max_workers=1, task_peak=10**30)
