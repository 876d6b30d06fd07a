"""Faults in the parent: SIGKILL, Ctrl-C during map, and shutdown(wait=False) at interpreter exit.

Each case runs a small script in its own session (so a signal to its
process group reaches its workers, as Ctrl-C does, and never this test
process). Its tasks write their worker PIDs to files, so the test can check
that no worker outlives the script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from leakguard import exited, wait_until

pytestmark = pytest.mark.faults

HERE = Path(__file__).resolve().parent

PROLOGUE = """\
import atexit, os, signal, sys, threading, time
import faulty
from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

directory = sys.argv[1]


def started():
    return sorted(int(n[:-4]) for n in os.listdir(directory) if n.endswith(".pid"))


def host():
    return SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB")
"""


def _start(tmp_path: Path, body: str) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "script.py"
    script.write_text(PROLOGUE + textwrap.dedent(body))
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TMPDIR"] = str(tmp_path)  # the simulated host's ledger, left behind by a SIGKILL
    env.pop("GPUPOOL_SIMULATOR", None)
    process = subprocess.Popen(
        [sys.executable, str(script), str(pids)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    return process, pids


def _start_four_never_released(tmp_path: Path, task: str) -> tuple[subprocess.Popen[str], Path]:
    """The script submits four of ``faulty``'s ``task`` to two workers, each waiting on a file
    never created, and waits inside ``with`` for the first."""
    return _start(
        tmp_path,
        f"""
        never = os.path.join(directory, "never-released")
        with host():
            with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
                task = faulty.{task}
                futures = [ex.submit(task, directory, i, never) for i in range(4)]
                futures[0].result()
        """,
    )


def _worker_pids(pids: Path) -> set[int]:
    return {int(p.read_text()) for p in pids.glob("*.pid")}


def _finish(process: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the script hung for {timeout} s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")


def _assert_workers_exit(pids: set[int], within_s: float) -> None:
    assert pids
    assert wait_until(lambda: all(exited(pid) for pid in pids), within_s), {
        pid: psutil.Process(pid).status() for pid in pids if not exited(pid)
    }


def test_parent_sigkilled_its_workers_exit_within_5_s(tmp_path: Path):
    """A parent killed with SIGKILL leaves no orphan: every worker exits within 5 s."""
    process, pids = _start(
        tmp_path,
        """
        with host():
            ex = GpuPoolExecutor(max_workers=2, task_peak="1GiB")
            futures = [
                ex.submit(faulty.note_pid_then_sleep_return, directory, i, 120.0) for i in range(4)
            ]
            while len(started()) < 2:
                time.sleep(0.01)
            print("running", flush=True)
            time.sleep(120)
        """,
    )
    try:
        assert wait_until(lambda: len(_worker_pids(pids)) >= 2, 60), process.poll()
        workers = _worker_pids(pids)
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert workers <= {p.pid for p in descendants}
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        killed_at = time.monotonic()
        _assert_workers_exit(workers, 5.0)
        took = time.monotonic() - killed_at
        # loky's and multiprocessing's resource trackers go too (they read EOF).
        _assert_workers_exit({p.pid for p in descendants}, 5.0)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert took < 5.0


def test_shutdown_wait_false_completes_at_interpreter_exit(tmp_path: Path):
    """shutdown(wait=False), then the script ends: every task still runs, and no worker is left."""
    process, pids = _start(
        tmp_path,
        """
        results = []
        atexit.register(lambda: print("results", sorted(results), flush=True))
        simulated = host().__enter__()
        atexit.register(simulated.__exit__, None, None, None)
        ex = GpuPoolExecutor(max_workers=2, task_peak="1GiB")
        for i in range(6):
            future = ex.submit(faulty.note_pid_then_sleep_return, directory, i, 0.3)
            future.add_done_callback(lambda f: results.append(f.result()))
        ex.shutdown(wait=False)
        print("main done", flush=True)
        """,
    )
    started = time.monotonic()
    out, err = _finish(process, 60)
    took = time.monotonic() - started
    assert process.returncode == 0, err
    assert "main done" in out
    assert "results [0, 1, 2, 3, 4, 5]" in out, (out, err)
    assert sorted(int(p.stem) for p in pids.glob("*.pid")) == list(range(6))
    assert took < 30
    _assert_workers_exit(_worker_pids(pids), 5.0)


@pytest.mark.parametrize("target", ["parent", "group"])
def test_keyboard_interrupt_during_map_exits_and_leaves_no_worker(tmp_path: Path, target: str):
    """SIGINT during list(ex.map(...)) (to the parent, or Ctrl-C to the group) ends the script."""
    process, pids = _start(
        tmp_path,
        f"""
        def interrupt():
            while len(started()) < 2:
                time.sleep(0.01)
            if {target!r} == "parent":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                os.killpg(0, signal.SIGINT)  # what Ctrl-C sends to the foreground group

        with host():
            with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
                threading.Thread(target=interrupt, daemon=True).start()
                try:
                    task = faulty.note_pid_then_sleep_return
                    list(ex.map(task, [directory] * 20, range(20), [1.0] * 20))
                except KeyboardInterrupt:
                    print("interrupted", flush=True)
                    raise
                print("map finished", flush=True)
        """,
    )
    started = time.monotonic()
    out, err = _finish(process, 60)
    took = time.monotonic() - started
    assert "interrupted" in out, (out, err[-4000:])
    assert "map finished" not in out
    assert "KeyboardInterrupt" in err
    assert process.returncode != 0
    # Only the tasks that had started ran; the others were cancelled.
    ran = sorted(int(p.stem) for p in pids.glob("*.pid"))
    assert len(ran) <= 6, ran
    assert took < 30
    _assert_workers_exit(_worker_pids(pids), 5.0)


@pytest.mark.parametrize("target", ["parent", "group"])
def test_keyboard_interrupt_in_with_stops_running_tasks(tmp_path: Path, target: str):
    """Ctrl-C inside ``with`` ends the running tasks (they would wait ten minutes): the script
    exits, the tasks not started are cancelled, and no worker is left."""
    process, pids = _start_four_never_released(tmp_path, "note_pid_then_wait_return")
    # What Ctrl-C sends to the foreground group, or a SIGINT to the parent alone.
    _interrupt_and_check_stopped(process, pids, os.kill if target == "parent" else os.killpg)


def _interrupt_and_check_stopped(
    process: subprocess.Popen[str],
    pids: Path,
    send: Callable[[int, int], None],
    sig: signal.Signals = signal.SIGINT,
    *,
    after: str | None = None,
    exits_nonzero: bool = True,
) -> None:
    """Once two tasks run (and the script wrote the file ``after`` in ``pids``, where given),
    send the script ``sig`` with ``send``: it exits with the interrupt (``exits_nonzero``:
    with a failing status), only the two tasks ever started, and their workers exit."""
    try:
        assert wait_until(lambda: len(_worker_pids(pids)) >= 2, 60), process.poll()
        if after is not None:
            assert wait_until((pids / after).exists, 60), process.poll()
        workers = _worker_pids(pids)
        send(process.pid, sig)
        # Generous: the grace is 2 s; a pool that waits for its tasks hangs for 600 s.
        _, err = _finish(process, 30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert "KeyboardInterrupt" in err, err[-4000:]
    if exits_nonzero:
        assert process.returncode != 0
    assert sorted(int(p.stem) for p in pids.glob("*.pid")) == [0, 1]
    _assert_workers_exit(workers, 5.0)


def test_keyboard_interrupt_while_the_with_block_waits_at_its_end_stops_running_tasks(
    tmp_path: Path,
):
    """Ctrl-C while ``with`` waits for the pool at its end (the commonest moment to press it)
    leaves the block as Ctrl-C inside it does: the running tasks end, the others are
    cancelled, no worker is left (a Thread.join that Ctrl-C cut short once hid the pool's
    thread, and every task ran on)."""
    process, pids = _start(
        tmp_path,
        """
        never = os.path.join(directory, "never-released")
        with host():
            with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
                for i in range(4):
                    ex.submit(faulty.note_pid_then_wait_return, directory, i, never)
        """,
    )
    _interrupt_and_check_stopped(process, pids, os.kill)


def test_sigterm_while_the_with_block_waits_at_its_end_stops_running_tasks(tmp_path: Path):
    """With ``on_interrupt="terminate"``, SIGTERM while ``with`` waits for the pool at its end
    is Ctrl-C there too: the running tasks end, no worker is left. Before, the pool counted
    as closed once its shutdown began, so SIGTERM took its default action: the script died
    at once (exit 143), its running tasks left to the workers' parent-death signal."""
    process, pids = _start(
        tmp_path,
        """
        never = os.path.join(directory, "never-released")
        with host():
            with GpuPoolExecutor(max_workers=2, task_peak="1GiB", on_interrupt="terminate") as ex:
                for i in range(4):
                    ex.submit(faulty.note_pid_then_wait_return, directory, i, never)
        """,
    )
    _interrupt_and_check_stopped(process, pids, os.kill, signal.SIGTERM)
    assert process.returncode != -signal.SIGTERM


