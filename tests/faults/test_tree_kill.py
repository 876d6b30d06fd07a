"""Ending a worker's whole tree: the parts a plain descendant walk misses.

``gpupool._pool.reaper.signal_tree`` walks a worker's descendants with
psutil (as ``loky.backend.utils.kill_process_tree`` does) and also signals
the worker's process group. These tests pin down why both are needed: a
descendant in a session of its own is out of the group's reach, and a
background process whose parent exited is out of the walk's reach.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from leakguard import exited, wait_until

from gpupool import GpuPoolExecutor, WorkerLostError
from gpupool._pool.reaper import signal_tree
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = pytest.mark.faults

#: A guard against a hang, never a measurement: every wait here ends far sooner.
HANG_S = 120


def _waiter(directory: Path, name: str) -> Path:
    """A shell script that writes its PID to ``directory/<name>.pid``, then waits for ``go``."""
    script = directory / f"{name}.sh"
    pidfile = directory / f"{name}.pid"
    script.write_text(
        f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}\n"
        f"while [ ! -e {directory / 'go'} ]; do sleep 0.05; done\n"
    )
    return script


def _pid_from(directory: Path, name: str) -> int:
    pidfile = directory / f"{name}.pid"
    assert wait_until(pidfile.exists, HANG_S)
    return int(pidfile.read_text())


@pytest.mark.parametrize("method", ["terminate_workers", "kill_workers"])
def test_a_descendant_in_a_session_of_its_own_ends_with_its_worker(tmp_path: Path, method: str):
    """A task runs ``setsid sh script``: the script's shell leads its own session and group,
    so only the walk down the worker's descendants reaches it; stopping the workers ends it."""
    script = _waiter(tmp_path, "session")
    try:
        with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="16GiB"):
            ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
            running = ex.submit(os.system, f"setsid sh {script}")
            pid = _pid_from(tmp_path, "session")
            assert os.getpgid(pid) == pid  # out of the worker's group: the walk must find it
            getattr(ex, method)()
            error = running.exception(timeout=HANG_S)
            ex.shutdown()
        assert isinstance(error, WorkerLostError)
        assert wait_until(lambda: exited(pid), HANG_S)
    finally:
        (tmp_path / "go").touch()


_LEAVES_A_BACKGROUND_PROCESS = """
import os, sys
os.system("sh {script} &")
sys.stdin.read()
"""


def test_a_background_process_whose_parent_exited_is_reached_through_the_group(tmp_path: Path):
    """``os.system("... &")`` leaves a shell whose parent has exited: it is no longer a
    descendant (psutil's walk, which loky's kill_process_tree uses, does not list it), but it
    is in the group, and ``signal_tree`` ends it."""
    script = _waiter(tmp_path, "background")
    # A group leader, as every worker is (it calls setpgid at start).
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEAVES_A_BACKGROUND_PROCESS.format(script=script)],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        pid = _pid_from(tmp_path, "background")
        walked = {child.pid for child in psutil.Process(leader.pid).children(recursive=True)}
        assert pid not in walked
        assert os.getpgid(pid) == leader.pid
        signal_tree(leader.pid, signal.SIGTERM)
        assert leader.wait(HANG_S) == -signal.SIGTERM
        assert wait_until(lambda: exited(pid), HANG_S)
    finally:
        (tmp_path / "go").touch()
        if leader.poll() is None:
            leader.kill()
            leader.wait(HANG_S)
        assert leader.stdin is not None
        leader.stdin.close()
