"""A forked child of a process with an open pool (a ``multiprocessing.Pool`` worker)."""

from __future__ import annotations

import signal
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

#: A hook registered before gpupool's own sends the forked child SIGTERM at once: before,
#: the inherited handler raised ``KeyboardInterrupt`` inside that hook (printed, ignored),
#: and the child lived on; a ``Pool.terminate`` that came that early never ended its worker.
_SIGTERM_WHILE_THE_CHILD_FORKS = """
import os
import signal


def _terminate_me():
    os.kill(os.getpid(), signal.SIGTERM)


os.register_at_fork(after_in_child=_terminate_me)

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

if __name__ == "__main__":
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1) as ex:
            assert ex.submit(abs, -3).result() == 3
            pid = os.fork()
            if pid == 0:
                os._exit(7)
            _, status = os.waitpid(pid, 0)
            held = signal.pthread_sigmask(signal.SIG_BLOCK, set())
            print(os.WIFSIGNALED(status) and os.WTERMSIG(status), signal.SIGTERM in held)
            assert ex.submit(abs, -4).result() == 4
"""


def _run(tmp_path: Path, script_text: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(script_text)
    try:
        return subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=SCRIPT_WAIT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the forked children never exited: {hung.stderr!r}")


def test_a_fork_pool_terminated_beside_an_open_pool_ends(tmp_path: Path) -> None:
    # Before, the forked workers inherited the parent's SIGTERM handler and its list of
    # open pools: SIGTERM raised KeyboardInterrupt there, and their exit then waited
    # forever for the copied pools' dispatcher threads, which do not exist in a child.
    done = _run(tmp_path, _FORK_POOL_BESIDE_AN_OPEN_POOL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "forked pool ended", done.stderr


def test_sigterm_that_reaches_a_child_as_it_forks_ends_it(tmp_path: Path) -> None:
    # Here the SIGTERM comes while other modules' at-fork hooks run; one that came before
    # the interpreter's own after-fork reset was dropped. The fork holds it back until the
    # child has put the default action back, and the parent's mask is as it was.
    done = _run(tmp_path, _SIGTERM_WHILE_THE_CHILD_FORKS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(signal.SIGTERM)), "False"], done.stderr
