"""``gpupool run``'s parent side: its commands' output, how they ended, and ``--halt``.

::

    submitted jobs (in input order) ──> follow_jobs: each turn
        each job's <n>.out / <n>.err  ──> "group":   copied whole, in input order, once the
                                                     command and every one before it ended
                                          "line":    complete lines as they are written, from
                                                     any command (GNU parallel's --line-buffer)
                                          "ungroup": bytes as they are written (-u)
        each ended job ──> counted (failed / succeeded) ──> --halt reached? ──> halt(now)

The commands write to their spool files themselves; this side reads them. In the
streaming modes the files are read every :data:`STREAM_POLL_S`; a command's failure
is said when it ends, after the rest of its output.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

__all__ = [
    "MAX_SHOWN_CHARS",
    "OUTPUT_MODES",
    "STREAM_POLL_S",
    "Halt",
    "InputEnded",
    "Job",
    "OutputMode",
    "describe_status",
    "follow_jobs",
    "parse_halt",
]

#: How output is printed: whole per command in input order, by complete lines as they
#: come, or as it comes.
OutputMode = Literal["group", "line", "ungroup"]
OUTPUT_MODES: tuple[OutputMode, ...] = ("group", "line", "ungroup")

#: How often the streaming modes read what the running commands wrote.
STREAM_POLL_S = 0.05

#: The most characters of a failed command's line, and of the command, its message shows.
MAX_SHOWN_CHARS = 300

#: The most bytes read from one command's file per turn (a fast writer cannot hold the
#: others' output back for long).
_READ_BYTES = 1 << 16


@dataclass(slots=True, kw_only=True)
class Job:
    """One command: its input line, where its output goes, and its future (its status)."""

    number: int
    line: str
    command: str
    stdout_path: str
    stderr_path: str
    future: Future[int]
    # Streaming: how far each file was read, and the part of a line not yet printed.
    read_bytes: list[int] = field(default_factory=lambda: [0, 0])
    partial: list[bytes] = field(default_factory=lambda: [b"", b""])
    # How it ended was counted (``problem``: what went wrong, in words), its output printed.
    counted: bool = False
    problem: str | None = None
    printed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class InputEnded:
    """The input thread's last word: the input ended, or reading or submitting raised."""

    error: BaseException | None


# -- --halt ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Halt:
    """GNU parallel's ``--halt WHEN,WHY=N``: once ``N`` commands failed (``fail``),
    succeeded (``success``) or ended either way (``done``), start no more; ``now`` also
    stops the running ones (SIGTERM to each command's process group, SIGKILL after 1 s),
    ``soon`` lets them finish."""

    when: Literal["now", "soon"]
    why: Literal["fail", "success", "done"]
    count: int

    def reached(self, failed: int, succeeded: int) -> bool:
        """Whether ``failed`` and ``succeeded`` commands meet the condition."""
        done = {"fail": failed, "success": succeeded, "done": failed + succeeded}[self.why]
        return done >= self.count

    def __str__(self) -> str:
        return f"{self.when},{self.why}={self.count}"


#: GNU parallel's older forms of ``--halt``.
_LEGACY_HALTS = {
    "1": "soon,fail=1",
    "2": "now,fail=1",
    "-1": "soon,success=1",
    "-2": "now,success=1",
}


def parse_halt(text: str) -> Halt | None:
    """``--halt``'s value: ``never`` (or ``0``: ``None``), ``now|soon,fail|success|done=N``,
    or GNU parallel's ``1``, ``2``, ``-1``, ``-2``.

    Raises:
        ValueError: the text is none of those (the message says what is).
    """
    text = text.strip()
    if text in ("never", "0"):
        return None
    spelled = _LEGACY_HALTS.get(text, text)
    when, _, rest = spelled.partition(",")
    why, _, count = rest.partition("=")
    if when not in ("now", "soon") or why not in ("fail", "success", "done"):
        raise ValueError(
            f"--halt {text!r}: give WHEN,WHY=N with WHEN now or soon and WHY fail, success or "
            "done (now,fail=1: stop everything at the first failure), or never"
        )
    if count.endswith("%"):
        raise ValueError(
            f"--halt {text!r}: a percentage needs the number of commands, which gpupool run "
            "does not know before its input ends; give a number of commands"
        )
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--halt {text!r}: N must be a whole number of commands, 1 or more")
    return Halt(when=when, why=why, count=int(count))  # type: ignore[arg-type]


