"""Leak checks for the fault-injection suite: processes, zombies and file descriptors."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import psutil

from gpupool import GpuPoolExecutor


def fd_count() -> int:
    """This process's open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def exited(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie has exited: the kernel has freed its memory)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def exited_unreaped(pid: int) -> bool:
    """Whether the child ``pid`` has exited, all its threads, and waits to be reaped: what
    the pool's own watch (a pidfd, or ``waitid``) sees. Its main thread shows as a zombie in
    ``/proc`` earlier, while its other threads still exit; a pool that looks then does not
    see the exit yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped already


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited and been reaped (no process, not even a zombie)."""
    if not psutil.pid_exists(pid):
        return True
    try:
        psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return True
    return False


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds have passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)


class LeakGuard:
    """Counts descriptors and child processes before a pool exists; checks them after shutdown.

    The fd slack is zero: the only descriptors a pool's first use leaves open
    for the life of the process are the pipes to loky's and multiprocessing's
    resource trackers, and the session fixture ``_process_lifetime_resources``
    opens those before any guard counts. Everything else a pool opens (its
    wake-up pipe, its selector, one pipe and one sentinel per worker, the
    simulated host's ledger) must be closed by the time ``shutdown()``
    returns and the host has exited.
    """

    FD_SLACK = 0

    def __init__(self) -> None:
        self.fds_before = fd_count()
        self.children_before = {p.pid for p in psutil.Process().children()}
        self.pids: set[int] = set()

    def add(self, pids: Iterable[int]) -> None:
        """Remember worker PIDs that must be gone at the end."""
        self.pids.update(int(pid) for pid in pids)

    def watch(self, executor: GpuPoolExecutor) -> None:
        """Remember the pool's live worker PIDs now, and those its decisions name."""
        self.add(list(executor._processes))
        self.add(
            d.extra["pid"]
            for d in executor.decisions
            if d.event == "worker_lost" and isinstance(d.extra.get("pid"), int)
        )

    def assert_clean(self) -> None:
        """No worker alive or a zombie, no new child process, no descriptor left open."""
        assert wait_until(lambda: all(gone(pid) for pid in self.pids), 5.0), {
            pid: psutil.Process(pid).status() for pid in self.pids if not gone(pid)
        }

        def new_children() -> list[psutil.Process]:
            return [p for p in psutil.Process().children() if p.pid not in self.children_before]

        assert wait_until(lambda: not new_children(), 5.0), [
            (p.pid, p.status(), p.cmdline()) for p in new_children()
        ]
        after = fd_count()
        assert after <= self.fds_before + self.FD_SLACK, (self.fds_before, after, _fd_targets())


def _fd_targets() -> list[str]:
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(f"{name} -> {os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:
            pass
    return targets
