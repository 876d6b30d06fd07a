"""A forked child of a process with an open pool (a ``multiprocessing.Pool`` worker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180)]

#: Bounds the script's run, so a child that never exits fails the test instead of hanging it.
SCRIPT_WAIT_S = 60.0

_FORK_POOL_BESIDE_AN_OPEN_POOL = """
import multiprocessing

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

if __name__ == "__main__":
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1) as ex:
            assert ex.submit(abs, -3).result() == 3
            # Pool's __exit__ terminates its (forked) workers with SIGTERM and joins them.
            with multiprocessing.get_context("fork").Pool(2) as forked:
                assert forked.map(abs, [-1, -2, -3, -4]) == [1, 2, 3, 4]
            print("forked pool ended", flush=True)
"""


def test_a_fork_pool_terminated_beside_an_open_pool_ends(tmp_path: Path) -> None:
    # Before, the forked workers inherited the parent's SIGTERM handler and its list of
    # open pools: SIGTERM raised KeyboardInterrupt there, and their exit then waited
    # forever for the copied pools' dispatcher threads, which do not exist in a child.
    script = tmp_path / "fork_pool.py"
    script.write_text(_FORK_POOL_BESIDE_AN_OPEN_POOL)
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=SCRIPT_WAIT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the forked pool's workers never exited: {hung.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "forked pool ended", done.stderr