# -- following the jobs --------------------------------------------------------------------


@dataclass(slots=True)
class _Tally:
    """How the commands ended, and the halt, once reached."""

    failed: int = 0
    succeeded: int = 0
    stopped: int = 0
    last_failed_status: int = 1
    last_line: int = 0
    halted: Halt | None = None


def follow_jobs(
    jobs: queue.SimpleQueue[Job | InputEnded],
    wake: threading.Event,
    *,
    mode: OutputMode,
    halt: Halt | None,
    on_halt: Callable[[Halt], None],
    on_printed: Callable[[], None],
    stdout: IO[bytes],
    stderr: IO[bytes],
) -> tuple[int, int | None]:
    """Print every job's output as ``mode`` says and count how each ended, until the input
    ended and every job was printed; returns ``(failed, halt_status)``: the commands that
    failed, and where ``halt`` was reached the exit status it sets (``None``: not reached).

    ``wake`` is set when a job is queued or ends; ``on_halt`` is called once, when ``halt``
    is reached; ``on_printed`` once per job done with (its output printed).
    """
    pending: list[Job] = []
    tally = _Tally()
    ended: InputEnded | None = None
    streaming = mode != "group"
    while True:
        wake.clear()
        if ended is None:
            ended = _take_queued(jobs, pending)
        # How each command ended is counted when it ends (a --halt is reached then), and
        # said when its output is printed.
        _count_ended(pending, tally, halt, on_halt, stderr)
        _print_output(pending, mode, stdout, stderr)
        _drop_printed(pending, streaming, on_printed, stderr)
        if ended is not None and not pending:
            break
        wake.wait(STREAM_POLL_S if streaming else 0.5)
    if ended is not None and ended.error is not None and tally.halted is None:
        error = f"{type(ended.error).__name__}: {ended.error}"
        stderr.write(os.fsencode(f"gpupool run: stopped after line {tally.last_line}: {error}\n"))
        stderr.flush()
        tally.failed += 1
    return tally.failed, _halt_status(tally)


def _take_queued(
    jobs: queue.SimpleQueue[Job | InputEnded], pending: list[Job]
) -> InputEnded | None:
    """Move the jobs queued since the last turn to ``pending``; the input's end, once queued."""
    while True:
        try:
            item = jobs.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, InputEnded):
            return item
        pending.append(item)


def _count_ended(
    pending: list[Job],
    tally: _Tally,
    halt: Halt | None,
    on_halt: Callable[[Halt], None],
    stderr: IO[bytes],
) -> None:
    """Count each job that ended since the last turn; say ``halt`` and call ``on_halt`` once
    it is reached."""
    for job in pending:
        if job.counted or not job.future.done():
            continue
        job.counted = True
        job.problem = _classify(job, tally)
        if (
            halt is not None
            and tally.halted is None
            and halt.reached(tally.failed, tally.succeeded)
        ):
            tally.halted = halt
            _say_halt(halt, job, pending, stderr)
            on_halt(halt)


def _print_output(
    pending: list[Job], mode: OutputMode, stdout: IO[bytes], stderr: IO[bytes]
) -> None:
    """Print what the jobs wrote as ``mode`` says: streamed as it comes, or each ended job's
    whole, in input order."""
    if mode != "group":
        for job in pending:
            if job.counted or job.future.running():  # one not started has written nothing
                _pump(job, stdout, stderr, line_mode=mode == "line", final=job.counted)
    else:
        for job in _ready_in_order(pending):
            _copy_out(job.stdout_path, stdout)
            _copy_out(job.stderr_path, stderr)


def _drop_printed(
    pending: list[Job], streaming: bool, on_printed: Callable[[], None], stderr: IO[bytes]
) -> None:
    """Say how each ended job whose output is printed failed, if it did, and drop it from
    ``pending``."""
    for job in [j for j in pending if j.counted and (streaming or j.printed)]:
        _say_problem(job, stderr)
        pending.remove(job)
        on_printed()


def _ready_in_order(pending: list[Job]) -> list[Job]:
    """The jobs that may be printed now in input order (each marked printed): the ended
    ones before the first that has not ended."""
    ready = []
    for job in pending:
        if not job.counted:
            break
        job.printed = True
        ready.append(job)
    return ready


