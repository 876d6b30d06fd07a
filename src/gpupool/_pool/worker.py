"""Child side of the pool: the loop every worker process runs (process layer).

A worker is started as a fresh interpreter (:mod:`gpupool._pool.launch`)
with its environment set before any import (the sensor's ``worker_env``: for NVIDIA,
``CUDA_VISIBLE_DEVICES=<uuid>``, ``CUDA_DEVICE_ORDER``), so nothing in it can touch the
wrong card. It then runs one task at a time and answers each in one frame (the frames
and the kinds: :mod:`gpupool._pool.wire`): its result or exception, a device
out-of-memory classified here, or a task queued behind one that ran out of device memory
declined unrun. Before any task it answers ``ready`` (with its own device bytes), so a
worker that dies before then is known to have died starting, not running a task. An
empty message asks it to exit. Its end of the socket blocks; the parent's never does
(:mod:`gpupool._pool.channel`).

At start a worker

* asks the kernel to signal it when the pool's process dies, even by SIGKILL
  (``prctl(PR_SET_PDEATHSIG)`` with :data:`PARENT_DEATH_SIGNAL` on Linux), and
  becomes a subreaper (``PR_SET_CHILD_SUBREAPER``), so that what its tasks
  started and left stays below it; on that signal (handled in the main thread,
  or by a thread woken by Python's wake-up descriptor where the main thread is
  in a C call that released the GIL, a hung CUDA or NCCL call) it ends its
  whole tree (SIGTERM, SIGKILL after :data:`PARENT_DEATH_GRACE_S`) and exits
  (:func:`_end_tree_and_exit`). A task in a C call that holds the GIL and never
  checks for signals delays that until the call returns. Elsewhere a thread
  polls ``getppid``. A worker that reads the end of its socket (the pool's end
  closed without asking it to exit) does the same;
* makes a process group of its own, so the pool can signal everything its
  tasks started (:func:`gpupool._pool.reaper.signal_tree`);
* marks its inherited descriptors close-on-exec, so a program a task runs
  does not hold the worker's socket or its start pipe;
* guards its socket against what its tasks fork (:func:`_guard_forks`), and exits
  rather than answer into a file a task put in its place (:func:`_leave_if_channel_lost`).
"""

from __future__ import annotations

import errno
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from gpupool._core.peak import PeakReport
from gpupool._pool import wire
from gpupool._pool.by_value import adopt_main_namespace, dumps_call
from gpupool._pool.channel import size_buffers

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpupool._child.probe import Probe
    from gpupool._pool.acks import CellHandle, ReadCell
    from gpupool._pool.channel import ChildEnd
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = ["process_chunk", "worker_main"]

#: How often a worker checks that its parent is alive, where the kernel cannot
#: be asked to do it (not Linux). A worker whose parent was SIGKILLed must exit
#: soon, or it keeps device memory as an orphan.
PARENT_CHECK_INTERVAL_S = 0.5

#: ``prctl`` option: the signal the kernel sends this process when its parent dies.
_PR_SET_PDEATHSIG = 1
#: ``prctl`` option: orphans below this process are re-parented to it, not to init.
_PR_SET_CHILD_SUBREAPER = 36

#: The signal a worker gets when the pool's process dies: a real-time signal no task is
#: likely to handle (a task's own SIGTERM handler, as a trainer's checkpoint, is left alone).
PARENT_DEATH_SIGNAL: int = getattr(signal, "SIGRTMAX", signal.SIGTERM + 4) - 4
#: How long the processes below a worker whose pool died get to exit on SIGTERM before
#: SIGKILL (the pool's own grace for Ctrl-C).
PARENT_DEATH_GRACE_S = 2.0

#: Held by the thread that ends this worker's tree as it exits; the other waits for the exit.
_ending = threading.Lock()
#: Whether the main thread is ending the tree (:func:`_on_parent_death` then returns).
_main_ending = False


