"""The CUDA context a worker is priced at where its own row cannot be read (pure core).

A worker measures its context from its own device row, less what its frameworks'
counters hold (``context_source="process-row"``). Where the driver hides the rows (a
container, rows of 0, MIG) it cannot, and is priced at an estimate instead. The
estimate is grounded in what the host has measured: pools that could read a row keep
the largest context seen on each card model in a small file beside the host's
booking table (:mod:`gpupool._sensors.contexts`), and a pool that cannot read one
prices its context at the largest of the built-in default
(:data:`CONTEXT_ESTIMATE_BYTES`), its own user's largest recorded for its card's
model, and the largest that two users recorded (:func:`decide_context_estimate`).
The source says which.

The files may be written by other users (a table shared by every user): a text is
refused past :data:`MAX_CONTEXT_FILE_BYTES` or :data:`MAX_MODELS` models, and an
entry whose figure is not a whole number of bytes in
``(0, CONTEXT_PLAUSIBLE_MAX_BYTES]`` is refused with its reason. A figure below the
default changes nothing, so no file can lower a pool's context estimate; and another
user's figure counts only where a second user recorded as much, so one hostile user
cannot raise it either (two colluding users can, to at most
:data:`CONTEXT_PLAUSIBLE_MAX_BYTES`).
"""

# No postponed annotations here: a named tuple's string annotations are compiled as it is made,
# which a worker would pay at every start.

import math
from typing import NamedTuple

from gpupool._core.units import GiB, MiB, format_size

__all__ = [
    "CONTEXT_ESTIMATE_BYTES",
    "CONTEXT_PLAUSIBLE_MAX_BYTES",
    "DEFAULT_SOURCE",
    "MAX_CONTEXT_FILE_BYTES",
    "MAX_MODELS",
    "ContextEstimate",
    "ContextRecord",
    "decide_context_estimate",
    "format_context_file",
    "parse_context_file",
]

#: What a worker is taken to hold outside the frameworks' allocators (its CUDA context,
#: mostly) where no device row of it can be read and the host recorded no larger context
#: on its card's model: a context measures 300-600 MiB on H100/H200 with CUDA's lazy
#: module loading. Eager module loading, NCCL communicators and workspaces outside
#: torch's allocator can hold more: the host's measurements then raise it.
CONTEXT_ESTIMATE_BYTES = 640 * MiB

#: The most a process can hold outside the frameworks' allocators and be this worker: a
#: judgement, set well above a CUDA context with its modules loaded eagerly, NCCL's
#: buffers and library workspaces together. A row under a worker's PID that holds more
#: is another namespace's process; a recorded context above it is refused.
CONTEXT_PLAUSIBLE_MAX_BYTES = 6 * GiB

#: The largest contexts file read (an honest one is about 200 bytes a model).
MAX_CONTEXT_FILE_BYTES = 16 * 1024
#: The most card models a file describes; a file with more is refused whole.
MAX_MODELS = 32
#: The longest model name, program name and pool id kept (longer ones are refused).
_MAX_NAME = 96

#: The source of the built-in estimate.
DEFAULT_SOURCE = "estimated (default)"

_VERSION = 1


class ContextRecord(NamedTuple):
    """The largest context one user's pools measured on one card model.

    Attributes:
        model: the card's model, as the driver names it (NVML's name).
        context_bytes: the largest context measured on it.
        uid: the user whose pool measured it (the file's owner).
        program: the program that ran that pool (its script's name), for people.
        pool: that pool's id (``<pid>.<n>``).
        time_s: when, in seconds since the epoch.
    """

    model: str
    context_bytes: int
    uid: int
    program: str
    pool: str
    time_s: float

    def by(self) -> str:
        """Who measured it, in words: ``uid 1000 (train.py, pool 4242.1)``."""
        return f"uid {self.uid} ({self.program}, pool {self.pool})"


class ContextEstimate(NamedTuple):
    """The context a worker of a card is priced at where its own row cannot be read.

    Attributes:
        context_bytes: the figure.
        source: where it comes from: :data:`DEFAULT_SOURCE`,
            ``"estimated (largest measured on <model>: <size>, by <who>)"`` (this user's
            own largest), or ``"estimated (largest measured on <model> by two users:
            <size>, by <who>; <who> measured <size>)"`` (the largest two users agree on).
        set_aside: other users' records larger than the figure that no second user
            matched: not used (one user's file alone never raises another's figure).
    """

    context_bytes: int
    source: str
    set_aside: tuple[ContextRecord, ...] = ()

    def pair(self) -> tuple[int, str]:
        """``(context_bytes, source)``: what a worker is told at its start."""
        return self.context_bytes, self.source


def _name(value: object) -> str | None:
    """``value`` where it is a printable name of at most ``_MAX_NAME`` characters."""
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME:
        return None
    return value if value.isprintable() else None