def _halt_status(tally: _Tally) -> int | None:
    """The exit status a reached ``--halt`` sets, as GNU parallel's: the failing command's
    own status for ``fail=1``; 0 for ``success``; else ``None`` (the count of failures)."""
    halted = tally.halted
    if halted is None:
        return None
    if halted.why == "success":
        return 0
    if halted.why == "fail" and halted.count == 1:
        return tally.last_failed_status
    return None


def _say_halt(halt: Halt, job: Job, pending: list[Job], stderr: IO[bytes]) -> None:
    running = sum(1 for j in pending if j.future.running())
    then = (
        f"stopping {running} running command{'s' if running != 1 else ''}"
        if halt.when == "now"
        else f"waiting for {running} running command{'s' if running != 1 else ''}"
    )
    stderr.write(
        os.fsencode(
            f"gpupool run: --halt {halt} reached at line {job.number}: starting no more "
            f"commands; {then}\n"
        )
    )
    stderr.flush()


def _classify(job: Job, tally: _Tally) -> str | None:
    """Count how ``job`` ended; what went wrong, in words (``None``: it succeeded, or the
    halt stopped it)."""
    tally.last_line = max(tally.last_line, job.number)
    try:
        status = job.future.result()
    except Exception as exc:  # the task could not run: the pool broke, the shell did not start
        if (tally.halted is not None and tally.halted.when == "now") or job.future.cancelled():
            tally.stopped += 1  # stopped, or never started, by --halt
            return None
        tally.failed += 1
        ran: object = getattr(exc, "status", None)
        if type(exc).__name__ == "CommandOutOfMemory" and isinstance(ran, int):
            # It ran, and the pool's retries of its out-of-memory did not get it through.
            tally.last_failed_status = ran if ran > 0 else 128 - ran
            return str(exc)
        tally.last_failed_status = 1
        return f"could not run ({type(exc).__name__}: {str(exc).rstrip('.')})"
    if status == 0:
        tally.succeeded += 1
        return None
    if tally.halted is not None and tally.halted.when == "now" and status < 0:
        tally.stopped += 1  # ended by the halt's SIGTERM
        return None
    tally.failed += 1
    tally.last_failed_status = status if status > 0 else 128 - status
    return describe_status(status)


def _say_problem(job: Job, stderr: IO[bytes]) -> None:
    """A failed command's line on ``stderr``, after its own output."""
    if job.problem is None:
        return
    line, command = _cut(repr(job.line)), _cut(job.command)
    stderr.write(
        os.fsencode(f"gpupool run: line {job.number} ({line}): {job.problem}: {command}\n")
    )
    stderr.flush()


def _cut(text: str) -> str:
    """``text`` for a failure's line: at most :data:`MAX_SHOWN_CHARS` characters."""
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[: MAX_SHOWN_CHARS - 3]}..."


def describe_status(status: int) -> str:
    """How a command with exit ``status`` ended, in words."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}"
    return f"exit status {status}"


# -- the output files ----------------------------------------------------------------------


def _copy_out(path: str, stream: IO[bytes]) -> None:
    """A command's whole file to ``stream``; the file goes."""
    try:
        with open(path, "rb") as source:
            while chunk := source.read(_READ_BYTES):
                stream.write(chunk)
    except FileNotFoundError:  # the task never started the command
        return
    stream.flush()
    os.unlink(path)


def _pump(job: Job, stdout: IO[bytes], stderr: IO[bytes], *, line_mode: bool, final: bool) -> None:
    """What ``job`` wrote since the last turn: to ``stdout``/``stderr`` as it came, or
    (``line_mode``) its complete lines, the rest held until the next; ``final``: the command
    ended, so everything is printed and its files go."""
    for index, (path, stream) in enumerate(((job.stdout_path, stdout), (job.stderr_path, stderr))):
        data = _read_new(job, index, path, everything=final)
        if line_mode and not final:
            data = job.partial[index] + data
            cut = data.rfind(b"\n") + 1
            job.partial[index], data = data[cut:], data[:cut]
        elif line_mode:
            data, job.partial[index] = job.partial[index] + data, b""
        if data:
            stream.write(data)
            stream.flush()
        if final:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _read_new(job: Job, index: int, path: str, *, everything: bool) -> bytes:
    """The bytes of ``path`` after those read before (at most :data:`_READ_BYTES` a turn,
    unless ``everything``)."""
    try:
        with open(path, "rb") as source:
            source.seek(job.read_bytes[index])
            data = source.read() if everything else source.read(_READ_BYTES)
    except FileNotFoundError:  # not started yet
        return b""
    job.read_bytes[index] += len(data)
    return data