@pytest.mark.parametrize("shut", ["shutdown(wait=False)", "left to the exit"])
def test_sigterm_while_the_exit_waits_for_the_pool_stops_running_tasks(tmp_path: Path, shut):
    """With ``on_interrupt="terminate"``, SIGTERM while the interpreter's exit waits for a
    pool's work (a script that ends after ``shutdown(wait=False)``, or leaves its work to the
    pool without shutdown) stops the running tasks. Before, sigterm's exit hook had run
    before the wait, when no SIGTERM had come: the KeyboardInterrupt cut the wait short,
    and the exit then waited for the tasks' workers for as long as the tasks ran (for ever
    here). Before SIGTERM counted a pool open until its dispatcher finished, the first case
    took SIGTERM's default action (exit 143)."""
    process, pids = _start(
        tmp_path,
        f"""
        never = os.path.join(directory, "never-released")
        ex = GpuPoolExecutor(max_workers=2, on_interrupt="terminate")
        for i in range(4):
            ex.submit(faulty.note_pid_then_wait_return, directory, i, never)
        if {shut!r} == "shutdown(wait=False)":
            ex.shutdown(wait=False)
        open(os.path.join(directory, "body-ended"), "w").close()  # its last line
        """,
    )
    # The exit ignores the KeyboardInterrupt raised in its wait: the script exits 0.
    _interrupt_and_check_stopped(
        process, pids, os.kill, signal.SIGTERM, after="body-ended", exits_nonzero=False
    )


