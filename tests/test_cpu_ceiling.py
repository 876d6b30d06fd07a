"""The host's CPU ceiling: one computation for the pool and ``gpupool census``.

``LOKY_MAX_CPU_COUNT`` caps the CPUs counted wherever the census is taken, and
the count honours the CPU affinity as ``loky.cpu_count()`` does (gpupool
keeps its own reader because it also walks every cgroup level and names
the source; these tests hold the two to the same answer where both apply).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import loky
import pytest

from gpupool import GpuPoolExecutor
from gpupool._sensors.host import read_host_census
from gpupool.testing import SimulatedDevice, SimulatedHost

#: A guard against a hang, never a measurement.
HANG_S = 120


def _census_json(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupool", "census", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
        check=False,
    )


def _environment(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOKY_MAX_CPU_COUNT"}
    env.update(changes)
    return env


def test_census_json_honours_loky_max_cpu_count_on_this_host() -> None:
    """`gpupool census --json` under LOKY_MAX_CPU_COUNT=1 counts 1 CPU and names the variable
    (before: it showed every usable CPU while the pool counted 1)."""
    env = _environment(LOKY_MAX_CPU_COUNT="1")
    env.pop("GPUPOOL_SIMULATOR", None)
    done = _census_json(env)
    assert done.returncode == 0, done.stderr
    host = json.loads(done.stdout)["host"]
    assert host["cpus"] == 1
    if len(os.sched_getaffinity(0)) > 1:
        assert host["cpu_source"].startswith("LOKY_MAX_CPU_COUNT=1 (below ")


def test_census_and_pool_share_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a simulated 8-CPU host under LOKY_MAX_CPU_COUNT=3, the census command and a pool
    count the same CPUs from the same source."""
    monkeypatch.setenv("LOKY_MAX_CPU_COUNT", "3")
    with SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=8, host_ram="64GiB"):
        done = _census_json(dict(os.environ))
        assert done.returncode == 0, done.stderr
        from_cli = json.loads(done.stdout)["host"]
        with GpuPoolExecutor(task_peak="1GiB") as ex:
            from_pool = ex.census.host
    assert from_cli["cpus"] == from_pool.cpus == 3
    assert from_cli["cpu_source"] == from_pool.cpu_source
    assert from_pool.cpu_source.startswith("LOKY_MAX_CPU_COUNT=3 (below 8 from simulator")


@pytest.mark.parametrize("value", ["0", "two"])
def test_census_refuses_a_bad_loky_max_cpu_count_in_one_line(value: str) -> None:
    """A bad value is an error line naming the variable and the fix, not a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "census"],
        capture_output=True,
        text=True,
        env=_environment(LOKY_MAX_CPU_COUNT=value),
        timeout=HANG_S,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith(f"gpupool census: LOKY_MAX_CPU_COUNT={value!r}: ")
    assert "whole number" in done.stderr
    assert "Traceback" not in done.stderr


_UNDER_ONE_CPU = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import loky
from gpupool._sensors.host import read_host_census
host = read_host_census()
print(json.dumps({"ours": host.cpus, "source": host.cpu_source, "loky": loky.cpu_count()}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_affinity_is_honoured_as_loky_honours_it() -> None:
    """A process pinned to one CPU counts 1, as loky.cpu_count() does."""
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_ONE_CPU],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=HANG_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout)
    assert counted["ours"] == counted["loky"] == 1
    assert counted["source"] == "sched_getaffinity"


def test_the_count_is_never_above_lokys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every limit loky reads (affinity, the cgroup quota at the mount) is read here too, so
    this host's count is at most loky's."""
    monkeypatch.delenv("LOKY_MAX_CPU_COUNT", raising=False)
    assert 1 <= read_host_census().cpus <= loky.cpu_count()
