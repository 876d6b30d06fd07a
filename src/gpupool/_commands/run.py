"""``gpupool run``: a shell command per input line, each a task on a pool (command-line layer).

::

    input lines ──build_command──> "python eval.py 'ckpt a.pt'" ──submit──> worker
        (stdin or --input)          ({} -> the line, shell-quoted)          run_command:
                                                                             sh -c in a session
    parent, in input order <── exit status ── future                        of its own, output
      copy <n>.out -> stdout, <n>.err -> stderr,                             to <n>.out / <n>.err
      then a line on stderr for a failed command                             in a spool directory

Each command is a task of one key (by default the command template), so the
pool prices it like any other task and measures its whole process tree (the
shell and everything it starts). Output goes to two files per command in a
private spool directory and is copied out in input order once the command and
every one before it ended, so the output of two commands never interleaves.

A thread of its own reads the input and submits the commands, so output is
printed while the input waits for its next line.

Ctrl-C (``KeyboardInterrupt`` in the parent; SIGTERM is turned into one)
leaves the pool's ``with`` block: the pool cancels the commands not started
and sends SIGTERM to the running tasks' workers and their process trees; a
worker running a command forwards it to the command's process group, gives it
:data:`COMMAND_GRACE_S`, sends SIGKILL to what is left of the group, and only
then exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from concurrent.futures import Future
    from types import FrameType

__all__ = [
    "COMMAND_GRACE_S",
    "CommandOutOfMemory",
    "MAX_FAILED_STATUS",
    "MAX_UNPRINTED_COMMANDS",
    "add_run_parser",
    "build_command",
    "exit_status",
    "run_command",
    "run_commands",
    "run_from_args",
]

#: The exit status for more than 100 failed commands; fewer give their number (GNU parallel's).
MAX_FAILED_STATUS = 101

#: How long a command's process group has to exit on SIGTERM before SIGKILL, when the pool
#: stops its worker. Shorter than the pool's own grace (``INTERRUPT_GRACE_S``, 2 s), so the
#: group is gone while its worker still lives and the pool's SIGKILL finds nothing left.
COMMAND_GRACE_S = 1.0

#: How many commands may wait to be printed (ended, or held behind an earlier one) before
#: the input is read further: bounds the spool files and futures one slow command holds back.
MAX_UNPRINTED_COMMANDS = 1024

#: The most characters of a failed command's line, and of the command, its message shows.
MAX_SHOWN_CHARS = 300

#: How often a stopping worker looks whether its command's process group is empty.
_GROUP_POLL_S = 0.02

#: How often a worker waiting for its command looks whether SIGTERM came (see
#: :func:`_wait_unless_stopped`).
_STOP_POLL_S = 0.1

_PLACEHOLDER = "{}"


def build_command(template: str, line: str) -> str:
    """The command for one input line: every ``{}`` replaced by the line, shell-quoted.

    A template without ``{}`` gets the quoted line appended as its last word,
    as GNU parallel does.
    """
    quoted = shlex.quote(line)
    if _PLACEHOLDER in template:
        return template.replace(_PLACEHOLDER, quoted)
    return f"{template} {quoted}"


def exit_status(failed: int) -> int:
    """``gpupool run``'s exit status for ``failed`` failed commands (0 when none)."""
    return min(failed, MAX_FAILED_STATUS)


def read_lines(stream: IO[bytes]) -> Iterator[str]:
    """The input lines without their newline, decoded as file names are (undecodable bytes
    kept, as surrogate escapes, so they reach the command unchanged); closes ``stream`` at
    its end."""
    with stream:
        for raw in stream:
            yield os.fsdecode(raw[:-1] if raw.endswith(b"\n") else raw)


# -- the worker's side ---------------------------------------------------------------------


