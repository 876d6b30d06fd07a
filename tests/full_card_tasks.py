"""Tasks whose subprocess fails silently (exit status 1, nothing on stderr) after the card refused
its allocation, or on a card with room (children import them by name)."""

from __future__ import annotations

import subprocess
import sys

#: A child that waits (at most 60 s) until two have started, then holds ``argv[1]`` until two
#: hold or one was refused. A refused one exits with status 1 and says nothing, as a program
#: that swallows its framework's error does. A child started after a refusal (a retry) waits
#: until no other holds, so it has the card's room.
_SILENT_PAIR = """
import pathlib, sys, time
import gpupool.testing as gt
gate, me = pathlib.Path(sys.argv[2]), sys.argv[3]

def wait_until(done):
    deadline = time.monotonic() + 60
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)

refused = lambda: bool(list(gate.glob("refused-*")))
(gate / f"started-{me}").touch()
wait_until(lambda: len(list(gate.glob("started-*"))) >= 2 or refused())
if refused():
    wait_until(lambda: not list(gate.glob("holding-*")))
try:
    with gt.hold(sys.argv[1]):
        (gate / f"holding-{me}").touch()
        wait_until(lambda: len(list(gate.glob("holding-*"))) >= 2 or refused())
    (gate / f"holding-{me}").unlink()
except gt.SimulatedOutOfMemory:
    (gate / f"refused-{me}").touch()
    sys.exit(1)
print("held", me)
"""

#: A child that holds ``argv[1]`` and exits with status 1, saying nothing.
_SILENT_FAILURE = """
import sys
import gpupool.testing as gt
with gt.hold(sys.argv[1]):
    pass
sys.exit(1)
"""


def silent_pair(i: int, size: str, gate: str) -> int:
    """Hold ``size`` in a child, two children at once (``_SILENT_PAIR``); a refused child's
    exit status is the task's ``CalledProcessError``, with no output to recognise."""
    subprocess.run([sys.executable, "-c", _SILENT_PAIR, size, gate, str(i)], check=True)
    return i


def silent_failure(size: str) -> int:
    """Hold ``size`` in a child that then exits 1 without a word: the task fails with a
    ``CalledProcessError``."""
    subprocess.run([sys.executable, "-c", _SILENT_FAILURE, size], check=True)
    return 0


def pair_script() -> str:
    """The text of ``_SILENT_PAIR``, for a command (``gpupool run``)."""
    return _SILENT_PAIR


def torch_then_error(nbytes: int) -> int:
    """Allocate ``nbytes`` through the stand-in torch (the worker's own framework, which raises
    its own out-of-memory when refused), give it back, then fail with an error that has
    nothing to do with memory. No process is started."""
    cuda = sys.modules["torch"].cuda
    cuda.allocate(nbytes)
    cuda.free(nbytes)
    raise ValueError("row 7 of the input is malformed")
