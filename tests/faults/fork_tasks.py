"""Task functions that fork, or write on their worker's channel (children import them by name).

A careless library forks in a task and lets its child return too; another's
child scribbles on every descriptor it inherited. These stand in for them.
"""

from __future__ import annotations

import os
import pickle
import stat
import time
from pathlib import Path


def ident(i: int) -> tuple[str, int]:
    """Return ``("ident", i)``: an ordinary task beside the forking ones."""
    return ("ident", i)


def child_returns(i: int) -> tuple[str, int]:
    """Fork; the child returns ``("fork", i)`` from the task too (nobody waits for it)."""
    if os.fork() == 0:
        return ("fork", i)
    return ("parent", i)


def child_exits(i: int) -> tuple[str, int]:
    """Fork; the child leaves at once with ``os._exit(0)``; the parent waits for it."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return ("parent", i)


def _writable_descriptors() -> list[int]:
    """This process's descriptors 3..64 that are not regular files or directories.

    Regular files are left alone: a worker's only one is the simulated card's
    ledger, a stand-in for the device, not a way to the pool.
    """
    fds = []
    # Every open descriptor, however high: a test process that holds many (the sharing
    # tests leave some) hands its workers channels past any fixed range.
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd < 3:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            fds.append(fd)
    return fds


def _scribble(fds: list[int], seed: int) -> int:
    """Write 200 pseudo-random bytes and a newline to each of ``fds``; how many took them."""
    written = 0
    rng = __import__("random").Random(seed)
    for fd in fds:
        garbage = bytes(rng.randrange(256) for _ in range(200)) + b"\n"
        try:
            os.set_blocking(fd, False)
            os.write(fd, garbage)
            written += 1
        except OSError:
            pass
    return written


def child_writes_garbage(i: int) -> tuple[str, int, bool]:
    """Fork; the child writes garbage to every descriptor it has (sockets, pipes, devices)
    and exits; the parent waits for it. Returns whether the child wrote to at least one."""
    pid = os.fork()
    if pid == 0:
        written = _scribble(_writable_descriptors(), seed=i)
        os._exit(0 if written else 1)
    _, status = os.waitpid(pid, 0)
    return ("parent", i, os.waitstatus_to_exitcode(status) == 0)


def _sockets() -> list[int]:
    """This process's socket descriptors (a worker's only one is its channel to the pool)."""
    fds = []
    # Every open descriptor, however high: a test process that holds many (the sharing
    # tests leave some) hands its workers channels past any fixed range.
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd < 3:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                fds.append(fd)
        except OSError:
            continue
    return fds


def write_on_own_channel(i: int, data: bytes) -> int:
    """Write ``data`` on this worker's channel, from the worker itself, then return ``i``."""
    for fd in _sockets():
        os.write(fd, data)
    return i


def answer_for_another_task(i: int, task_id: int) -> int:
    """Send a well-formed answer for ``task_id`` (not this task) from the worker, then
    return ``i``."""
    from gpupool._pool import wire

    for fd in _sockets():
        wire.send_answer(fd, os.getpid(), task_id, "ok", None, pickle.dumps(("forged", task_id)))
    return i


def child_answers_on_a_copy(i: int, directory: str) -> int:
    """Keep a copy of the channel's descriptor, fork, and have the child note its PID in
    ``directory/child.pid``, then send a well-formed answer on the copy (the fork guard
    poisons only the original) and exit. The parent waits for it, then returns ``i``."""
    from gpupool._pool import wire

    copies = [os.dup(fd) for fd in _sockets()]
    pid = os.fork()
    if pid == 0:
        final = Path(directory, "child.pid")
        final.with_suffix(".tmp").write_text(str(os.getpid()))
        final.with_suffix(".tmp").replace(final)
        for fd in copies:
            wire.send_answer(fd, os.getpid(), 0, "ok", None, pickle.dumps("from the child"))
        os._exit(0)
    os.waitpid(pid, 0)
    for fd in copies:
        os.close(fd)
    return i


def child_notes_pid_then_returns(i: int, directory: str) -> tuple[str, int]:
    """Fork; the child writes its PID to ``directory/<i>.pid`` and returns from the task;
    the parent returns without waiting."""
    if os.fork() == 0:
        final = Path(directory, f"{i}.pid")
        final.with_suffix(".tmp").write_text(str(os.getpid()))
        final.with_suffix(".tmp").replace(final)
        return ("fork", i)
    return ("parent", i)


def child_scribbles_later(directory: str) -> int:
    """Keep a copy of the channel's descriptor and fork a child that, once
    ``directory/go`` exists, writes garbage on the copy, notes ``directory/done`` and
    exits; return the worker's PID at once (the worker is idle when the garbage comes)."""
    copies = [os.dup(fd) for fd in _sockets()]
    go, done = Path(directory, "go"), Path(directory, "done")
    if os.fork() == 0:
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for fd in copies:
            os.write(fd, b"\x00\x00\x01\x00" + b"late garbage" * 30)
        done.touch()
        os._exit(0)
    for fd in copies:
        os.close(fd)
    return os.getpid()


#: Sockets a task keeps open after it returned (a library's connection, say).
_KEPT: list[object] = []


def reuse_channel_number(i: int) -> tuple[str, int]:
    """Put one end of a socket pair of the task's own on the number of the worker's channel
    (as ``os.closerange`` then a new connection does) and keep both ends open; return."""
    import socket

    mine, other = socket.socketpair()
    _KEPT.extend([mine, other])
    for fd in _sockets():
        if fd not in (mine.fileno(), other.fileno()):
            os.dup2(mine.fileno(), fd)
    return ("reused", i)