class _StopFlag:
    """Set by SIGTERM while a command runs: the pool is stopping this worker."""

    __slots__ = ("requested",)

    def __init__(self) -> None:
        self.requested = False

    def set(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


class CommandOutOfMemory(RuntimeError):
    """A command failed and its error output says the device ran out of memory.

    Raised in the worker in place of the command's exit status, so the pool
    classifies and retries it as it does a task's own out-of-memory. The
    message carries the status and the line that said so (kept for the error).
    """

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return CommandOutOfMemory, (str(self), self.status)


def _ran_out_of_memory(status: int, stderr_path: str) -> CommandOutOfMemory | None:
    """The command's failure as an out-of-memory, where its error output says one."""
    from gpupool._child.probe import OUTPUT_TAIL_BYTES, oom_in_output

    try:
        with open(stderr_path, "rb") as err:
            err.seek(max(0, os.fstat(err.fileno()).st_size - OUTPUT_TAIL_BYTES))
            line = oom_in_output(err.read())
    except OSError:
        return None
    if line is None:
        return None
    return CommandOutOfMemory(
        f"the command ran the device out of memory ({_describe_status(status)}): {line}", status
    )


def run_command(command: str, cwd: str, stdout_path: str, stderr_path: str) -> int:
    """Run ``command`` through ``/bin/sh`` in a session of its own; its exit status.

    Runs in a pool's worker. Standard input is ``/dev/null``; standard output
    and error go to the two files. A negative status is the signal that ended
    the shell. What the shell leaves running in its process group (``cmd &``)
    is ended (:func:`_end_group`) once it exits, so no process of a command
    outlives its task. On SIGTERM (the pool stopping), the command's process
    group is ended before the worker exits by the same signal.

    Raises:
        CommandOutOfMemory: the command failed and the end of its error output
            says the device ran out of memory (CUDA's, cuDNN's, cuBLAS's,
            NCCL's, torch's, CuPy's or JAX's words), so the pool classifies and
            retries it as a task's own out-of-memory.
    """
    status = _run_in_session(command, cwd, stdout_path, stderr_path)
    if status != 0:
        oom = _ran_out_of_memory(status, stderr_path)
        if oom is not None:
            raise oom
    return status


def _run_in_session(command: str, cwd: str, stdout_path: str, stderr_path: str) -> int:
    """:func:`run_command`'s run: the command's exit status."""
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            command,
            shell=True,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    stop = _StopFlag()
    try:
        previous: Any = signal.signal(signal.SIGTERM, stop.set)
    except ValueError:  # not the main thread: the pool's tree walk is all there is
        return proc.wait()
    try:
        status = _wait_unless_stopped(proc, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # Checked even when the shell ended: the pool's SIGTERM may have ended it, leaving
    # members of its group that ignore SIGTERM, orphaned where the pool's walk misses them.
    if stop.requested:
        _end_group(proc)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)  # another thread took the signal: leave as it would
    assert status is not None
    if _signal_group(proc.pid, 0):  # what the shell left running (``cmd &``) ends with it
        _end_group(proc)
    return status


def _wait_unless_stopped(proc: subprocess.Popen[bytes], stop: _StopFlag) -> int | None:
    """The command's status, or ``None`` once SIGTERM came. A wait with a timeout: a signal
    taken by another of the worker's threads does not interrupt a blocking ``waitpid``, and
    Python runs its handler only when the main thread runs again."""
    while not stop.requested:
        try:
            return proc.wait(timeout=_STOP_POLL_S)
        except subprocess.TimeoutExpired:
            continue
    return None


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group; SIGKILL to what is left after the grace."""
    group = proc.pid  # the session's leader: its group's id is its pid
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + COMMAND_GRACE_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=COMMAND_GRACE_S)
    # The shell is reaped; members it left (a command run with &) may still be there.
    while _signal_group(group, 0) and time.monotonic() < deadline:
        time.sleep(_GROUP_POLL_S)
    _signal_group(group, signal.SIGKILL)
    proc.wait()


def _signal_group(group: int, sig: int) -> bool:
    """Whether the group still had a process to signal."""
    try:
        os.killpg(group, sig)
    except OSError:
        return False
    return True


# -- the parent's side ---------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _Job:
    number: int
    line: str
    command: str
    stdout_path: str
    stderr_path: str
    future: Future[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class _InputEnded:
    """The input thread's last word: the input ended, or reading or submitting raised."""

    error: BaseException | None


def run_commands(
    template: str,
    lines: Iterable[str],
    *,
    key: str,
    pool_options: dict[str, Any],
    stdout: IO[bytes],
    stderr: IO[bytes],
) -> int:
    """Run ``template`` once per line on a :class:`~gpupool.GpuPoolExecutor`; the number
    of commands that failed (a non-zero status, or a task that could not run).

    The lines are read, and their commands submitted, by a thread of their own
    (:func:`_submit_lines`), so output is printed while the input waits. Each
    command's standard output and error are written to ``stdout`` and
    ``stderr`` in input order, one command's after another's; a failed
    command's status follows its own standard error, with its line.

    Raises:
        ConfigurationError: the pool refused ``pool_options``.
    """
    from gpupool import GpuPoolExecutor

    failed = 0
    with (
        tempfile.TemporaryDirectory(prefix="gpupool-run-") as spool,
        # No bar among the commands' output; Ctrl-C always ends the commands, whatever
        # GPUPOOL_PROGRESS and GPUPOOL_ON_INTERRUPT say.
        GpuPoolExecutor(**pool_options, progress=False, on_interrupt="terminate") as pool,
    ):
        jobs: queue.SimpleQueue[_Job | _InputEnded] = queue.SimpleQueue()
        room = threading.Semaphore(MAX_UNPRINTED_COMMANDS)
        view = pool.options(key=key)

        def submit(command: str, cwd: str, out: str, err: str) -> Future[int]:
            return view.submit(run_command, command, cwd, out, err)

        # A daemon: at Ctrl-C it may be blocked reading a terminal, and must not hold the exit.
        threading.Thread(
            target=_submit_lines,
            args=(template, lines, submit, spool, jobs, room),
            name="gpupool-run-input",
            daemon=True,
        ).start()
        try:
            number = 0
            while not isinstance(job := jobs.get(), _InputEnded):
                failed += _print_job(job, stdout, stderr)
                number = job.number
                room.release()
            if job.error is not None:  # the input could not be read, or the pool broke
                error = f"{type(job.error).__name__}: {job.error}"
                stderr.write(os.fsencode(f"gpupool run: stopped after line {number}: {error}\n"))
                failed += 1
        except Exception:
            # A closed output (``| head``): start nothing more; the running ones end.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return failed


def _submit_lines(
    template: str,
    lines: Iterable[str],
    submit: Callable[[str, str, str, str], Future[int]],
    spool: str,
    jobs: queue.SimpleQueue[_Job | _InputEnded],
    room: threading.Semaphore,
) -> None:
    """Submit a command per line, at most ``MAX_UNPRINTED_COMMANDS`` ahead of the printing."""
    cwd = os.getcwd()
    try:
        for number, line in enumerate(lines, 1):
            room.acquire()
            command = build_command(template, line)
            out, err = (os.path.join(spool, f"{number}.{kind}") for kind in ("out", "err"))
            future = submit(command, cwd, out, err)
            jobs.put(
                _Job(
                    number=number,
                    line=line,
                    command=command,
                    stdout_path=out,
                    stderr_path=err,
                    future=future,
                )
            )
    except BaseException as exc:  # handed to the printing thread, which raises it
        jobs.put(_InputEnded(error=exc))
        return
    jobs.put(_InputEnded(error=None))


def _print_job(job: _Job, stdout: IO[bytes], stderr: IO[bytes]) -> int:
    """Copy one command's output out (waiting for it to end); 1 when it failed, else 0."""
    try:
        status = job.future.result()
        problem = None if status == 0 else _describe_status(status)
    except CommandOutOfMemory as exc:  # and the pool's retries did not get it through
        problem = str(exc)
    except Exception as exc:  # the task could not run: the pool broke, the shell did not start
        problem = f"could not run ({type(exc).__name__}: {str(exc).rstrip('.')})"
    _copy_out(job.stdout_path, stdout)
    _copy_out(job.stderr_path, stderr)
    if problem is None:
        return 0
    line, command = _cut(repr(job.line)), _cut(job.command)
    stderr.write(os.fsencode(f"gpupool run: line {job.number} ({line}): {problem}: {command}\n"))
    stderr.flush()
    return 1


def _cut(text: str) -> str:
    """``text`` for a failure's line: at most :data:`MAX_SHOWN_CHARS` characters."""
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[: MAX_SHOWN_CHARS - 3]}..."