#: This worker's PID, set by :func:`_guard_forks`; a process with another PID that runs
#: this module's code is a forked copy of the worker, and never sends on its socket.
_worker_pid: int | None = None
#: The socket this worker's channel is (``st_dev``, ``st_ino``), set by :func:`_guard_forks`.
_channel_id: tuple[int, int] | None = None


def _watch_parent(parent_pid: int) -> None:
    while True:
        threading.Event().wait(PARENT_CHECK_INTERVAL_S)
        if os.getppid() != parent_pid:
            _end_tree_and_exit()


def _await_parent_death(reader: int, parent_pid: int) -> None:
    """A thread that wakes when the main thread's handler of :data:`PARENT_DEATH_SIGNAL` is
    due (the wake-up descriptor: written at C level, whatever the main thread does), and
    ends the tree itself where the main thread cannot run Python now (a C call that released
    the GIL: a hung CUDA or NCCL call)."""
    while True:
        try:
            woken = os.read(reader, 64)
        except InterruptedError:
            continue
        except OSError:  # a task closed it: the handler in the main thread is left
            return
        if not woken:
            return
        # Checked: bytes a task's forked child wrote on every descriptor may land here.
        if PARENT_DEATH_SIGNAL in woken and os.getppid() != parent_pid:
            _end_tree_and_exit()


def _on_parent_death(signum: int, frame: Any) -> None:
    # The kernel signals again each time this process is re-parented (to another thread of
    # the dying pool, then to a reaper): one handler runs, not one inside another; and none
    # inside the main thread's own ending (it read the socket's end first).
    signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)
    if not _main_ending:
        _end_tree_and_exit()


def _end_tree_and_exit() -> NoReturn:
    """The pool is gone: SIGTERM (and SIGCONT, for a stopped one) to every process below this
    worker, SIGKILL to those left after :data:`PARENT_DEATH_GRACE_S`, then exit (code 1).
    Called from two threads at most; the second waits for the first to end the process."""
    global _main_ending
    if threading.current_thread() is threading.main_thread():
        _main_ending = True  # the signal's handler, run inside this, returns at once
    if not _ending.acquire(blocking=False):
        while True:
            threading.Event().wait()
    try:
        from gpupool._pool.reaper import end_tree

        end_tree(os.getpid(), PARENT_DEATH_GRACE_S)
    finally:
        os._exit(1)