def test_keyboard_interrupt_in_with_kills_the_tasks_children_that_ignore_sigterm(
    tmp_path: Path,
):
    """Ctrl-C inside ``with``: the running tasks' children that ignore SIGTERM (in the worker's
    group, and in a session of their own) get SIGKILL after the grace, though SIGTERM ended
    their workers at once; nothing is left running."""
    process, pids = _start_four_never_released(tmp_path, "start_term_ignoring_children_then_wait")
    children: set[int] = set()
    try:
        assert wait_until(lambda: len(_worker_pids(pids)) >= 2, 60), process.poll()
        children = {int(pid) for p in pids.glob("*.child") for pid in p.read_text().split()}
        assert len(children) == 4
        os.kill(process.pid, signal.SIGINT)
        _, err = _finish(process, 30)
        assert "KeyboardInterrupt" in err, err[-4000:]
        _assert_workers_exit(children, 5.0)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        for pid in children:  # a failed run's: not for the next test
            if not exited(pid):
                os.kill(pid, signal.SIGKILL)


def test_keyboard_interrupt_with_on_interrupt_wait_lets_running_tasks_finish(tmp_path: Path):
    """on_interrupt="wait" keeps the standard pool's exit: every task runs to its result."""
    process, pids = _start(
        tmp_path,
        """
        release = os.path.join(directory, "release")
        with host():
            with GpuPoolExecutor(max_workers=2, task_peak="1GiB", on_interrupt="wait") as ex:
                task = faulty.note_pid_then_wait_return
                futures = [ex.submit(task, directory, i, release) for i in range(4)]
                for f in futures:
                    f.add_done_callback(lambda f: print("done", f.result(), flush=True))
                futures[0].result()
        """,
    )
    try:
        assert wait_until(lambda: len(_worker_pids(pids)) >= 2, 60), process.poll()
        workers = _worker_pids(pids)
        os.kill(process.pid, signal.SIGINT)
        # The pool waits for its tasks: release them only once the script is exiting.
        (pids / "release").write_text("")
        out, err = _finish(process, 60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert "KeyboardInterrupt" in err, err[-4000:]
    assert sorted(line for line in out.splitlines() if line.startswith("done")) == [
        "done 0",
        "done 1",
        "done 2",
        "done 3",
    ]
    _assert_workers_exit(workers, 5.0)