def _describe_status(status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}"
    return f"exit status {status}"


def _copy_out(path: str, stream: IO[bytes]) -> None:
    try:
        with open(path, "rb") as source:
            shutil.copyfileobj(source, stream)
    except FileNotFoundError:  # the task never started the command
        return
    stream.flush()
    os.unlink(path)


# -- the command line ----------------------------------------------------------------------


def add_run_parser(
    sub: Any,
    *,
    handler: Callable[[argparse.Namespace], int],
    size_type: Callable[..., Callable[[str], int]],
    count_type: Callable[[str], Callable[[str], int]],
) -> None:
    """Register ``gpupool run`` on ``sub`` (the CLI's subparsers)."""
    run = sub.add_parser(
        "run",
        usage=(
            "%(prog)s [-a FILE] [--task-peak SIZE] [--max-workers N] [--reserve SIZE] "
            "[--key KEY] [--log LOG.jsonl] -- COMMAND..."
        ),
        help="run a shell command per input line, each a task priced by its memory",
        description=(
            "Run COMMAND through the shell once per input line (standard input, or --input), "
            "each {} replaced by the line, shell-quoted (without {}, the line is appended), "
            "each command a task of a GpuPoolExecutor: as many run at once as the cards' "
            "memory holds, priced by --task-peak and then by the measured peak of the "
            "command's whole process tree. Output is printed per command, in input order."
        ),
        epilog=(
            "exit status: 0 every command succeeded; 1-100 that many failed; 101 more than "
            "100 failed (as GNU parallel); 2 also a usage error; 130 interrupted"
        ),
    )
    _add_pool_flags(run, size_type=size_type, count_type=count_type)
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the command; {} stands for the input line",
    )
    run.set_defaults(handler=handler, parser=run)