def _entry(model: str, value: object, uid: int) -> ContextRecord | str:
    """One model's entry of a file owned by ``uid``, or why it is refused."""
    if not isinstance(value, dict):
        return f"{model!r}: not an object"
    figure = value.get("context_bytes")
    if type(figure) is not int:
        return f"{model!r}: context_bytes {figure!r} is not a whole number of bytes"
    if figure <= 0:
        return f"{model!r}: context_bytes {figure} is not positive"
    if figure > CONTEXT_PLAUSIBLE_MAX_BYTES:
        return (
            f"{model!r}: context_bytes {figure} is more than any CUDA context "
            f"({format_size(CONTEXT_PLAUSIBLE_MAX_BYTES)})"
        )
    program, pool, time_s = (
        _name(value.get("program")),
        _name(value.get("pool")),
        value.get("time_s"),
    )
    if program is None or pool is None:
        return f"{model!r}: its program or pool is not a short printable name"
    if type(time_s) not in (int, float) or not math.isfinite(time_s):  # type: ignore[arg-type]
        return f"{model!r}: time_s {time_s!r} is not a time"
    return ContextRecord(
        model=model,
        context_bytes=figure,
        uid=uid,
        program=program,
        pool=pool,
        time_s=float(time_s),  # type: ignore[arg-type]
    )


def parse_context_file(data: bytes, *, uid: int) -> tuple[dict[str, ContextRecord], list[str]]:
    """The entries of a contexts file owned by ``uid``, and why any were refused.

    Raises:
        ValueError: the text is not a contexts file (too large, not JSON, not the
            layout, another version, more than :data:`MAX_MODELS` models).
    """
    if len(data) > MAX_CONTEXT_FILE_BYTES:
        raise ValueError(f"it holds more than {MAX_CONTEXT_FILE_BYTES} bytes")
    import json  # a worker imports this module for its figures, never to read a file

    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"it is not JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict) or value.get("version") != _VERSION:
        raise ValueError(f"it is not a version {_VERSION} contexts file")
    models = value.get("models")
    if not isinstance(models, dict):
        raise ValueError("its models are not an object")
    if len(models) > MAX_MODELS:
        raise ValueError(f"it describes {len(models)} card models, more than {MAX_MODELS}")
    entries: dict[str, ContextRecord] = {}
    refused: list[str] = []
    for model, entry in models.items():
        if _name(model) is None:
            refused.append("a model name that is not a short printable name")
            continue
        judged = _entry(model, entry, uid)
        if isinstance(judged, str):
            refused.append(judged)
        else:
            entries[model] = judged
    return entries, refused


def format_context_file(entries: dict[str, ContextRecord]) -> bytes:
    """The text of a contexts file holding ``entries`` (the first :data:`MAX_MODELS`)."""
    models = {
        model: {
            "context_bytes": record.context_bytes,
            "program": record.program,
            "pool": record.pool,
            "time_s": record.time_s,
        }
        for model, record in sorted(entries.items())[:MAX_MODELS]
    }
    import json

    return json.dumps({"version": _VERSION, "models": models}, indent=1).encode() + b"\n"


def decide_context_estimate(
    records: list[ContextRecord],
    model: str,
    default_bytes: int = CONTEXT_ESTIMATE_BYTES,
    *,
    uid: int,
) -> ContextEstimate:
    """The context a worker of user ``uid`` on a card of ``model`` is priced at where its row
    cannot be read: the largest of ``default_bytes``, ``uid``'s own largest record for the
    model, and the largest figure that at least two distinct users recorded (the
    second-largest of the per-user largest). A short figure risks an out-of-memory, a long
    one costs packing only, but one user's file alone must not raise another's figure: a
    larger figure of another user's that no second user matches is set aside
    (:attr:`ContextEstimate.set_aside`), never used."""
    largest_by_uid: dict[int, ContextRecord] = {}
    for record in records:
        if record.model != model:
            continue
        held = largest_by_uid.get(record.uid)
        if held is None or (record.context_bytes, -record.time_s) > (
            held.context_bytes,
            -held.time_s,
        ):
            largest_by_uid[record.uid] = record
    ranked = sorted(
        largest_by_uid.values(), key=lambda r: (r.context_bytes, -r.time_s), reverse=True
    )
    own = largest_by_uid.get(uid)
    corroborated = ranked[1] if len(ranked) >= 2 else None
    figure, source = default_bytes, DEFAULT_SOURCE
    if own is not None and own.context_bytes > figure:
        figure = own.context_bytes
        source = f"estimated (largest measured on {model}: {format_size(figure)}, by {own.by()})"
    if corroborated is not None and corroborated.context_bytes > figure:
        figure = corroborated.context_bytes
        source = (
            f"estimated (largest measured on {model} by two users: {format_size(figure)}, "
            f"by {corroborated.by()}; {ranked[0].by()} measured "
            f"{format_size(ranked[0].context_bytes)})"
        )
    set_aside = tuple(r for r in ranked if r.uid != uid and r.context_bytes > figure)
    return ContextEstimate(context_bytes=figure, source=source, set_aside=set_aside)
