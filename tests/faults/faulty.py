"""Module-level task functions for the fault-injection tests (children import them by name)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

from gpupool.testing import hold


def square(i: int) -> int:
    """Return ``i * i``."""
    return i * i


def sleep_return(value: int, seconds: float) -> int:
    """Sleep, then return ``value``."""
    time.sleep(seconds)
    return value


def note_pid(directory: str, name: str) -> int:
    """Write this worker's PID to ``directory/name.pid`` (atomically); return the PID."""
    pid = os.getpid()
    final = Path(directory) / f"{name}.pid"
    temporary = final.with_suffix(".tmp")
    temporary.write_text(str(pid))
    temporary.replace(final)
    return pid


def note_pid_then_sleep(directory: str, name: str, seconds: float) -> int:
    """Write this worker's PID to a file, sleep, then return the PID."""
    pid = note_pid(directory, name)
    time.sleep(seconds)
    return pid


def note_pid_then_sleep_return(directory: str, i: int, seconds: float) -> int:
    """Write this worker's PID to ``directory/<i>.pid``, sleep, then return ``i``."""
    note_pid(directory, str(i))
    time.sleep(seconds)
    return i


def note_pid_then_wait_return(directory: str, i: int, release: str) -> int:
    """Write this worker's PID to ``directory/<i>.pid``, wait for ``release``, return ``i``."""
    note_pid(directory, str(i))
    wait_for_file(release, timeout_s=600.0)
    return i


def start_term_ignoring_children_then_wait(directory: str, i: int, release: str) -> int:
    """Start two children that ignore SIGTERM (one in this worker's group, one in a session
    of its own); write their PIDs to ``directory/<i>.child`` once both ignore it, then
    ``<i>.pid``; wait for ``release``; return ``i``."""
    import subprocess

    ready = []
    for n, own_session in enumerate((False, True)):
        mark = os.path.join(directory, f"{i}-{n}.ready")
        child = subprocess.Popen(
            ["sh", "-c", f"trap '' TERM; touch {mark}; exec sleep 600"],
            start_new_session=own_session,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # a pipe of the test's held open would hang the test
            stderr=subprocess.DEVNULL,
        )
        ready.append((child.pid, mark))
    for _, mark in ready:
        wait_for_file(mark)
    Path(directory, f"{i}.child").write_text(" ".join(str(pid) for pid, _ in ready))
    note_pid(directory, str(i))
    wait_for_file(release, timeout_s=600.0)
    return i


def hold_then_return(i: int, size: str, seconds: float) -> int:
    """Hold ``size`` simulated device bytes for ``seconds``; return ``i``."""
    with hold(size):
        time.sleep(seconds)
    return i


def sleep_then_hold(i: int, size: str, delay: float) -> int:
    """Sleep ``delay`` seconds, then hold ``size`` simulated bytes for a moment; return ``i``."""
    time.sleep(delay)
    with hold(size):
        time.sleep(0.01)
    return i


def segfault() -> None:
    """Dereference NULL: the worker dies with SIGSEGV."""
    ctypes.string_at(0)


def exit_with(code: int) -> None:
    """Leave the worker at once with exit code ``code``, skipping every cleanup."""
    os._exit(code)