def _add_pool_flags(
    run: argparse.ArgumentParser,
    *,
    size_type: Callable[..., Callable[[str], int]],
    count_type: Callable[[str], Callable[[str], int]],
) -> None:
    run.add_argument(
        "-a",
        "--input",
        metavar="FILE",
        help="read the input lines from FILE (default: standard input; - is standard input)",
    )
    run.add_argument(
        "--task-peak",
        type=size_type("--task-peak", allow_zero=False, pool=True),
        metavar="SIZE",
        help="the estimated device peak of one command (6GiB); default: the first runs alone",
    )
    run.add_argument(
        "--max-workers",
        type=count_type("--max-workers"),
        metavar="N",
        help="at most this many commands at once (default: the usable CPUs)",
    )
    run.add_argument(
        "--reserve",
        type=size_type("--reserve", pool=True),
        metavar="SIZE",
        help="bytes kept free on every card (default 256MiB)",
    )
    run.add_argument(
        "--key",
        help="the task key the commands share their learned peak under (default: COMMAND)",
    )
    run.add_argument("--log", metavar="LOG.jsonl", help="append the pool's decisions to LOG.jsonl")


def run_from_args(args: argparse.Namespace, *, stdout: IO[bytes], stderr: IO[bytes]) -> int:
    """``gpupool run`` with parsed ``args``: checks them, then :func:`run_commands`."""
    from gpupool._errors import ConfigurationError

    parser: argparse.ArgumentParser = args.parser
    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    template = " ".join(words)
    if not template.strip():
        parser.error(
            "no command given: put it after --, with {} where the input line goes, "
            "e.g. gpupool run -- python eval.py {}"
        )
    if args.key is not None and not args.key:
        parser.error("--key '' is empty: give a name, or leave --key out for the command")
    options: dict[str, Any] = {
        "max_workers": args.max_workers,
        "task_peak": args.task_peak,
        "reserve": args.reserve,
        "log_path": args.log,
    }
    stream = _open_input(parser, args.input)
    with _sigterm_interrupts():
        try:
            failed = run_commands(
                template,
                read_lines(stream),
                key=args.key or template,
                pool_options={name: value for name, value in options.items() if value is not None},
                stdout=stdout,
                stderr=stderr,
            )
        except ConfigurationError as exc:
            stream.close()  # refused before the input thread started
            parser.error(str(exc))
    return exit_status(failed)


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the run as Ctrl-C does: a scheduler's ``kill`` leaves no command running
    (by default the process would die at once, and its commands, in sessions of their own,
    would outlive it)."""
    try:
        previous: Any = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _open_input(parser: argparse.ArgumentParser, path: str | None) -> IO[bytes]:
    """The input, opened for the input thread, which alone reads and closes it.

    Standard input is read through a stream of its own over a copy of its
    descriptor, not ``sys.stdin``: at Ctrl-C the thread may be blocked reading
    it, and the interpreter, exiting, would wait for ``sys.stdin``'s lock.
    """
    try:
        if path is None or path == "-":
            return open(os.dup(0), "rb")  # closed by read_lines, as the file below
        return open(path, "rb")
    except OSError as exc:
        where = "standard input" if path is None or path == "-" else f"--input {path!r}"
        parser.error(
            f"{where} cannot be read: {exc.strerror or exc}; pass a readable file "
            "of one input per line, or give the lines on standard input"
        )
