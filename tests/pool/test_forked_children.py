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

#: SIGTERM tripped (as the signal's C handler does, in whichever thread the kernel chose)
#: by a hook that runs among the parent's at-fork hooks, after ``logging``'s: before, its
#: handler raised in gpupool's own hook, where ``KeyboardInterrupt`` was printed and
#: ignored, before the hook unblocked SIGTERM, which the main thread then kept blocked.
_SIGTERM_WHILE_THE_PARENT_FORKS = """
import _thread
import functools
import logging
import os
import signal
import warnings

# 3.12+ warns of a fork in a process with threads; shown, its printing (Python code) would
# take the KeyboardInterrupt, and os.fork() drops it (with or without gpupool).
warnings.filterwarnings("ignore", category=DeprecationWarning)
os.register_at_fork(after_in_parent=functools.partial(_thread.interrupt_main, signal.SIGTERM))

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

if __name__ == "__main__":
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1) as ex:
            assert ex.submit(abs, -3).result() == 3
            try:
                if os.fork() == 0:
                    os._exit(0)
                where = "nowhere"
            except KeyboardInterrupt:
                where = "fork"
            os.wait()
            held = signal.pthread_sigmask(signal.SIG_BLOCK, set())
            print(where, signal.SIGTERM in held)
"""

#: SIGTERM tripped by a profile hook as soon as gpupool's before-fork hook has blocked it
#: (the signal can come at any time): before, ``KeyboardInterrupt`` left that hook after
#: it had blocked SIGTERM but before it noted so; nothing unblocked it, in the parent or
#: in the child (which ``Pool.terminate`` then could not end).
_SIGTERM_AS_THE_FORK_BLOCKS_IT = """
import _signal
import _thread
import os
import signal
import sys
import warnings

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

warnings.filterwarnings("ignore", category=DeprecationWarning)  # as above


def _sigterm_in_before_hook(frame, event, arg):
    if event == "c_return" and arg is _signal.pthread_sigmask and _sigterm_held():
        caller = frame.f_back
        if caller is not None and caller.f_code.co_name == "_before_fork":
            sys.setprofile(None)
            _thread.interrupt_main(signal.SIGTERM)


def _sigterm_held():
    return signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())


if __name__ == "__main__":
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1) as ex:
            assert ex.submit(abs, -3).result() == 3
            reader, writer = os.pipe()
            try:
                sys.setprofile(_sigterm_in_before_hook)
                if os.fork() == 0:
                    sys.setprofile(None)
                    os.write(writer, b"%d" % _sigterm_held())
                    os._exit(0)
                where = "nowhere"
            except KeyboardInterrupt:
                where = "fork"
            finally:
                sys.setprofile(None)
            os.wait()
            print(where, _sigterm_held(), os.read(reader, 1) == b"1")
"""

#: Forked children that end by returning (a ``Process``'s target, a ``Pool`` worker retired
#: by ``maxtasksperchild``) run the interpreter's thread-exit hooks: before, gpupool's there
#: waited for the copied pools' dispatcher threads, which a forked child does not have.
_FORKED_CHILDREN_THAT_RETURN = """
import multiprocessing

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


def nothing():
    pass


if __name__ == "__main__":
    fork = multiprocessing.get_context("fork")
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1) as ex:
            assert ex.submit(abs, -3).result() == 3
            child = fork.Process(target=nothing)
            child.start()
            child.join(30)
            print("process", child.exitcode, flush=True)
            if child.exitcode is None:
                child.kill()
            with fork.Pool(1, maxtasksperchild=1) as retiring:
                print("pool", retiring.map(abs, [-1, -2, -3], chunksize=1), flush=True)
            assert ex.submit(abs, -4).result() == 4
"""


#: A child of ``os.fork()`` that leaves the ``with`` block itself: before, its exit waited for
#: the copied pool's dispatcher thread, which the child does not have, and so did whoever
#: waited for the child. Here it also tries the pool's other calls.
_A_FORK_THAT_LEAVES_THE_BLOCK = """
import os

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

if __name__ == "__main__":
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1) as ex:
            assert ex.submit(abs, -3).result() == 3
            workers = sorted(ex._processes)
            pid = os.fork()
            if pid == 0:
                try:
                    ex.submit(abs, -1)
                except RuntimeError as exc:
                    print("submit:", "is a fork of it" in str(exc), flush=True)
                ex.kill_workers()
                ex.terminate_workers()
                ex.shutdown(wait=True)
            else:
                _, status = os.waitpid(pid, 0)
                print("child:", os.waitstatus_to_exitcode(status), flush=True)
                assert ex.submit(abs, -4).result() == 4
                print("same workers:", sorted(ex._processes) == workers, flush=True)
        if pid == 0:
            print("child left the block", flush=True)
            os._exit(0)
"""


