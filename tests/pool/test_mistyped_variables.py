"""A mistyped ``GPUPOOL_*`` variable is not ignored without a word: building a pool warns,
naming the closest real variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gpupool._pool.environ import KNOWN_VARIABLES, mistyped_variables

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="8GiB"):
    for _ in range(2):  # a second pool: the warning is not said again
        with GpuPoolExecutor(task_peak="1GiB") as pool:
            constructed = [d.to_dict() for d in pool.decisions if d.event == "constructed"]
            print("max_workers", constructed[0]["max_workers"])
"""


def test_building_a_pool_warns_of_a_mistyped_variable_once() -> None:
    """GPUPOOL_MAXWORKERS=1 in the environment: the pool warns once, naming
    GPUPOOL_MAX_WORKERS, and builds with its defaults (the mistyped name is not read)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "GPUPOOL_MAXWORKERS": "1",
        "GPUPOOL_MY_SCRIPT_SETTING": "kept quiet: like no real name",
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    warned = re.findall(r"UserWarning: (.*)", done.stderr)
    assert warned == [
        "GPUPOOL_MAXWORKERS is set but gpupool reads no such variable; did you mean "
        "GPUPOOL_MAX_WORKERS? (rename it, or unset GPUPOOL_MAXWORKERS)"
    ], done.stderr
    assert "max_workers 2" in done.stdout  # the host's 2 CPUs: the typo was not read


def test_typos_are_matched_to_the_closest_real_name() -> None:
    """A dropped or extra underscore, a letter off, or lower case; a name like none of the
    real ones is not a typo."""
    environ = {
        "GPUPOOL_TASKPEAK": "6GiB",
        "GPUPOOL_RESERV": "1GiB",
        "gpupool_log_path": "x.jsonl",
        "GPUPOOL_ROOM_WAIT": "5",
        "GPUPOOL_MAX_WORKERS": "2",  # a real one
        "GPUPOOL_MY_SETTING": "1",
        "OTHER_MAXWORKERS": "1",
    }
    assert mistyped_variables(environ) == [
        ("GPUPOOL_RESERV", "GPUPOOL_RESERVE"),
        ("GPUPOOL_ROOM_WAIT", "GPUPOOL_ROOM_WAIT_S"),
        ("GPUPOOL_TASKPEAK", "GPUPOOL_TASK_PEAK"),
        ("gpupool_log_path", "GPUPOOL_LOG_PATH"),
    ]


def test_every_variable_gpupool_reads_is_known() -> None:
    """Each ``GPUPOOL_*`` name the package's source spells is in KNOWN_VARIABLES (a new
    variable missing there would be warned of as a typo of another)."""
    spelled = {
        name
        for path in SRC.rglob("*.py")
        for name in re.findall(r"[\"'](GPUPOOL_[A-Z0-9_]+)[\"']", path.read_text())
    }
    assert spelled
    assert spelled <= set(KNOWN_VARIABLES), spelled - set(KNOWN_VARIABLES)