def kill_self(sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to this worker."""
    os.kill(os.getpid(), sig)
    time.sleep(10)  # SIGKILL is delivered before this returns; never reached


def unpicklable_result() -> object:
    """Return a lock, which cannot be pickled to send it back."""
    return threading.Lock()


def _explode(message: str) -> object:
    raise RuntimeError(message)


class ErrorAtUnpickle:
    """Pickles fine, but unpickling it raises (as CPython's ErrorAtUnpickle in its tests)."""

    def __init__(self, message: str = "unpickling refused") -> None:
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        return _explode, (self.message,)


def identity(value: object) -> object:
    """Return ``value`` unchanged."""
    return value


def return_error_at_unpickle() -> ErrorAtUnpickle:
    """Return a result that pickles in the child but cannot be unpickled in the parent."""
    return ErrorAtUnpickle("the parent cannot rebuild this result")


class LockedError(Exception):
    """An exception that cannot be pickled: it carries a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raise_locked_error(message: str) -> None:
    """Raise an exception whose pickling fails."""
    raise LockedError(message)


class TwoArgumentError(Exception):
    """An exception that pickles, but whose unpickling fails (``__init__`` wants two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} {b}")


def raise_two_argument_error() -> None:
    """Raise an exception that the parent cannot unpickle."""
    raise TwoArgumentError("cannot", "rebuild")


class SoakError(ValueError):
    """The exception a soak task raises on purpose."""


def soak(i: int, fault: str) -> tuple[int, int] | object:
    """Return ``(i * 3, pid)``, or commit ``fault``: raise, unpicklable, exit, kill."""
    if fault == "raise":
        raise SoakError(f"task {i} raised on purpose")
    if fault == "unpicklable":
        return threading.Lock()
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    return i * 3, os.getpid()


def raise_invalid_size(text: str) -> None:
    """Raise gpupool's own InvalidSizeError, as a task parsing a size would."""
    from gpupool._core.units import parse_size

    parse_size(text, name="size")


def raise_decision_log_error(text: str) -> None:
    """Raise gpupool's DecisionLogError (keyword-only attributes) from a task."""
    from gpupool._observe.log_reader import DecisionLogError

    raise DecisionLogError(f"line 7 of {text} is not JSON", path=text, line=7)


def wait_for_file(path: str, timeout_s: float = 60.0) -> bool:
    """Block until ``path`` exists (or ``timeout_s`` passed); whether it appeared."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def start_background(directory: str, name: str) -> int:
    """Leave a background process behind, as ``os.system("... &")`` does; return its PID.

    The background shell inherits whatever descriptors the worker lets it
    inherit, and lives until ``directory/go`` exists. Its PID is written to
    ``directory/<name>.pid`` once it runs.
    """
    go = os.path.join(directory, "go")
    pidfile = os.path.join(directory, f"{name}.pid")
    os.system(
        f"sh -c 'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; "
        f"while [ ! -e {go} ]; do sleep 0.05; done' &"
    )
    while not os.path.exists(pidfile):
        time.sleep(0.01)
    return int(Path(pidfile).read_text())


def fork_background(directory: str, name: str) -> int:
    """``os.fork()`` a child that keeps every descriptor of the worker; return its PID.

    The child lives until ``directory/go`` exists (or 120 s), then leaves
    with ``os._exit``.
    """
    go = os.path.join(directory, "go")
    pid = os.fork()
    if pid == 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    return pid


def hold_the_gil(directory: str) -> None:
    """Note this worker's PID, then backtrack in a regex: C code that never releases the GIL."""
    import re

    note_pid(directory, "worker")
    re.match(r"(a+)+$", "a" * 64 + "b")


class CountsPickles:
    """A payload that counts, in the process that pickles it, how often it was pickled."""

    pickled = 0

    def __init__(self, size: int = 0) -> None:
        self.data = b"x" * size

    def __reduce__(self) -> tuple[object, ...]:
        type(self).pickled += 1
        return _rebuild_counts_pickles, (len(self.data),)


def _rebuild_counts_pickles(size: int) -> CountsPickles:
    return CountsPickles(size)


def size_of(value: CountsPickles) -> int:
    """Return the size of a CountsPickles payload."""
    return len(value.data)


def upper_all(lines: list[str]) -> list[str]:
    """Upper-case every line."""
    return [line.upper() for line in lines]


def no_devices() -> object:
    """A sensor for a host without a driver and with 2 CPUs: a host-bounded pool, no readings."""
    from gpupool._core.census import HostCensus
    from gpupool._errors import NoDriverError
    from gpupool._sensors.base import Sensor

    class NoDevices(Sensor):
        name = "none"

        def read_devices(self) -> tuple[()]:
            raise NoDriverError("no driver on this test host")

        def read_host(self) -> HostCensus:
            return HostCensus(cpus=2, available_ram_bytes=64 * 2**30)

    return NoDevices()


def die_when_told(go: str, how: str) -> None:
    """An initializer: wait for ``go`` to exist, then end this worker before it is ready.

    ``how``: ``"exit"`` leaves with ``os._exit(3)``; ``"segv"`` sends this
    process SIGSEGV, as a failed CUDA initialisation can.
    """
    wait_for_file(go)
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)  # the signal is delivered before this returns; never reached


_held_for_life: list[object] = []


def hold_for_life(size: str) -> None:
    """An initializer: hold ``size`` simulated device bytes until the worker exits (a model
    loaded in the initializer)."""
    held = hold(size)
    held.__enter__()
    _held_for_life.append(held)
