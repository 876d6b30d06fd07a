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
import hashlib
import os
import queue
import re
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from typing import IO, TYPE_CHECKING, Any, NoReturn

from gpupool._commands.run_output import (
    Halt,
    InputEnded,
    Job,
    OutputMode,
    describe_status,
    follow_jobs,
    parse_halt,
)
from gpupool._core.events import TASK_KEY_CHARS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from concurrent.futures import Future
    from types import FrameType

    from gpupool import GpuPoolExecutor
    from gpupool._pool.executor import _OptionsView

__all__ = [
    "ARGUMENTS_MARKER",
    "COMMAND_GRACE_S",
    "CommandOutOfMemory",
    "MAX_FAILED_STATUS",
    "MAX_UNPRINTED_COMMANDS",
    "REPLACEMENT_STRINGS",
    "add_run_parser",
    "build_command",
    "default_key",
    "exit_status",
    "read_lines",
    "replacement",
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

#: How often a stopping worker looks whether its command's process group is empty.
_GROUP_POLL_S = 0.02

#: How often a worker waiting for its command looks whether SIGTERM came (see
#: :func:`_wait_unless_stopped`).
_STOP_POLL_S = 0.1

#: GNU parallel's replacement strings that ``gpupool run`` knows: the input line, without
#: its extension, its base name, its directory, its base name without extension, and the
#: command's sequence number (from 1).
REPLACEMENT_STRINGS = ("{}", "{.}", "{/}", "{//}", "{/.}", "{#}")
#: How much of a NUL-separated input (``-0``) one read takes (what is there, up to this).
_NULL_READ_BYTES = 1 << 16

#: GNU parallel's marker of arguments given on the command line, after the command.
ARGUMENTS_MARKER = ":::"

_REPLACEMENT = re.compile(r"\{(?:|\.|/|//|/\.|#)\}")
_EXTENSION = re.compile(r"\.[^/.]*\Z")


def _without_extension(text: str) -> str:
    """``{.}``: the text less a last ``.ext`` that holds no ``/`` (GNU parallel's rule)."""
    return _EXTENSION.sub("", text)


def _base_name(text: str) -> str:
    """``{/}``: everything after the last ``/``."""
    return text.rpartition("/")[2]


def _directory(text: str) -> str:
    """``{//}``: the directory, as Perl's ``File::Basename::dirname`` (GNU parallel's) gives
    it: ``.`` for a name without ``/``, ``/`` for one just under the root; trailing slashes
    of the name are not a level."""
    stripped = text.rstrip("/")
    if not stripped:
        return "/" if text else "."
    head, slash, _ = stripped.rpartition("/")
    if not slash:
        return "."
    return head.rstrip("/") or "/"


def replacement(name: str, line: str, number: int) -> str:
    """What replacement string ``name`` (one of :data:`REPLACEMENT_STRINGS`) stands for."""
    if name == "{#}":
        return str(number)
    if name == "{.}":
        return _without_extension(line)
    if name == "{/}":
        return _base_name(line)
    if name == "{//}":
        return _directory(line)
    if name == "{/.}":
        return _without_extension(_base_name(line))
    return line


def build_command(template: str, line: str, number: int = 1) -> str:
    """The command for input ``line``, the ``number``-th: each replacement string (``{}``,
    ``{.}``, ``{/}``, ``{//}``, ``{/.}``, ``{#}``) replaced by what it stands for,
    shell-quoted.

    A template without any of them gets the quoted line appended as its last word, as GNU
    parallel does.
    """
    if not _REPLACEMENT.search(template):
        return f"{template} {shlex.quote(line)}"
    return _REPLACEMENT.sub(lambda m: shlex.quote(replacement(m.group(0), line, number)), template)


def exit_status(failed: int) -> int:
    """``gpupool run``'s exit status for ``failed`` failed commands (0 when none)."""
    return min(failed, MAX_FAILED_STATUS)


def read_lines(stream: IO[bytes], *, null: bool = False) -> Iterator[str]:
    """The input items: lines without their newline, or (``null``) the items between NUL
    bytes, decoded as file names are (undecodable bytes kept, as surrogate escapes, so they
    reach the command unchanged); closes ``stream`` at its end."""
    with stream:
        if not null:
            for raw in stream:
                yield os.fsdecode(raw[:-1] if raw.endswith(b"\n") else raw)
            return
        rest = b""
        read = getattr(stream, "read1", stream.read)
        while chunk := read(_NULL_READ_BYTES):
            *items, rest = (rest + chunk).split(b"\0")
            for item in items:
                yield os.fsdecode(item)
        if rest:
            yield os.fsdecode(rest)


# -- the worker's side ---------------------------------------------------------------------


class _StopFlag:
    """Set by SIGTERM while a command runs: the pool is stopping this worker."""

    __slots__ = ("requested",)

    def __init__(self) -> None:
        self.requested = False

    def set(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


class CommandOutOfMemory(RuntimeError):
    """A command failed and its error output says the device ran out of memory, or its card
    was full as it ran (``recognised``: ``"command-output"`` or ``"card-full"``).

    Raised in the worker in place of the command's exit status, so the pool
    classifies and retries it as it does a task's own out-of-memory. The
    message carries the status and the line (or the reading) that said so
    (kept for the error).
    """

    def __init__(self, message: str, status: int = 1, recognised: str = "command-output") -> None:
        super().__init__(message)
        self.status = status
        # "command-output": its error output said so; "card-full": it failed while its card
        # was full (gpupool._child.probe.card_full_in_task), whatever it said.
        self.recognised = recognised

    def __reduce__(self) -> tuple[Any, ...]:
        return CommandOutOfMemory, (str(self), self.status, self.recognised)


def _ran_out_of_memory(status: int, stderr_path: str) -> CommandOutOfMemory | None:
    """The command's failure as an out-of-memory, where its error output says one."""
    from gpupool._child.probe import OUTPUT_TAIL_BYTES, card_full_in_task, oom_in_output

    try:
        with open(stderr_path, "rb") as err:
            err.seek(max(0, os.fstat(err.fileno()).st_size - OUTPUT_TAIL_BYTES))
            line = oom_in_output(err.read())
    except OSError:
        line = None
    if line is not None:
        return CommandOutOfMemory(
            f"the command ran the device out of memory ({describe_status(status)}): {line}",
            status,
        )
    full = card_full_in_task()
    if full is None:
        return None
    return CommandOutOfMemory(
        f"the command failed ({describe_status(status)}) while its card was full: {full}",
        status,
        "card-full",
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
            NCCL's, torch's, CuPy's or JAX's words), or its card was full while
            it ran (an allocation refused to a process of the worker's tree, or
            the card's free bytes read below a few hundred MiB while the tree
            grew), so the pool classifies and retries it as a task's own
            out-of-memory.
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


def default_key(template: str) -> str:
    """The commands' task key when ``--key`` is not given: the command template, or, for one
    longer than a key may be (``TASK_KEY_CHARS``), its start and a digest of the whole, so
    that two long templates never share a key."""
    if len(template) <= TASK_KEY_CHARS:
        return template
    digest = hashlib.sha256(template.encode(errors="surrogateescape")).hexdigest()[:16]
    return f"{template[: TASK_KEY_CHARS - 40]}... [sha256 {digest}]"


def run_commands(
    template: str,
    lines: Iterable[str],
    *,
    key: str,
    pool_options: dict[str, Any],
    stdout: IO[bytes],
    stderr: IO[bytes],
    mode: OutputMode = "group",
    halt: Halt | None = None,
) -> int:
    """Run ``template`` once per line on a :class:`~gpupool.GpuPoolExecutor`; the exit
    status (:func:`exit_status` of the commands that failed, a non-zero status or a task
    that could not run; or, where ``halt`` was reached, the status it sets).

    The lines are read, and their commands submitted, by a thread of their own
    (:func:`_submit_lines`), so output is printed while the input waits. ``mode`` says how
    each command's standard output and error reach ``stdout`` and ``stderr``
    (:func:`~gpupool._commands.run_output.follow_jobs`); a failed command's status follows
    its own output, with its line.

    Raises:
        ConfigurationError: the pool refused ``pool_options``.
    """
    from gpupool import GpuPoolExecutor

    with (
        tempfile.TemporaryDirectory(prefix="gpupool-run-") as spool,
        # No bar among the commands' output; Ctrl-C always ends the commands, whatever
        # GPUPOOL_PROGRESS and GPUPOOL_ON_INTERRUPT say.
        GpuPoolExecutor(**pool_options, progress=False, on_interrupt="terminate") as pool,
    ):
        jobs: queue.SimpleQueue[Job | InputEnded] = queue.SimpleQueue()
        room = threading.Semaphore(MAX_UNPRINTED_COMMANDS)
        wake = threading.Event()
        halted = threading.Event()
        view = pool.options(key=key)
        stop = _halter(pool, room, halted)
        _start_input(view, template, lines, spool, jobs, room, wake, halted)
        try:
            failed, halt_status = follow_jobs(
                jobs,
                wake,
                mode=mode,
                halt=halt,
                on_halt=stop,
                on_printed=room.release,
                stdout=stdout,
                stderr=stderr,
            )
        except Exception:
            # A closed output (``| head``): start nothing more; the running ones end.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return exit_status(failed) if halt_status is None else halt_status


def _halter(
    pool: GpuPoolExecutor, room: threading.Semaphore, halted: threading.Event
) -> Callable[[Halt], None]:
    """What stops the run once its ``halt`` is reached: the input, then the commands."""

    def stop(reached: Halt) -> None:
        halted.set()
        room.release()  # the input thread, if it waits for room, sees the halt
        if reached.when == "now":
            pool.terminate_workers()
        else:
            pool.shutdown(wait=False, cancel_futures=True)

    return stop


def _start_input(
    view: _OptionsView,
    template: str,
    lines: Iterable[str],
    spool: str,
    jobs: queue.SimpleQueue[Job | InputEnded],
    room: threading.Semaphore,
    wake: threading.Event,
    halted: threading.Event,
) -> None:
    """Start the thread that reads the lines and submits their commands on ``view``
    (:func:`_submit_lines`); each command's end wakes the printing."""

    def submit(command: str, cwd: str, out: str, err: str) -> Future[int]:
        future = view.submit(run_command, command, cwd, out, err)
        future.add_done_callback(lambda _: wake.set())
        return future

    # A daemon: at Ctrl-C it may be blocked reading a terminal, and must not hold the exit.
    threading.Thread(
        target=_submit_lines,
        args=(template, lines, submit, spool, jobs, room, wake, halted),
        name="gpupool-run-input",
        daemon=True,
    ).start()


def _submit_lines(
    template: str,
    lines: Iterable[str],
    submit: Callable[[str, str, str, str], Future[int]],
    spool: str,
    jobs: queue.SimpleQueue[Job | InputEnded],
    room: threading.Semaphore,
    wake: threading.Event,
    halted: threading.Event,
) -> None:
    """Submit a command per line, at most ``MAX_UNPRINTED_COMMANDS`` ahead of the printing;
    none once ``halted``."""
    cwd = os.getcwd()
    try:
        for number, line in enumerate(lines, 1):
            room.acquire()
            if halted.is_set():
                break
            command = build_command(template, line, number)
            out, err = (os.path.join(spool, f"{number}.{kind}") for kind in ("out", "err"))
            future = submit(command, cwd, out, err)
            jobs.put(
                Job(
                    number=number,
                    line=line,
                    command=command,
                    stdout_path=out,
                    stderr_path=err,
                    future=future,
                )
            )
            wake.set()
    except BaseException as exc:  # handed to the printing thread, which says it
        jobs.put(InputEnded(error=None if halted.is_set() else exc))
    else:
        jobs.put(InputEnded(error=None))
    wake.set()


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
            "%(prog)s [-a FILE] [-0] [--line-buffer | -u] [--halt WHEN,WHY=N] "
            "[--task-peak SIZE] [--max-workers N] [--reserve SIZE] [--key KEY] "
            "[--log LOG.jsonl] -- COMMAND... [::: ARG...]"
        ),
        help="run a shell command per input line, each a task priced by its memory",
        description=(
            "Run COMMAND through the shell once per input line (standard input, --input, or "
            "the arguments after :::), with GNU parallel's replacement strings: {} the line, "
            "{.} without its extension, {/} its base name, {//} its directory, {/.} its base "
            "name without extension, {#} the command's number, each shell-quoted (with none, "
            "the line is appended). Each command is a task of a GpuPoolExecutor: as many run "
            "at once as the cards' memory holds, priced by --task-peak and then by the "
            "measured peak of the command's whole process tree. Output is printed per "
            "command, in input order, unless --line-buffer or -u streams it."
        ),
        epilog=(
            "exit status: 0 every command succeeded; 1-100 that many failed; 101 more than "
            "100 failed (as GNU parallel); 2 also a usage error; 130 interrupted"
        ),
    )
    _add_pool_flags(run, size_type=size_type, count_type=count_type)
    _add_output_flags(run)
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the command; {} stands for the input line; ::: ARG... gives the input",
    )
    run.set_defaults(handler=handler, parser=run)


