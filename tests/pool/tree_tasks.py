"""Task functions whose device bytes live in processes they start (children import them by name)."""

from __future__ import annotations

import resource
import subprocess
import sys

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
    """Fill ``mib`` MiB of host memory in a child that exits; return this worker's own RSS peak."""
    subprocess.run(
        [sys.executable, "-c", f"data = b'x' * ({mib} << 20)"],
        check=True,
    )
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
