"""Read a decision log file, record by record: bounded, validated, never trusted.

A log is input from strangers (whoever could write the file), so this reader
streams it one line at a time, refuses lines past :data:`MAX_LINE_BYTES`,
parses with :mod:`json` alone (nothing in a log is executed or unpickled),
and checks each record against the schema of :mod:`gpupool._core.events`
(known events, readable schema versions, flat values or bounded tables). A
last line cut short, as a killed or still-running pool leaves it, is dropped
and named (:class:`CutLine`); every record before it is read.
:mod:`gpupool._observe.postmortem` folds the records into what ``gpupool postmortem``
and ``gpupool plot`` say.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpupool._core.events import (
    EVENTS,
    READABLE_SCHEMAS,
    TABLE_COLUMNS,
    TABLE_ROWS,
)
from gpupool._core.units import format_size
from gpupool._errors import GpuPoolError

__all__ = [
    "MAX_LINE_BYTES",
    "CutLine",
    "CutLogWarning",
    "DecisionLogError",
    "EmptyLogError",
    "OnCut",
    "iter_records",
]

#: The longest line a decision record can be. The executor caps the one free
#: text it copies (an error message) at 500 characters; a record is under
#: 4 KiB. A longer line means the file is not a decision log, and reading it
#: whole would break the reader's memory bound.
MAX_LINE_BYTES = 1024 * 1024


class DecisionLogError(GpuPoolError, ValueError):
    """The file is not a decision log this gpupool can read.

    Attributes:
        path: the file.
        line: the 1-based line number at fault, or ``None`` for the whole file.
    """

    def __init__(self, message: str, *, path: str, line: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.line = line

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_log_error, (type(self), str(self), self.path, self.line))


def _rebuild_log_error(
    cls: type[DecisionLogError], message: str, path: str, line: int | None
) -> DecisionLogError:
    return cls(message, path=path, line=line)


class EmptyLogError(DecisionLogError):
    """The file holds no decision records."""


class _CutRecordError(DecisionLogError):
    """The file's last line is a record cut short (no newline, not whole JSON)."""


class CutLogWarning(UserWarning):
    """A log's last line was cut short and dropped (warned when no ``on_cut`` is given)."""


@dataclass(frozen=True, slots=True)
class CutLine:
    """A record cut short, dropped: the last line, with no newline and not a whole record;
    or the start of a line, before a whole record that a later pool appended after it.

    A pool writes each record with its newline in one write, so such a line
    is a record the pool was killed while writing, or one it is writing now.
    The next run of a script appends its first record to the same line.

    Attributes:
        path: the log.
        line: the line's 1-based number.
        dropped_bytes: the bytes of the line that were dropped.
        followed: the cut record is followed on its line by a whole record (read).
    """

    path: str
    line: int
    dropped_bytes: int
    followed: bool = False

    def __str__(self) -> str:
        if self.followed:
            return (
                f"{self.path}, line {self.line}: begins with a record cut short (its pool was "
                "killed while writing it, and a later record was appended after it); dropped "
                f"its {self.dropped_bytes} bytes and read the record after it"
            )
        return (
            f"{self.path}, line {self.line}: the last line is incomplete (no newline: the pool "
            "was killed while writing it, or is still writing it); dropped its "
            f"{self.dropped_bytes} bytes and read the records before it"
        )


#: What a reader is told of a cut last line (:class:`CutLine`).
OnCut = Callable[[CutLine], None]


def _warn_cut(cut: CutLine) -> None:
    warnings.warn(str(cut), CutLogWarning, stacklevel=4)


# -- reading ---------------------------------------------------------------------------


