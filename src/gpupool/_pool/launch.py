"""Starting a worker process: fork+exec of a fresh interpreter with an environment of its own
(process layer).

A worker is the standard library's spawn child (``python -c "from
multiprocessing.spawn import spawn_main; ..." --multiprocessing-fork``),
started with three differences:

* its environment is the parent's plus the worker's own variables
  (``CUDA_VISIBLE_DEVICES``...), set before the interpreter starts, so
  nothing in it can touch the wrong card;
* the process object is pickled with cloudpickle, so an initializer defined
  in the script (or a lambda) reaches the worker by value; multiprocessing's
  own reducers still apply, so queues, locks and connections in its
  arguments work as with spawn;
* the script is imported as ``__mp_main__`` where the standard library's spawn
  would import it (its top level runs in the worker before the target is
  unpickled); its top-level functions and classes go by name, what the worker
  cannot import by value (:mod:`gpupool._pool.by_value`).

The child imports only the standard library's spawn module before it
unpickles its target, so its start costs what a standard worker's does;
unpickling :class:`WorkerProcess` imports this module there, which loads
cloudpickle only when the parent pickles a process (:func:`_pickler_class`).
It shares multiprocessing's resource tracker with the parent, as a spawn
child does. Descriptors other than the ones passed are closed in the child
(``close_fds``), so no other pool's pipe leaks into it.
"""

from __future__ import annotations

import copyreg
import functools
import io
import os
import sys
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from multiprocessing import popen_fork, popen_spawn_posix, process, spawn, util
from multiprocessing.context import set_spawning_popen
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["StartDataError", "WorkerProcess", "fork_exec"]


class StartDataError(Exception):
    """What a worker starts with (its target's arguments: the initializer and its initargs)
    could not be pickled; no process was started. Starting again cannot help."""


def fork_exec(
    args: list[str], pass_fds: Iterable[int], env: Mapping[str, str], cwd: str | None = None
) -> int:
    """Start ``args`` with exactly ``env`` as its environment, in ``cwd`` (``None``: this
    process's); only ``pass_fds`` (and stdio) stay open in it. Returns its PID."""
    import _posixsubprocess
    import subprocess

    call: Any = _posixsubprocess.fork_exec

    encoded_args = [os.fsencode(arg) for arg in args]
    encoded_env = [os.fsencode(f"{key}={value}") for key, value in env.items()]
    # The signature of this private call changed twice (3.11: process group; 3.14: no vfork
    # flag); multiprocessing's own spawn (util.spawnv_passfds) makes the same call.
    if sys.version_info >= (3, 14):
        tail: tuple[Any, ...] = ()
        group: tuple[Any, ...] = (-1,)
    elif sys.version_info >= (3, 11):
        tail = (subprocess._USE_VFORK,)  # type: ignore[attr-defined]
        group = (-1,)
    else:
        tail, group = (), ()
    errpipe_read, errpipe_write = os.pipe()
    # Kept open in the child until its exec (close-on-exec), to report an exec that failed.
    fds = tuple(sorted({int(fd) for fd in pass_fds} | {errpipe_write}))
    try:
        pid: int = call(
            encoded_args,
            encoded_args[:1],
            True,  # close_fds
            fds,
            None if cwd is None else os.fsencode(cwd),
            encoded_env,
            -1,
            -1,
            -1,
            -1,
            -1,
            -1,  # stdio: inherited
            errpipe_read,
            errpipe_write,
            False,  # restore_signals
            False,  # call_setsid
            *group,
            None,  # gid
            None,  # extra_groups
            None,  # uid
            -1,  # child_umask
            None,  # preexec_fn
            *tail,
        )
        os.close(errpipe_write)
        errpipe_write = -1
        _raise_exec_error(pid, os.fsdecode(args[0]), errpipe_read)
        return pid
    finally:
        os.close(errpipe_read)
        if errpipe_write != -1:
            os.close(errpipe_write)


def _raise_exec_error(pid: int, executable: str, errpipe_read: int) -> None:
    """Raise the error the child met before its ``exec`` succeeded (``E2BIG`` for an
    environment the kernel refuses, ``ENOENT`` for a missing interpreter), as
    :mod:`subprocess` does; return once it ran the interpreter (the pipe closed on exec)."""
    data = b""
    while True:
        part = os.read(errpipe_read, 50_000)
        data += part
        if not part or len(data) > 50_000:
            break
    if not data:
        return
    os.waitpid(pid, 0)  # it exits at once after the report: reap it
    name, _, rest = data.partition(b":")
    hex_errno, _, message = rest.partition(b":")
    try:
        errno_num = int(hex_errno, 16)
    except ValueError:
        errno_num = 0
    what = f"could not run {executable!r} for a worker process"
    if errno_num:
        raise OSError(errno_num, f"{os.strerror(errno_num)} ({what})")
    detail = (name + b": " + message).decode(errors="replace")
    raise OSError(f"{what}: {detail}")


