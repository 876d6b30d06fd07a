"""Tasks for the queued-behind tests: one function (one key), whose action the test picks."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

from gpupool.testing import SimulatedOutOfMemory, hold

PATIENCE_S = 60.0


def _wait(path: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def _exit_at_next_read(frame: types.FrameType, event: str, _arg: object) -> None:
    """A profile hook: the process exits when it next starts to read a message."""
    if event == "call" and frame.f_code.co_name == "read_frame":
        os._exit(5)


def _mark_at_next_read(path: str) -> None:
    """Set a profile hook: ``path`` is created when the worker next starts to read a message
    (after it has answered the task that set it)."""

    def hook(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "read_frame":
            sys.setprofile(None)
            Path(path).touch()

    sys.setprofile(hook)


def _wait_at_next_read(path: str) -> None:
    """Set a profile hook: the worker, when it next starts to read a message (after it has
    answered the task that set it), waits until ``path`` exists."""

    def hook(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "read_frame":
            sys.setprofile(None)
            _wait(path)

    sys.setprofile(hook)


def step(action: str, path: str = "") -> int:
    """``ok``: return at once. ``mark``: create ``path`` and return. ``wait``: return once
    ``path`` exists. ``die``: exit the worker
    once it exists. ``oom``: once it exists, allocate more than the card has. ``oom-small``:
    once it exists, raise the card's out-of-memory for 8 GiB. ``oom-then-exit``: as
    ``oom-small``, and the worker then exits before it reads its next message.
    ``oom-then-hold``: as ``oom-small``, and the worker then waits for ``path`` +
    ``"-release"`` before it reads its next message.
    ``mark-after-answer``: return, and create ``path`` once the answer is sent (when the
    worker next reads); ``raise-then-mark``: the same, raising ``ValueError``. Every task
    that returns answers its worker's PID."""
    if action == "ok":
        return os.getpid()
    if action == "mark-after-answer":
        _mark_at_next_read(path)
        return os.getpid()
    if action == "raise-then-mark":
        _mark_at_next_read(path)
        raise ValueError("raise-then-mark")
    if action == "mark":
        Path(path).touch()
        return os.getpid()
    _wait(path)
    if action == "die":
        os._exit(3)
    if action == "oom":
        with hold("64GiB"):
            pass
    if action == "oom-then-exit":
        sys.setprofile(_exit_at_next_read)
        action = "oom-small"
    if action == "oom-then-hold":
        _wait_at_next_read(path + "-release")
        action = "oom-small"
    if action == "oom-small":
        raise SimulatedOutOfMemory(
            device=0, requested_bytes=8 << 30, used_bytes=40 << 30, total_bytes=40 << 30
        )
    return os.getpid()