def die_with_parent(parent_pid: int) -> bool:
    """Have this process end its tree and exit when its parent dies; whether the kernel
    says so (else the caller polls ``getppid``).

    Linux only: ``prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)``, handled in the main
    thread (:func:`_on_parent_death`: it runs between bytecodes, in a system call that the
    signal interrupts, and in C code that checks for signals, as a regex's match does)
    and by a thread of its own woken by Python's wake-up descriptor
    (:func:`_await_parent_death`: the main thread may be in a C call that released the
    GIL); and ``PR_SET_CHILD_SUBREAPER``. The signal comes when the *thread* that started
    this process ends, which for a pool's worker is the pool's dispatcher thread: it
    lives until the pool has stopped its workers. A parent that died before the call is
    caught by the ``getppid`` check after it.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        signal.signal(PARENT_DEATH_SIGNAL, _on_parent_death)
        reader, writer = os.pipe()
        os.set_blocking(writer, False)
        signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
        if libc.prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0) != 0:
            return False
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # best effort
    except (OSError, AttributeError, ValueError):
        return False
    os.register_at_fork(after_in_child=functools.partial(_to_devnull, reader, writer))
    watch = threading.Thread(target=_await_parent_death, args=(reader, parent_pid), daemon=True)
    watch.name = "gpupool-parent-watch"
    watch.start()
    if os.getppid() != parent_pid:
        _end_tree_and_exit()
    return True


def _to_devnull(*fds: int) -> None:
    """In a child forked off the worker: ``fds`` (the wake-up pipe's) become ``/dev/null``,
    so that nothing it writes on every descriptor reaches the worker's threads."""
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    for fd in fds:
        try:
            os.dup2(null, fd, inheritable=False)
        except OSError:
            pass
    os.close(null)


def _isolate() -> None:
    """A process group of this worker's own; inherited descriptors closed on exec; the
    ``spawn`` start method for the processes its tasks start.

    Set explicitly: the worker's start method must not be another's (a process a task
    started with ``multiprocessing.get_context("spawn")``, as ``torch.multiprocessing``
    does, once failed before running its target when the worker had one it could not
    find), nor ``fork``, which a CUDA context does not survive.
    """
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    multiprocessing.set_start_method("spawn", force=True)
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


def _guard_forks(fd: int) -> None:
    """Keep whatever a task forks off this worker from writing on the socket ``fd``.

    Two guards, since one answer per task is the whole protocol with the pool:

    * in every child :func:`os.fork` makes, the socket's descriptor is replaced
      by ``/dev/null`` (``os.register_at_fork(after_in_child=...)``), so what
      the child writes on it (garbage scribbled over every descriptor, a second
      answer) goes nowhere, and the child does not hold the worker's socket
      open. The number stays taken, so nothing the child opens later lands on
      it. Closing on fork itself (``O_CLOFORK``) would be simpler, but Linux
      has no such flag;
    * a copy of the worker that comes back to its loop (a child that returns
      from the task, or one forked below Python where the hook does not run)
      sees that its PID is not the worker's and leaves with ``os._exit(0)``
      before it sends anything or reads another task (:func:`_leave_if_forked`).

    A child that kept its own ``dup`` of the descriptor from before the fork is
    out of the first guard's reach; what it writes is a protocol fault the
    parent catches (its PID is not the worker's): the worker's task fails, never
    another task's result.
    """
    global _worker_pid, _channel_id
    _worker_pid = os.getpid()
    status = os.fstat(fd)
    _channel_id = (status.st_dev, status.st_ino)

    def poison() -> None:
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            null = -1
        try:
            if null >= 0:
                os.dup2(null, fd, inheritable=False)
            else:
                os.close(fd)
        except OSError:
            pass
        finally:
            if null >= 0 and null != fd:
                os.close(null)

    os.register_at_fork(after_in_child=poison)


def _leave_if_forked() -> None:
    """In a forked copy of the worker (another PID), flush stdio and exit quietly."""
    if _worker_pid is None or os.getpid() == _worker_pid:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def _leave_if_channel_lost(fd: int) -> None:
    """Exit (code 1, a line on stderr) when ``fd`` is no longer this worker's socket: a task
    closed it, or put another file on its number (``os.closerange`` then a socket of its
    own). The answer would go to that file, and the worker would wait for its next task on
    it for good while the parent waits for the answer."""
    if _channel_id is None:
        return
    try:
        status = os.fstat(fd)
        if (status.st_dev, status.st_ino) == _channel_id:
            return
        what = "put another file on its number"
    except OSError:
        what = "closed it"
    try:
        sys.stderr.write(
            f"gpupool worker (pid {os.getpid()}): a task {what}: descriptor {fd}, this "
            "worker's channel to the pool, is gone; the worker exits\n"
        )
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(1)


def _dump_exception(exc: BaseException) -> bytes:
    """Pickle an exception with its formatted traceback; survive one that cannot be pickled.

    traceback and cloudpickle are imported here, at a worker's first failure; where the
    task left nothing importable (``sys.path`` emptied, every descriptor in use), the
    traceback is written out by hand and the exception pickled by plain pickle.
    """
    try:
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        tb = _plain_traceback(exc)
    try:
        import cloudpickle  # a worker's first failure loads it, not its start

        dumps: Any = cloudpickle.dumps
    except Exception:
        dumps = pickle.dumps
    try:
        data: bytes = dumps((exc, tb))
        return data
    except BaseException as pickling_error:
        stand_in = RuntimeError(
            f"the task raised {type(exc).__name__}: {exc!s:.2000}, and that exception could "
            f"not be pickled to send it back ({type(pickling_error).__name__}: {pickling_error})"
        )
        data = pickle.dumps((stand_in, tb))
        return data


def _plain_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as :func:`traceback.format_exception` lays it out (its frames'
    files, lines and functions, then the exception), without importing anything."""
    lines = ["Traceback (most recent call last):\n"]
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        lines.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}\n')
        tb = tb.tb_next
    try:
        text = str(exc)
    except Exception:
        text = "<the exception's str() raised>"
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    lines.append(f"{name.removeprefix('builtins.')}: {text}\n" if text else f"{name}\n")
    return "".join(lines)


def worker_main(
    conn: ChildEnd,
    parent_pid: int,
    device: DeviceInfo | None,
    device_index: int | None,
    initializer: tuple[Any, tuple[Any, ...], dict[str, int]] | None,
    max_tasks: int | None,
    sensor_factory: Callable[[], Sensor] | None,
    read_cell: CellHandle | None = None,
    context_estimate: tuple[int, str] | None = None,
) -> None:
    """Run tasks from ``conn`` until told to stop, the parent dies, or ``max_tasks`` ran; the
    probe reads ``device`` through ``sensor_factory()`` (the pool's sensor's ``worker_factory``;
    ``None`` without a device, so that a worker without one never imports a sensor). Each task
    frame read is acknowledged in ``read_cell`` (:mod:`gpupool._pool.acks`).
    ``context_estimate``: the context this worker is priced at until its own row is read,
    and its source (:func:`gpupool._child.probe.set_context_estimate`)."""
    cell = None if read_cell is None else read_cell.open()
    probe = _start(
        conn, parent_pid, initializer, device, device_index, sensor_factory, context_estimate
    )
    if probe is None:
        return
    frames = _TaskFrames(conn, cell)
    done = 0
    last_oom = False  # whether the last task this worker ran ended in a device OOM
    fd = conn.fileno()
    while max_tasks is None or done < max_tasks:
        task = _next_task(conn, frames, fd, last_oom)
        if task is None:
            return  # asked to exit, or unable to read or set up the next task
        task_id, (fn, args, kwargs) = task
        del task
        probe.start()
        failure = None
        try:
            result: Any = fn(*args, **kwargs)
        except BaseException as exc:
            failure, result = exc, None
        _leave_if_forked()  # a child the task forked came back here: it leaves
        report = _measured(probe, failure, device_index)
        del fn, args, kwargs
        kind, payload = _encoded(result, failure, report)
        del result, failure
        last_oom = kind == "oom"
        # The report as plain values (wire.parse_answer rebuilds it); a forked copy left above.
        try:
            _answer(conn, task_id, kind, wire.report_values(report), payload, forked_checked=True)
        except OSError:  # the pool is gone (its end closed)
            _end_tree_and_exit()
        del payload
        done += 1


def _next_task(
    conn: ChildEnd, frames: _TaskFrames, fd: int, last_oom: bool
) -> tuple[int, Any] | None:
    """The next task to run: its id and its unpickled ``(fn, args, kwargs)``; ``None`` when
    this worker is to exit. A frame it does not run is answered here and the next one read:
    a task queued behind one that ran out of device memory (``last_oom``: the task this
    worker ran last did) is declined, one that cannot be read is answered ``"unpickle"``."""
    while True:
        message = frames.next()
        if message is None:
            return None  # asked to exit, or the frame went back unread (no room to read it)
        if last_oom and wire.is_queued_task(message):
            # Queued behind the task that just ran out of device memory, at a booking made
            # before that was known: the parent starts it again, checked against the bound.
            _decline(conn, message)
            continue
        last_oom = False
        unfit = _unfit(fd)
        if unfit is not None:
            # A task before this one used up what a task needs: this one goes to a fresh
            # worker, unrun, and this worker exits (the pool replaces it).
            _decline(conn, message, unfit)
            return None
        task = _read_call(conn, message)
        del message
        if task is None:
            return None  # answered ``declined``, unable to set the task up: this worker exits
        if task:
            return task


class _TaskFrames:
    """How a worker reads its task frames: each acknowledged in its read cell as it is read
    (:mod:`gpupool._pool.acks`), before anything of it is unpickled or run; an allocator cap
    message (``cap_allocator=True``: the next task's booked ask) applied where it comes."""

    __slots__ = ("_apply_cap", "_cap_of", "_cell", "_conn", "_read")

    def __init__(self, conn: ChildEnd, cell: ReadCell | None) -> None:
        from gpupool._child.probe import apply_allocator_cap, read_allocator_cap_message

        self._conn = conn
        self._cell = cell
        self._read = 0  # task frames read
        self._cap_of = read_allocator_cap_message
        self._apply_cap = apply_allocator_cap

    def next(self) -> bytearray | None:
        """The next task frame; ``None`` when this worker is to exit: asked to (an empty
        message), or the frame is too large for the memory a task before left (answered
        ``declined``: it goes to a fresh worker, unrun). Where the pool's end closed without
        asking this worker to exit, its tree ends and it exits."""
        fd = self._conn.fileno()
        while True:
            # Whether a task closed or replaced the socket was checked as its answer was sent.
            try:
                message = wire.read_frame(fd)
            except wire.NoRoomForFrame as no_room:
                self._note(no_room.head)
                _decline(self._conn, bytearray(no_room.head), f"MemoryError: {no_room}")
                return None
            except (EOFError, OSError):
                message = None
            if message is None:
                _end_tree_and_exit()
            if not message:
                return None
            cap_bytes = self._cap_of(message)
            if cap_bytes is None:
                self._note(message)
                return message
            self._apply_cap(cap_bytes)

    def _note(self, frame: bytes | bytearray) -> None:
        """Acknowledge the task ``frame`` (its head at least) as read; without a read cell,
        nothing (its task id is not even worked out)."""
        if self._cell is not None:
            self._read += 1
            self._cell.note(self._read, wire.task_id_of(frame))


def _initialized(conn: ChildEnd, initializer: tuple[Any, tuple[Any, ...], dict[str, int]]) -> bool:
    """Run the initializer; ``False`` (answered ``"init"``: the worker exits) when it raised."""
    try:
        fn, args, ids = initializer
        # A function of the script shares one namespace with the tasks (see by_value).
        adopt_main_namespace(fn, ids)
        fn(*args)
    except BaseException as exc:
        _leave_if_forked()
        try:
            # The standard pool's logger; a worker that never logs never loads logging.
            import logging

            logging.getLogger("concurrent.futures").critical(
                "Exception in initializer:", exc_info=True
            )
        except Exception:  # the initializer left logging unimportable: the answer says it
            pass
        _answer(conn, wire.NO_TASK, "init", None, _dump_exception(exc))
        return False
    _leave_if_forked()
    return True


def _measured(probe: Probe, failure: BaseException | None, device_index: int | None) -> PeakReport:
    """The task's report; a measurement that fails must not cost the task its result."""
    from gpupool._child.probe import is_device_oom

    try:
        if failure is None:
            return probe.stop()
        if is_device_oom(failure):
            return probe.stop(oom=failure)
        # Any other failure: an out-of-memory all the same where the card was full meanwhile.
        return probe.stop(failure=failure)
    except Exception:
        return PeakReport(device=device_index, device_peak_bytes=None, device_source="none")


def _encoded(result: Any, failure: BaseException | None, report: PeakReport) -> tuple[str, bytes]:
    """The answer's kind and payload: the pickled result, or the pickled exception."""
    if failure is not None:
        return "oom" if report.oom else "error", _dump_exception(failure)
    try:
        return "ok", dumps_call(result)
    except BaseException as exc:
        return "error", _dump_exception(exc)


def _decline(conn: ChildEnd, message: bytearray, why: str = "") -> None:
    """Answer ``"declined"`` to the task frame ``message``, unrun (and unread): a task queued
    behind one that ran out of device memory, or (``why`` says what is used up) one this
    worker cannot set up."""
    task = wire.read_task(message)
    if task is None:  # not a task: the parent's fault, as _read_call answers it
        _read_call(conn, message)
        return
    task[1].release()
    _answer(conn, task[0], "declined", None, why.encode(errors="replace"))


#: What a task may have used up in its worker, by errno: with none of it left the worker
#: cannot set up the next task.
_USED_UP = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _unfit(fd: int) -> str | None:
    """What this worker lacks to set up a task, in words (a task before left it without a
    free descriptor), or ``None``: one ``dup`` of the channel ``fd`` and its ``close`` (a
    few microseconds: no path is looked up)."""
    try:
        spare = os.dup(fd)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}" if exc.errno in _USED_UP else None
    os.close(spare)
    return None


def _used_up(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the worker ran out of descriptors or memory."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MemoryError):
            return True
        if isinstance(exc, OSError) and exc.errno in _USED_UP:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False


def _read_call(conn: ChildEnd, message: bytearray) -> tuple[int, Any] | tuple[()] | None:
    """The task id and the unpickled ``(fn, args, kwargs)`` of a task frame; ``()`` when it
    could not be read (answered as ``"unpickle"``: the task never ran); ``None`` when this
    worker had no descriptor or memory left to read it (answered ``"declined"``: the task
    goes to a fresh worker, and this one exits)."""
    task = wire.read_task(message)
    if task is None:  # not a task: the parent's fault; it kills this worker on the answer
        error = RuntimeError(f"the worker received {wire.describe(message)}, not a task")
        _answer(conn, wire.NO_TASK, "unpickle", None, _dump_exception(error))
        return ()
    task_id, call = task
    try:
        fn, args, kwargs = pickle.loads(call)
        return task_id, (fn, args, kwargs)
    except BaseException as exc:
        if _used_up(exc):
            del exc
            _answer(conn, task_id, "declined", None, b"no memory or descriptor left to read it")
            return None
        _answer(conn, task_id, "unpickle", None, _dump_exception(exc))
        return ()
    finally:
        call.release()


def _start(
    conn: ChildEnd,
    parent_pid: int,
    initializer: tuple[Any, tuple[Any, ...], dict[str, int]] | None,
    device: DeviceInfo | None,
    device_index: int | None,
    sensor_factory: Callable[[], Sensor] | None,
    context_estimate: tuple[int, str] | None = None,
) -> Probe | None:
    """Start as the module's docstring says, run the initializer, set up the probe and tell
    the parent this worker is ready, with its own device bytes now (what the initializer
    left on the card is this worker's, not a task's); ``None`` when the initializer raised
    or the parent's end is closed."""
    if not die_with_parent(parent_pid):
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _isolate()
    _guard_forks(conn.fileno())
    size_buffers(conn.fileno())
    if initializer is not None and not _initialized(conn, initializer):
        return None
    from gpupool._child.probe import Probe, set_context_estimate

    if context_estimate is not None:
        set_context_estimate(*context_estimate)
    sensor = None
    if device is not None and sensor_factory is not None:
        try:
            sensor = sensor_factory()
        except Exception:
            sensor = None
    probe = Probe(sensor, device, device_index, os.getpid())
    try:
        _answer(conn, wire.NO_TASK, "ready", {"resident_bytes": probe.resident_bytes()}, b"")
    except OSError:
        return None  # nobody waits for this worker
    return probe


def _answer(
    conn: ChildEnd,
    task_id: int,
    kind: str,
    report: dict[str, Any] | tuple[Any, ...] | None,
    payload: bytes,
    *,
    forked_checked: bool = False,
) -> None:
    """Send one answer about ``task_id`` as one frame (the payload not copied); a forked
    copy of the worker sends nothing and exits (``forked_checked``: the caller just made
    sure this is no such copy)."""
    if not forked_checked:
        _leave_if_forked()
    fd = conn.fileno()
    _leave_if_channel_lost(fd)
    # Not a forked copy: this process is the worker (whose PID _guard_forks kept).
    wire.send_answer(fd, _worker_pid or os.getpid(), task_id, kind, report, payload)


def process_chunk(fn: Any, chunk: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``fn`` over one chunk of ``map``'s argument tuples, in the worker."""
    return [fn(*args) for args in chunk]
