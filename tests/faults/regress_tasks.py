"""Task functions for the review regressions (children import them by name)."""

from __future__ import annotations

import time
from pathlib import Path

from gpupool.testing import hold


def hold_after(i: int, size: str, delay_s: float, hold_s: float, linger_s: float = 0.0) -> int:
    """Wait, hold ``size`` for a while; on failure linger before the error leaves the task."""
    time.sleep(delay_s)
    try:
        with hold(size):
            time.sleep(hold_s)
    except Exception:
        time.sleep(linger_s)
        raise
    return i


def sleep_for(seconds: float) -> float:
    """Sleep, then return the seconds slept."""
    time.sleep(seconds)
    return seconds


class BadStrError(Exception):
    """An exception whose own ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def raise_bad_str() -> None:
    """Raise an exception that cannot be turned into text."""
    raise BadStrError()


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def survive_sigterm(directory: str) -> bool:
    """Outlive SIGTERM: note each one in ``directory/sigterm`` and go on. Say ``ready`` once
    the handler is in place; return when ``release`` exists (only SIGKILL ends it sooner)."""
    import signal

    folder = Path(directory)
    signal.signal(signal.SIGTERM, lambda signum, frame: (folder / "sigterm").touch())
    (folder / "ready").touch()
    _wait_for(folder / "release", timeout_s=600.0)
    return True


def tell_and_wait(ready: str, release: str) -> bool:
    """Say ``ready``, then wait until ``release`` exists; whether it did."""
    Path(ready).touch()
    _wait_for(Path(release), timeout_s=600.0)
    return Path(release).exists()


def hold_when_told(i: int, size: str, ready: str, go: str) -> int:
    """Say ``ready``, wait for ``go``, then hold ``size`` for a moment; return ``i``."""
    Path(ready).touch()
    _wait_for(Path(go))
    with hold(size):
        time.sleep(0.01)
    return i


def hold_until_told(i: int, size: str, ready: str, release: str) -> int:
    """Hold ``size``, say ``ready``, and keep holding until ``release`` exists; return ``i``."""
    with hold(size):
        Path(ready).touch()
        _wait_for(Path(release))
    return i


def hold_and_say_sent(size: str, sent: str) -> int:
    """Hold ``size`` a moment and return the worker's PID; a thread touches ``sent`` once the
    answer is sent (the worker's main thread is back reading its next frame)."""
    import os
    import sys
    import threading

    main = threading.main_thread().ident

    def watch() -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code.co_name != "read_frame":
                frame = frame.f_back
            if frame is not None:
                Path(sent).touch()
                return
            time.sleep(0.005)

    with hold(size):
        time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    return os.getpid()


def exit_when_told(pid: str, go: str) -> None:
    """Write the worker's PID to ``pid``, wait for ``go``, then end the worker at once."""
    import os

    Path(pid).write_text(str(os.getpid()))
    _wait_for(Path(go), timeout_s=600.0)
    os._exit(3)


def hold_then_raise(size: str) -> None:
    """Hold ``size`` a moment, then raise ValueError."""
    with hold(size):
        time.sleep(0.01)
    raise ValueError(f"raised after holding {size}")
