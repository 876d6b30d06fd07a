"""Watching a worker process, and ending its whole tree (process layer).

A worker's death is read from the process itself, not from a pipe: its
sentinel and the worker's socket are file descriptors that a task's own
child can inherit (``os.fork``, ``os.system``), and then neither reports
the worker's exit until that grandchild exits too. On Linux 5.3 and later
a *pidfd* (:func:`os.pidfd_open`) becomes readable when the process
exits, whoever holds its pipes; the dispatcher's selector watches it.
Elsewhere the watch falls back to the process's sentinel, and the dispatcher
polls ``waitpid`` as well (:data:`POLL_WITHOUT_PIDFD_S`), so a held pipe
delays the news by that much at most.

Each worker puts itself in a process group of its own at start
(:func:`gpupool._pool.worker.worker_main`), so the children its tasks start
share the worker's group; :func:`signal_tree` signals the group, and every
descendant found by walking ``/proc`` (a child that made a session or group
of its own), so ``terminate_workers()``/``kill_workers()`` leave nothing
running.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterable
from typing import Any

import psutil

__all__ = [
    "POLL_WITHOUT_PIDFD_S",
    "ProcessWatch",
    "end_tree",
    "is_stopped",
    "kill_left_after",
    "signal_tree",
    "trees_below",
]

#: Without pidfds, how often the dispatcher asks ``waitpid`` whether a worker exited.
POLL_WITHOUT_PIDFD_S = 0.1

#: Whether this platform has pidfds at all (Linux 5.3+, Python 3.9+).
HAVE_PIDFD = hasattr(os, "pidfd_open")


class ProcessWatch:
    """One worker process: a descriptor that is readable once it exited, and its exit code."""

    __slots__ = ("fd", "pidfd", "process")

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pidfd: int | None = None
        if HAVE_PIDFD:
            try:
                self.pidfd = os.pidfd_open(process.pid)
            except OSError:  # ENOSYS on an older kernel, or the process is already gone
                self.pidfd = None
        self.fd: int = self.pidfd if self.pidfd is not None else process.sentinel

    def exitcode(self) -> int | None:
        """The exit code once the process exited (reaping it), else ``None``; never blocks."""
        code: int | None = self.process.exitcode  # waitpid(WNOHANG) through its Popen
        return code

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` seconds for the process to exit; its exit code or ``None``."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.exitcode()
            if code is not None:
                return code
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], left)
            else:
                # The sentinel may be held open by a grandchild: poll as well.
                select.select([self.fd], [], [], min(left, POLL_WITHOUT_PIDFD_S))

    def close(self) -> None:
        """Give the pidfd back (the sentinel is closed with its process object)."""
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to process ``pid``, its process group if it leads one, and its descendants.

    Call it before ``pid`` is reaped: until then its PID (and its group's ID)
    cannot be reused, so nothing else is signalled.
    """
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        leads_group = os.getpgid(pid) == pid
    except OSError:
        leads_group = False
    if leads_group:
        try:
            os.killpg(pid, sig)
        except OSError:
            pass
    try:
        os.kill(pid, sig)
    except OSError:
        pass
    for child in descendants:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass


def trees_below(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes below the workers ``pids`` (not the workers themselves, whom their
    dispatcher reaps): their descendants, and the other members of their process groups."""
    roots = set(pids)
    found: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            found.update((p.pid, p) for p in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    try:
        pids = psutil.pids()
    except OSError:  # no descriptor left to list /proc with (EMFILE): the descendants only
        pids = []
    for pid in pids:  # a background process whose parent exited: only its group
        try:
            if pid not in roots and pid not in found and os.getpgid(pid) in roots:
                found[pid] = psutil.Process(pid)
        except (OSError, psutil.Error):
            continue
    return [p for pid, p in found.items() if pid not in roots]


def end_tree(pid: int, grace_s: float) -> None:
    """End every process below ``pid`` (:func:`trees_below`): SIGTERM and SIGCONT (a stopped
    one takes its SIGTERM then), SIGKILL to those left after ``grace_s``, and to any found
    below it then (a child forked meanwhile, an orphan re-parented to a subreaper)."""
    below = trees_below([pid])
    for sig in (signal.SIGTERM, signal.SIGCONT):
        for process in below:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass
    kill_left_after(below, time.monotonic() + grace_s)
    for process in trees_below([pid]):
        try:
            process.kill()
        except psutil.Error:
            pass


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP: state ``T``; a
    debugger's stop, ``t``, is not counted); ``False`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The state follows the command's name, which may hold any byte but ``)``'s last.
            return stat.read().rpartition(b")")[2][:3] == b" T "
    except OSError:
        pass
    if os.path.isdir("/proc"):
        return False  # /proc is there but could not be read now (EMFILE): not known stopped
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_STOPPED)
    except (psutil.Error, OSError):
        return False


def kill_left_after(processes: list[psutil.Process], deadline_s: float) -> None:
    """Wait until ``deadline_s`` (``time.monotonic()``) for ``processes`` to exit, then SIGKILL
    those left; at once when interrupted. psutil checks each one is the process it was (its
    start time), so a PID reused meanwhile is never signalled."""
    left = processes
    try:
        while left and time.monotonic() < deadline_s:
            left = [p for p in left if _running(p)]
            if left:
                time.sleep(_LEFT_POLL_S)
    finally:
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass


#: How often :func:`kill_left_after` looks whether the processes it waits for exited.
_LEFT_POLL_S = 0.02


def _running(process: psutil.Process) -> bool:
    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