def _open_log(path: str | Path) -> IO[bytes]:
    """Open a log for reading: ``-`` is standard input; otherwise a regular file only.

    A FIFO or a device is refused before any read, so that a reader never
    blocks on a pipe with no writer (``gpupool postmortem FIFO``).
    """
    name = str(path)
    if name == "-":
        return os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise DecisionLogError(
            f"{name}: cannot be read ({exc.strerror or exc})", path=name, line=None
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else (
                    "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
                )
            )
            raise DecisionLogError(
                f"{name}: {kind}, not a decision log file; to read a stream, pass - for "
                f"the log and redirect the stream to standard input (- < {name})",
                path=name,
                line=None,
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def iter_records(
    path: str | Path, *, on_cut: OnCut | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each record in a decision log, streaming.

    Blank lines are skipped. Only :func:`json.loads` touches the text. A last
    line without a newline that is not whole JSON (a pool killed mid-write, or
    one still writing) is dropped and reported to ``on_cut``: the records
    before it are read. Reading stops at the first line without a newline,
    so a record a live pool finishes meanwhile is never read as two lines.
    A line that is a record cut short followed by a whole record (the next
    run appended after a killed one) is read as that record, and its cut
    part reported to ``on_cut`` too.

    Args:
        path: a JSON Lines decision log, or ``"-"`` for standard input.
        on_cut: called with the dropped line (:class:`CutLine`); by default
            a :class:`CutLogWarning` is issued.

    Yields:
        The 1-based line number and the record as a dict.

    Raises:
        DecisionLogError: the file cannot be opened or read, is not a regular
            file (a FIFO, a device), a line before the last is not UTF-8
            JSON, a line is not a decision record, or was written with a
            newer schema; the message names the line.
        EmptyLogError: the file holds no whole records.
    """
    name = "<stdin>" if str(path) == "-" else str(path)
    handle = _open_log(path)
    seen = 0
    number = 0
    try:
        while True:
            raw = _read_line(handle, name, number + 1)
            if not raw:
                break
            number += 1
            ended = raw.endswith(b"\n")
            if raw.strip():
                # readline() stops short of a newline only at the end of the file, as
                # it stands now: a live writer may append the rest after this read.
                record = _line_record(raw, number=number, last=not ended, path=name, on_cut=on_cut)
                if record is None:
                    break
                seen += 1
                yield number, record
            if not ended:
                break
    finally:
        handle.close()
    if seen == 0:
        raise EmptyLogError(
            f"{name}: empty, no decision records (was log_path= given to the pool, and did "
            "the pool get as far as its construction?)",
            path=name,
            line=None,
        )


def _line_record(
    raw: bytes, *, number: int, last: bool, path: str, on_cut: OnCut | None
) -> dict[str, Any] | None:
    """One line's record, its cut part (if any) told to ``on_cut``; ``None``: the last line
    was cut short, and reading stops there."""
    try:
        return _parse_line(raw, number=number, last=last, path=path)
    except _CutRecordError:
        (on_cut or _warn_cut)(CutLine(path, number, len(raw)))
        return None
    except DecisionLogError:
        followed = _after_a_cut(raw, number=number, path=path)
        if followed is None:
            raise
        cut_bytes, record = followed
        (on_cut or _warn_cut)(CutLine(path, number, cut_bytes, followed=True))
        return record


def _after_a_cut(raw: bytes, *, number: int, path: str) -> tuple[int, dict[str, Any]] | None:
    """A line that is a record cut short followed by a whole record (a pool killed mid-write,
    then another run appended): the cut bytes and the record; ``None`` for any other line."""
    start = raw.find(b'{"schema": ', 1)
    if start < 0 or not raw.lstrip().startswith(b"{"):
        return None
    try:
        return start, _parse_line(raw[start:], number=number, last=False, path=path)
    except DecisionLogError:
        return None


def _read_line(handle: IO[bytes], name: str, number: int) -> bytes:
    """The next line, its newline included (``b""`` at the end); bounded by MAX_LINE_BYTES."""
    try:
        raw = handle.readline(MAX_LINE_BYTES + 1)
    except OSError as exc:
        raise DecisionLogError(
            f"{name}, line {number}: cannot be read ({exc.strerror or exc})",
            path=name,
            line=number,
        ) from None
    if len(raw) > MAX_LINE_BYTES:
        raise DecisionLogError(
            f"{name}, line {number}: longer than {format_size(MAX_LINE_BYTES)}; "
            "not a gpupool decision log",
            path=name,
            line=number,
        )
    return raw


def _parse_line(raw: bytes, *, number: int, last: bool, path: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        if last and raw.lstrip().startswith(b"{"):
            raise _CutRecordError(
                f"{path}, line {number}: truncated (the file ends in the middle of a record: "
                "was the pool killed, or is it still writing?)",
                path=path,
                line=number,
            ) from None
        raise DecisionLogError(
            f"{path}, line {number}: not JSON; not a gpupool decision log",
            path=path,
            line=number,
        ) from None
    if not isinstance(value, dict) or "schema" not in value or "event" not in value:
        raise DecisionLogError(
            f"{path}, line {number}: not a gpupool decision record (a JSON object with "
            "'schema' and 'event' keys)",
            path=path,
            line=number,
        )
    schema = value["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise DecisionLogError(
            f"{path}, line {number}: schema {schema!r} is not a decision-log schema version",
            path=path,
            line=number,
        )
    if schema > max(READABLE_SCHEMAS):
        raise DecisionLogError(
            f"{path}, line {number}: written with decision-log schema {schema}; this gpupool "
            f"reads schema {max(READABLE_SCHEMAS)} at most. Read it with a newer gpupool.",
            path=path,
            line=number,
        )
    for key, item in value.items():
        problem = _value_problem(item, tables=schema >= 3)
        if problem is not None:
            raise DecisionLogError(
                f"{path}, line {number}: {key!r} holds {problem}, not a value a decision "
                "record has",
                path=path,
                line=number,
            )
    if not isinstance(value["event"], str) or value["event"] not in EVENTS:
        raise DecisionLogError(
            f"{path}, line {number}: unknown event {value['event']!r} for schema {schema}",
            path=path,
            line=number,
        )
    return value


def _scalar_problem(item: object) -> str | None:
    if isinstance(item, (dict, list)) or (
        isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**63
    ):
        return f"{type(item).__name__} {str(item)[:40]!r}"
    return None


def _value_problem(item: object, *, tables: bool) -> str | None:
    """What is wrong with a record's value: records are flat (scalars, byte counts within
    int64), and from schema 3 a value may be a table, a bounded list of flat rows."""
    if not (tables and isinstance(item, list)):
        return _scalar_problem(item)
    if len(item) > TABLE_ROWS:
        return f"a table of {len(item)} rows (at most {TABLE_ROWS})"
    for row in item:
        if not isinstance(row, dict) or len(row) > TABLE_COLUMNS:
            return f"a table row {str(row)[:40]!r} (a JSON object of at most {TABLE_COLUMNS})"
        for cell in row.values():
            problem = _scalar_problem(cell)
            if problem is not None:
                return f"a table cell {problem}"
    return None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a decision-log value")
