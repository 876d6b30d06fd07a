"""SIGTERM as Ctrl-C while a pool with ``on_interrupt="terminate"`` is open, and not in its forks.

A pool made in the main thread, where SIGTERM has no handler of the program's
own, installs :func:`_on_sigterm`: SIGTERM then raises ``KeyboardInterrupt``
as Ctrl-C does, and the interpreter's exit stops the open pools' tasks rather
than wait for them. Once no such pool is open, SIGTERM does what it did
before (the default).

A process forked while the handler is installed (a ``multiprocessing.Pool``
worker made with ``fork``) inherits it, with copies of the pools but none of
their threads. There SIGTERM (``Pool.terminate``) must end the child as it
would without gpupool. Two windows would lose it: a signal that arrives before
the interpreter's own after-fork reset is dropped with its pending flag, and
one that arrives while the at-fork hooks of other modules run raises
``KeyboardInterrupt`` inside a hook, where it is printed and ignored. So the
forking thread blocks SIGTERM across the fork; the child puts the default
action back and unblocks it, and a SIGTERM sent meanwhile, held pending by the
kernel, then ends the child. In the parent the handler holds off while the fork
is under way (raised in an at-fork hook, ``KeyboardInterrupt`` would be printed
and ignored, and in one of ours would leave SIGTERM blocked for good): it comes
as ``os.fork()`` returns.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any

# Imported for its exit hook: the inbox runs them last registered first, so the one
# registered below stops the pools before the dispatcher's waits for them.
import gpupool._pool.dispatcher  # noqa: F401
from gpupool._pool.inbox import at_interpreter_exit

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor

__all__ = ["watch_sigterm"]

#: The pools with ``on_interrupt="terminate"`` that SIGTERM stops as Ctrl-C does.
_interruptible: weakref.WeakSet[GpuPoolExecutor] = weakref.WeakSet()
#: Whether SIGTERM came (its handler raised ``KeyboardInterrupt``): at the interpreter's
#: exit, those pools stop their tasks rather than wait for them.
_terminated = False
#: Per forking thread: whether it is forking (the handler then holds off there), whether
#: :func:`_before_fork` blocked SIGTERM (and so unblocks it), and whether SIGTERM came
#: meanwhile (``held``: it is raised once the fork is done).
_fork = threading.local()


def watch_sigterm(executor: GpuPoolExecutor) -> None:
    """SIGTERM raises ``KeyboardInterrupt`` in the main thread from now on, as Ctrl-C does,
    where its handler is the default and this is the main thread (a program's own handler
    is left alone)."""
    _interruptible.add(executor)
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while a pool with ``on_interrupt="terminate"`` is open: ``KeyboardInterrupt``,
    as Ctrl-C. A pool is open until its dispatcher has finished, shut down or not (``with``
    waiting at its end is the commonest moment to send it). Once none is open, SIGTERM does
    what it did before any pool (the default)."""
    global _terminated
    if getattr(_fork, "forking", False):
        _fork.held = True
        return
    if all(executor._dispatcher.public.finished.is_set() for executor in _interruptible):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _terminated = True
    raise KeyboardInterrupt


def _stop_at_exit() -> None:
    """After SIGTERM, the interpreter's exit stops the open pools' tasks (as leaving their
    ``with`` block does) instead of waiting for them."""
    if _terminated:
        for executor in list(_interruptible):
            executor._stop_on_interrupt()


def _before_fork() -> None:
    """Hold SIGTERM back in the forking thread while the handler is ours (the child
    inherits the mask, so a SIGTERM sent to it before its hooks ran stays pending)."""
    _fork.blocked = False
    # Noted before it is blocked, so that an exception cannot leave it blocked unnoted.
    if signal.getsignal(signal.SIGTERM) is _on_sigterm and signal.SIGTERM not in (
        signal.pthread_sigmask(signal.SIG_BLOCK, ())
    ):
        _fork.blocked = True
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _after_fork_in_parent() -> None:
    """Unblock SIGTERM; one that came during the fork is tripped again, last, where no
    pending signal is looked for before ``os.fork()`` returns (unpacking does not look,
    a call would: its handler would raise in this hook, printed and ignored)."""
    again = map(_thread.interrupt_main, (signal.SIGTERM,))
    _unblock()
    held = _fork.held  # no call between reading and clearing: none looks for a signal
    _fork.forking = _fork.held = False
    if held:
        (_,) = again


def _after_fork_in_child() -> None:
    """A forked child holds copies of the parent's pools but none of their threads:
    SIGTERM there ends the child as it would without gpupool, not stop pools whose
    dispatcher never ran in it (that wait would never end, nor the child, nor its
    parent's ``Pool.terminate``)."""
    global _terminated
    _interruptible.clear()
    _terminated = False
    _fork.forking = _fork.held = False  # one held was the parent's
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    finally:
        _unblock()  # a SIGTERM sent meanwhile ends the child now


def _unblock() -> None:
    """Unblock SIGTERM in this thread where :func:`_before_fork` blocked it."""
    if getattr(_fork, "blocked", False):
        _fork.blocked = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


at_interpreter_exit(_stop_at_exit)
os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
# Registered last, so run first of gpupool's before-hooks; in C, where no handler runs.
os.register_at_fork(before=functools.partial(setattr, _fork, "held", False))
os.register_at_fork(before=functools.partial(setattr, _fork, "forking", True))
