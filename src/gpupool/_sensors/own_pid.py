"""This process's PID, kept by a fork hook rather than asked of the kernel each time (I/O edge).

The probe and the simulator's ledger ask, at every reading, whether they run
in the process that set them up (a forked copy must start afresh); a pool's
objects ask whether they run in the process that made the pool (a forked copy
leaves the pool to its parent). Asking
``os.getpid`` is a system call each time; a worker asks several times per
task. :func:`own_pid` answers from a value that ``os.register_at_fork``
renews in every child that ``os.fork`` (and ``multiprocessing``'s fork, and
``subprocess``'s ``preexec_fn``) makes. A fork made below Python runs no
hook: a copy so made that runs Python code sees its parent's PID here (the
worker itself checks with ``os.getpid`` after each task, and such a copy
leaves there).
"""

from __future__ import annotations

import os

__all__ = ["own_pid"]

_pid = os.getpid()


def _renew() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_renew)


def own_pid() -> int:
    """This process's PID, as of its start or its last fork through Python."""
    return _pid