#: A done-callback runs on the pool's dispatcher thread: a child forked there runs on a copy
#: of that thread. One child leaves by ``sys.exit()``, the other returns from the callback:
#: before, ``SystemExit`` crashed the copied dispatcher, whose clean-up told the parent's
#: workers to stop, waited for them 10 s and wrote the parent's decision log; the child that
#: returned went on with the copied loop, on the parent's workers' sockets, for good.
_A_FORK_IN_A_DONE_CALLBACK = """
import json
import os
import sys
import time

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

children = []


def fork_and_leave(future, how):
    pid = os.fork()
    if pid == 0:
        if how == "exit":
            sys.exit(0)
        return
    children.append(pid)


def waited(pid):
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


if __name__ == "__main__":
    log = sys.argv[1]
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1, log_path=log) as ex:
            assert ex.submit(abs, -2).result() == 2
            workers = sorted(ex._processes)
            for how in ("exit", "return"):
                future = ex.submit(abs, -3)
                future.add_done_callback(lambda f, how=how: fork_and_leave(f, how))
                assert future.result() == 3
                while len(children) < 1 + (how == "return"):
                    time.sleep(0.01)
                print(how, waited(children[-1]), flush=True)
            assert ex.submit(abs, -4).result() == 4
            print("same workers:", sorted(ex._processes) == workers, flush=True)
    with open(log) as records:
        events = [json.loads(line)["event"] for line in records]
    print("shutdown records:", events.count("shutdown"), flush=True)
"""


#: A child of ``os.fork()`` that ends by ``sys.exit()``: ``multiprocessing``'s exit hook
#: joined the parent's workers, which it listed as the child's own, and printed
#: ``AssertionError: can only join a child process`` (the standard pool's workers do too).
_A_FORK_THAT_EXITS = """
import os
import sys

from gpupool import GpuPoolExecutor

if __name__ == "__main__":
    with GpuPoolExecutor(max_workers=1) as ex:
        assert ex.submit(abs, -3).result() == 3
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child:", os.waitstatus_to_exitcode(status), flush=True)
        assert ex.submit(abs, -4).result() == 4
"""


def _run(tmp_path: Path, script_text: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(script_text)
    try:
        return subprocess.run(
            [sys.executable, str(script), *args],
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


def test_sigterm_that_reaches_the_parent_as_it_forks_interrupts_it(tmp_path: Path) -> None:
    # The handler holds off while the fork is under way, and the SIGTERM comes as os.fork()
    # returns; the main thread does not keep SIGTERM blocked.
    done = _run(tmp_path, _SIGTERM_WHILE_THE_PARENT_FORKS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "False"], done.stderr


def test_sigterm_as_the_fork_blocks_it_leaves_it_blocked_nowhere(tmp_path: Path) -> None:
    done = _run(tmp_path, _SIGTERM_AS_THE_FORK_BLOCKS_IT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "False", "False"], done.stderr


def test_forked_children_that_return_beside_an_open_pool_exit(tmp_path: Path) -> None:
    done = _run(tmp_path, _FORKED_CHILDREN_THAT_RETURN)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["process 0", "pool [1, 2, 3]"], done.stderr


def test_a_forked_child_that_leaves_the_block_exits_and_leaves_the_pool_alone(
    tmp_path: Path,
) -> None:
    # In the child the pool is its parent's: submit raises, kill_workers, terminate_workers,
    # shutdown and the block's end return at once, and the parent's workers go on.
    done = _run(tmp_path, _A_FORK_THAT_LEAVES_THE_BLOCK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "submit: True",
        "child left the block",
        "child: 0",
        "same workers: True",
    ], done.stderr


def test_a_child_forked_in_a_done_callback_leaves_the_parents_pool_alone(
    tmp_path: Path,
) -> None:
    # The copied dispatcher thread ends with the child's callback: nothing of the pool's
    # clean-up runs in the child, and the parent's workers and log are its own.
    done = _run(tmp_path, _A_FORK_IN_A_DONE_CALLBACK, str(tmp_path / "decisions.jsonl"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "exit 0",
        "return 0",
        "same workers: True",
        "shutdown records: 1",
    ], done.stderr
    assert "dispatcher thread crashed" not in done.stderr, done.stderr


def test_a_forked_child_that_exits_prints_nothing_of_the_parents_workers(
    tmp_path: Path,
) -> None:
    # In the child the pool's workers are not its children: its exit neither joins them
    # nor prints a traceback for them.
    done = _run(tmp_path, _A_FORK_THAT_EXITS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["child: 0"], done.stderr
    assert done.stderr == ""