@functools.cache
def _pickler_class() -> type[Any]:
    """The tasks' pickler (:mod:`gpupool._pool.by_value`) with multiprocessing's reducers
    (connections, sockets: passed as descriptors the child inherits).

    Made on first use, in the parent: a worker imports this module to unpickle its
    :class:`WorkerProcess`, and never needs cloudpickle to start."""
    from gpupool._pool.by_value import pickler_class

    # The tasks' pickler: the script's functions and classes by name where the worker
    # imports it, else by value into the worker's one namespace for the script.
    base = pickler_class()
    table = ChainMap(
        ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        base.dispatch_table,
        copyreg.dispatch_table,
    )
    return type("_Pickler", (base,), {"dispatch_table": table})


def _preparation_data(name: str) -> dict[str, Any]:
    """What :func:`multiprocessing.spawn.prepare` sets up in the child before it unpickles
    its target: the standard library's own data, less ``start_method``: reading it would
    fix this process's default start method as a side effect (a later
    ``multiprocessing.set_start_method`` would raise). The script is imported as the
    standard library imports it (``init_main_from_*``: ``by_value.main_for_workers``)."""
    from gpupool._pool.by_value import main_for_workers

    spawn._check_not_importing_main()  # type: ignore[attr-defined]
    sys_path = [p if p != "" else process.ORIGINAL_DIR for p in sys.path]  # type: ignore[attr-defined]
    data: dict[str, Any] = {
        "log_to_stderr": util._log_to_stderr,  # type: ignore[attr-defined]
        "authkey": bytes(process.current_process().authkey),
        "name": name,
        "sys_argv": sys.argv,
        "sys_path": sys_path,
        "orig_dir": process.ORIGINAL_DIR,  # type: ignore[attr-defined]
    }
    try:
        data["dir"] = os.getcwd()
    except FileNotFoundError:
        pass  # removed: the child starts in the root directory (see _Popen._launch)
    logger = util._logger  # type: ignore[attr-defined]
    if logger is not None:
        data["log_level"] = logger.getEffectiveLevel()
    data.update(main_for_workers())
    return data


class _Popen(popen_fork.Popen):
    """multiprocessing's spawn ``Popen`` with the worker's environment, pickled by cloudpickle."""

    method = "spawn"
    DupFd = popen_spawn_posix._DupFd  # a descriptor the child inherits under its number

    def __init__(self, process_obj: WorkerProcess) -> None:
        self._fds: list[int] = []
        super().__init__(process_obj)

    def duplicate_for_child(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def _launch(self, process_obj: WorkerProcess) -> None:
        from multiprocessing import resource_tracker

        tracker_fd: int = resource_tracker.getfd()  # type: ignore[assignment]
        self._fds.append(tracker_fd)
        prep_data = _preparation_data(process_obj.name)
        fp = io.BytesIO()
        set_spawning_popen(self)  # type: ignore[arg-type]
        try:
            ForkingPickler(fp).dump(prep_data)
            try:
                _pickler_class()(fp).dump(process_obj)
            except Exception as exc:
                raise StartDataError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            env = {**os.environ, **process_obj.env}
            # A removed working directory is no place to start an interpreter (3.13's
            # imports fail in it): the child starts in the root directory instead.
            cwd = None if "dir" in prep_data else os.path.abspath(os.sep)
            self.pid = fork_exec(cmd, self._fds, env, cwd)
            self.sentinel = parent_r
            # The child's ends are closed before the write: a child that dies before it
            # read everything (a start-up that exits) breaks the pipe instead of leaving
            # the write blocked for ever on a full pipe the parent itself kept open.
            os.close(child_r)
            os.close(child_w)
            child_r = child_w = None
            try:
                with open(parent_w, "wb", closefd=False) as f:
                    f.write(fp.getbuffer())
            except BrokenPipeError:
                pass  # it exited before it read all: its exit is seen like any other
        finally:
            self.finalizer = util.Finalize(
                self,
                util.close_fds,  # type: ignore[attr-defined]
                [fd for fd in (parent_r, parent_w) if fd is not None],
            )
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class WorkerProcess(process.BaseProcess):
    """A ``multiprocessing`` process started as a fresh interpreter with ``env`` added to its
    environment (see the module's docstring)."""

    _start_method = "spawn"

    def __init__(
        self,
        target: Callable[..., object],
        args: tuple[Any, ...],
        env: Mapping[str, str],
        name: str | None = None,
    ) -> None:
        super().__init__(target=target, args=args, name=name)
        self.env = dict(env)

    @staticmethod
    def _Popen(process_obj: WorkerProcess) -> _Popen:
        return _Popen(process_obj)


def _forget_workers_in_forked_child() -> None:
    """A forked child (``os.fork()`` beside an open pool) holds copies of the pools' worker
    processes in ``multiprocessing``'s list of its children: they are its parent's, and its
    exit must not join them (``AssertionError: can only join a child process``, printed)."""
    process._children.difference_update(  # type: ignore[attr-defined]
        [child for child in process._children if isinstance(child, WorkerProcess)]  # type: ignore[attr-defined]
    )


os.register_at_fork(after_in_child=_forget_workers_in_forked_child)