def _add_pool_flags(
    run: argparse.ArgumentParser,
    *,
    size_type: Callable[..., Callable[[str], int]],
    count_type: Callable[[str], Callable[[str], int]],
) -> None:
    """The flags for the input (``-a``, ``-0``) and the pool's options, in ``--help``'s order."""
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
    run.add_argument(
        "-0",
        "--null",
        action="store_true",
        help="the input items end with a NUL byte, not a newline (find -print0)",
    )


def _add_output_flags(run: argparse.ArgumentParser) -> None:
    """The flags for how the commands' output is printed, and when the run halts."""
    output = run.add_mutually_exclusive_group()
    output.add_argument(
        "--line-buffer",
        "--lb",
        dest="output",
        action="store_const",
        const="line",
        default="group",
        help="print each command's complete lines as they are written, from any command",
    )
    output.add_argument(
        "-u",
        "--ungroup",
        dest="output",
        action="store_const",
        const="ungroup",
        help="print each command's output as it is written (lines of two may mix)",
    )
    run.add_argument(
        "--halt",
        metavar="WHEN,WHY=N",
        default="never",
        help="stop once N commands failed (fail), succeeded (success) or ended (done): "
        "now stops the running ones, soon lets them finish (GNU parallel's --halt; "
        "default never)",
    )


