"""Nothing a task started outlives the pool: SIGTERM or SIGKILL to the pool's process
(a Python script, and ``gpupool run``), then 0 processes left within 10 s.

Each task starts ``sleep`` with a duration unique to the test (how its processes are found)
and waits for it. Before: SIGTERM to a Python parent left 2 orphans (it died at once, with
no handler), SIGKILL 2, and SIGKILL to ``gpupool run`` 4 (the ``sh -c`` commands, in
sessions of their own, and their ``sleep``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from leakguard import wait_until

pytestmark = pytest.mark.faults

HERE = Path(__file__).resolve().parent

SCRIPT = """\
import os, subprocess, sys
from gpupool import GpuPoolExecutor

def run_sleep(directory, duration):
    child = subprocess.Popen(["sleep", duration])
    with open(os.path.join(directory, f"{os.getpid()}.pid"), "w") as f:
        f.write(str(child.pid))
    return child.wait()

if __name__ == "__main__":
    directory, duration, how = sys.argv[1:4]
    if how == "bare":
        ex = GpuPoolExecutor(max_workers=2)
        futures = [ex.submit(run_sleep, directory, duration) for _ in range(2)]
        print([f.result() for f in futures])
    else:
        with GpuPoolExecutor(max_workers=2, on_interrupt=how) as ex:
            futures = [ex.submit(run_sleep, directory, duration) for _ in range(2)]
            print([f.result() for f in futures])
"""


def _ours(duration: str) -> list[psutil.Process]:
    """The live processes whose command line holds ``duration`` (zombies have exited)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(duration in word for word in process.info["cmdline"] or ()):
            found.append(process)
    return found


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (psutil checks each is the process it was)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:
            pass
    return alive


def _start(tmp_path: Path, how: str, duration: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.pop("GPUPOOL_SIMULATOR", None)
    if how == "run":
        command = [sys.executable, "-m", "gpupool", "run", "--max-workers", "2", "--"]
        command.append(f"echo $$ > {tmp_path}/$$.pid; sleep {{}}")
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, env=env, start_new_session=True, cwd=tmp_path
        )
        assert process.stdin is not None
        process.stdin.write(f"{duration}\n{duration}\n".encode())
        process.stdin.close()
        return process
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), duration, how],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("how", "sig"),
    [
        ("terminate", signal.SIGTERM),
        ("terminate", signal.SIGKILL),
        ("bare", signal.SIGTERM),
        ("wait", signal.SIGTERM),
        ("run", signal.SIGTERM),
        ("run", signal.SIGKILL),
    ],
)
def test_nothing_a_task_started_outlives_its_pool(tmp_path: Path, how: str, sig: int):
    duration = f"600.{os.getpid()}{time.monotonic_ns() % 100000}"
    process = _start(tmp_path, how, duration)
    below: list[psutil.Process] = []
    try:
        # Both tasks (or commands) started their sleep.
        assert wait_until(lambda: len(list(tmp_path.glob("*.pid"))) >= 2, 60), process.poll()
        assert wait_until(lambda: len(_ours(duration)) >= 2, 30)
        # Every process below it: its workers, their tasks' sleeps, the resource tracker.
        below = psutil.Process(process.pid).children(recursive=True)
        os.kill(process.pid, sig)
        process.wait(timeout=30)
        assert wait_until(lambda: not _alive([*below, *_ours(duration)]), 10), [
            p.cmdline() for p in _alive([*below, *_ours(duration)])
        ]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for left in _ours(duration):
            left.kill()
        for left in _alive(below):
            left.kill()
    if sig == signal.SIGTERM and how in ("terminate", "bare", "run"):
        # Handled as Ctrl-C is: the script ends by KeyboardInterrupt (gpupool run: 130).
        assert process.returncode in (-signal.SIGINT, 130), process.returncode
    else:  # SIGKILL, or the opt-out: the process died of the signal itself
        assert process.returncode == -sig
