"""Task functions whose device bytes live in processes they start (children import them by name)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from typing import Any

#: The child a task starts: hold ``argv[1]`` on the simulated card (the same
#: ledger, found through the inherited GPUPOOL_SIMULATOR), say so on stdout,
#: and then either exit or wait until stdin closes.
_CHILD = """
import sys
from gpupool.testing import hold
with hold(sys.argv[1]):
    print("held", flush=True)
    if sys.argv[2] == "stay":
        sys.stdin.read()
"""

#: Children left running by a task, kept so they are not closed by collection.
LEFT: list[subprocess.Popen[str]] = []


def in_a_subprocess(size: str) -> int:
    """Hold ``size`` in a child process that exits before the task returns; return its PID."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, size, "exit"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "held", done.stderr
    return 0


def rss_in_a_subprocess(mib: int) -> int:
    """Fill ``mib`` MiB of host memory in a child that exits; return this worker's own RSS peak
    (its ``VmHWM``: its ``ru_maxrss`` holds its pool's process's, which its exec replaced)."""
    subprocess.run(
        [sys.executable, "-c", f"data = b'x' * ({mib} << 20)"],
        check=True,
    )
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def leave_a_subprocess(size: str) -> int:
    """Start a child that holds ``size``, wait until it holds it, and return with it running.

    Returns the child's PID. It stays until its stdin closes (when this
    worker exits, or the test kills it).
    """
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, size, "stay"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    LEFT.append(child)
    return child.pid


def _hold_together(size: str, barrier: Any) -> None:
    """Hold ``size`` until every process of ``barrier`` holds its own."""
    from gpupool.testing import hold

    with hold(size):
        barrier.wait()


def in_spawned_processes(size: str, count: int) -> list[int | None]:
    """Hold ``size`` in each of ``count`` processes started with the ``spawn`` start method
    (as ``torch.multiprocessing.spawn`` starts them), all at once; return their exit codes."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(count)
    processes = [context.Process(target=_hold_together, args=(size, barrier)) for _ in range(count)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return [process.exitcode for process in processes]


def torch_and_a_subprocess(torch_bytes: int, size: str) -> int:
    """Allocate ``torch_bytes`` with the worker's torch (the stand-in, charged on the simulated
    card), then hold ``size`` in a child that exits before the task returns."""
    cuda = sys.modules["torch"].cuda
    cuda.allocate(torch_bytes)
    in_a_subprocess(size)
    cuda.free(torch_bytes)
    return 0


#: A daemon, double-forked: the first child forks and exits at once, so the second is an
#: orphan before it allocates; it holds ``argv[1]``, says so, and waits until stdin closes.
_DAEMON = """
import os
import sys
if os.fork():
    os._exit(0)
os.setsid()
from gpupool.testing import hold
with hold(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def in_a_double_forked_daemon(size: str) -> int:
    """Hold ``size`` in a double-forked daemon, then let it go (it exits once its stdin,
    which it shares with the first child, closes)."""
    starter = subprocess.Popen(
        [sys.executable, "-c", _DAEMON, size],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None and starter.stdin is not None
    assert starter.stdout.readline().strip() == "held"
    assert starter.wait() == 0  # the first child exited: the daemon is an orphan
    starter.stdin.close()  # the daemon lets go and exits
    starter.stdout.close()
    return 0


#: A child that waits (at most 60 s) until three have started, then holds ``argv[1]`` until
#: three hold or one was refused; a refused one fails with the simulator's out-of-memory
#: traceback on its stderr, as a framework's child would.
_TOGETHER = """
import pathlib, sys, time
import gpupool.testing as gt
gate = pathlib.Path(sys.argv[2])

def wait_for(pattern):
    deadline = time.monotonic() + 60
    while len(list(gate.glob(pattern))) < 3 and time.monotonic() < deadline:
        if list(gate.glob("refused-*")):
            return
        time.sleep(0.01)

(gate / f"started-{sys.argv[3]}").touch()
wait_for("started-*")
try:
    with gt.hold(sys.argv[1]):
        (gate / f"holding-{sys.argv[3]}").touch()
        wait_for("holding-*")
except gt.SimulatedOutOfMemory:
    (gate / f"refused-{sys.argv[3]}").touch()
    raise
"""


def in_a_subprocess_together(i: int, size: str, gate: str) -> int:
    """Hold ``size`` in a child, three children at once (see ``_TOGETHER``); the child's
    failure is the task's ``CalledProcessError``, its stderr captured."""
    subprocess.run(
        [sys.executable, "-c", _TOGETHER, size, gate, str(i)],
        capture_output=True,
        check=True,
    )
    return i


def hold_until_released(size: str, gate: str) -> int:
    """Hold ``size`` in this worker, say so (``gate/ready-<pid>``), and keep it until
    ``gate/go`` exists (at most 60 s)."""
    import os
    import pathlib
    import time

    from gpupool.testing import hold

    gate_dir = pathlib.Path(gate)
    with hold(size):
        (gate_dir / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + 60
        while not (gate_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return 0


def orphan_shells(count: int) -> int:
    """Start ``count`` shells that each start ``true`` in the background and exit at once: each
    ``true`` is orphaned to the worker (a child subreaper) and exits soon after. Return the
    worker's PID."""
    for _ in range(count):
        subprocess.run(["sh", "-c", "true & exit 0"], check=True)
    return os.getpid()


#: A child a task started and left for a later task to wait for.
WAITING: list[subprocess.Popen[bytes]] = []


def start_and_keep(code: int) -> int:
    """Start a child that exits with status ``code`` and keep its ``Popen`` unwaited; its PID."""
    WAITING.append(subprocess.Popen(["sh", "-c", f"exit {code}"]))
    return WAITING[-1].pid


def wait_kept() -> int:
    """Wait for the child :func:`start_and_keep` left; its exit status."""
    return WAITING.pop().wait()


def nothing() -> int:
    """Start no process."""
    return 0


def children_states(pid: int) -> list[str]:
    """The states (``R``, ``S``, ``Z`` ...) of ``pid``'s children, from ``/proc``."""
    states = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            states.append(fields[0])
    return states