def run_from_args(args: argparse.Namespace, *, stdout: IO[bytes], stderr: IO[bytes]) -> int:
    """``gpupool run`` with parsed ``args``: checks them, then :func:`run_commands`."""
    from gpupool._errors import ConfigurationError

    parser: argparse.ArgumentParser = args.parser
    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    arguments = _arguments(parser, args, words)
    try:
        halt = parse_halt(args.halt)
    except ValueError as exc:
        parser.error(str(exc))
    template = " ".join(words)
    if not template.strip():
        parser.error(
            "no command given: put it after --, with {} where the input line goes, "
            "e.g. gpupool run -- python eval.py {}"
        )
    if args.key is not None and not args.key:
        parser.error("--key '' is empty: give a name, or leave --key out for the command")
    if args.key is not None and len(args.key) > TASK_KEY_CHARS:
        parser.error(
            f"--key has {len(args.key)} characters: a task key is a name of at most "
            f"{TASK_KEY_CHARS}; give a shorter one, or leave --key out for the command"
        )
    options: dict[str, Any] = {
        "max_workers": args.max_workers,
        "task_peak": args.task_peak,
        "reserve": args.reserve,
        "log_path": args.log,
    }
    stream: IO[bytes] | None = None
    lines: Iterable[str]
    if arguments is not None:
        lines = arguments
    else:
        stream = _open_input(parser, args.input)
        lines = read_lines(stream, null=args.null)
    with _sigterm_interrupts():
        try:
            return run_commands(
                template,
                lines,
                key=args.key or default_key(template),
                pool_options={name: value for name, value in options.items() if value is not None},
                stdout=stdout,
                stderr=stderr,
                mode=args.output,
                halt=halt,
            )
        except ConfigurationError as exc:
            if stream is not None:
                stream.close()  # refused before the input thread started
            parser.error(str(exc))


def _arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, words: list[str]
) -> list[str] | None:
    """The arguments after ``:::`` (taken out of ``words``, the command), the input in place
    of standard input or ``--input``; ``None`` when there is no ``:::``."""
    if ARGUMENTS_MARKER not in words:
        if "::::" in words:
            parser.error(":::: FILE is not supported: give the file with -a FILE")
        return None
    at = words.index(ARGUMENTS_MARKER)
    arguments = words[at + 1 :]
    del words[at:]
    if ARGUMENTS_MARKER in arguments or "::::" in arguments:
        parser.error(
            "one ::: input source only (GNU parallel combines several; gpupool run does "
            "not): give the combinations as lines on standard input"
        )
    if args.input is not None:
        parser.error(f"::: and --input {args.input!r} both give the input: give one of them")
    if not arguments:
        parser.error("::: with no argument after it: give the inputs after :::, or leave it out")
    return arguments


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
