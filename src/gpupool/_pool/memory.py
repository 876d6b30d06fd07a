"""A pool that remembers: what each task key was measured to hold, per card model, between runs.

One file per user, ``$XDG_CACHE_HOME/gpupool/peaks.json`` (``~/.cache/gpupool/peaks.json``), or
the path ``GPUPOOL_MEMORY`` names; ``GPUPOOL_MEMORY=off`` turns it off, and
:func:`forget_peaks` (``gpupool forget``) clears it. A pool reads it once when it is built and
writes it once when it shuts down (to a temporary file renamed over it, so a reader never sees
half of one). A pool merges its keys into the file as it is when it saves, under an exclusive lock
on ``peaks.json.lock`` beside it, so pools that ran (or end) at once all keep what they
measured: where two measured a key, the last one to end wins.

An entry is ``{"key", "model", "peak_bytes", "samples", "saved_s"}``: the largest peak a key's
tasks were measured to hold on a card of that model (an outlier's excluded), how many measured it,
and when (seconds since the epoch). A key is the task key plus a digest of its function's code
(:func:`code_digest`), so a new version of a task does not inherit an old version's price.

The file is input from a stranger (anything that can write the user's cache can write it): at
most :data:`MAX_FILE_BYTES` are read and :data:`MAX_ENTRIES` entries kept (the newest); an entry
whose fields are not of their types and ranges is skipped; a file that is not JSON is ignored
with a warning, and replaced at the next save.

:class:`RunMemory` is the dispatcher's room for all it keeps between runs: this file, and the
largest contexts measured on each card model (:mod:`gpupool._sensors.contexts`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool._core.contexts import CONTEXT_ESTIMATE_BYTES, DEFAULT_SOURCE

if TYPE_CHECKING:
    from gpupool._core.peak import PeakReport
    from gpupool._core.policy import AskTable
    from gpupool._pool.inbox import WorkItem
    from gpupool._pool.workers import DeviceState
    from gpupool._sensors.contexts import ContextFile

__all__ = [
    "MAX_ENTRIES",
    "MAX_FILE_BYTES",
    "MEMORY_ENV",
    "Forgotten",
    "PeakMemory",
    "RunMemory",
    "code_digest",
    "forget_entries",
    "forget_peaks",
    "memory_path",
]

LOGGER = logging.getLogger("gpupool")

MEMORY_ENV = "GPUPOOL_MEMORY"
#: The most bytes of the file read; a larger file is ignored (and replaced at the next save).
MAX_FILE_BYTES = 1024 * 1024
#: The most entries kept (the newest saved).
MAX_ENTRIES = 2048
#: The longest key or model name kept.
MAX_NAME_CHARS = 512
#: No peak past this is believed (1 PiB: more than any card).
MAX_PEAK_BYTES = 2**50
_OFF = frozenset({"off", "0", "false", "no", "none"})


def memory_path(environ: Mapping[str, str]) -> Path | None:
    """The file a pool remembers in (``None``: remembering is off)."""
    named = environ.get(MEMORY_ENV, "").strip()
    if named.lower() in _OFF:
        return None
    if named:
        return Path(named).expanduser()
    # A relative XDG_CACHE_HOME is invalid (the XDG spec: ignore it), else each working
    # directory would hold a memory of its own.
    cache = environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return base / "gpupool" / "peaks.json"


def forget_peaks(path: str | os.PathLike[str] | None = None, *, key: str | None = None) -> bool:
    """Clear what pools remember of earlier runs' peaks (``gpupool forget`` on the command line).

    Args:
        path: the file to clear; by default the one pools use (``GPUPOOL_MEMORY``'s path,
            else ``$XDG_CACHE_HOME/gpupool/peaks.json``, ``~/.cache/gpupool/peaks.json``).
        key: forget only this task key's peaks (a function's ``module.qualname``, or the
            ``key`` given with ``options``), of every version of its code; the others stay.

    Returns:
        Whether anything was forgotten (``False`` also where ``GPUPOOL_MEMORY=off``).

    Raises:
        OSError: the file could not be removed or rewritten.
        ValueError: with ``key``, the file is not a file of peaks (without one it is removed).
    """
    target = Path(path) if path is not None else memory_path(os.environ)
    if target is None:
        return False
    found = forget_entries(target, key)
    if key is not None and found.unreadable:
        raise ValueError(f"{target} is not a file of peaks: forget it whole (no key) to remove it")
    return found.existed and (key is None or bool(found.removed))


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What :func:`forget_entries` did to one file: the entries it removed (each a task key
    with its code digest, ``key@digest``, a card model and the peak remembered); whether the
    file was there, and whether it could not be read as a file of peaks."""

    path: Path
    existed: bool
    unreadable: bool
    removed: tuple[tuple[str, str, Remembered], ...]


def forget_entries(path: Path, key: str | None = None) -> Forgotten:
    """Remove every entry of ``path`` (the file itself), or only those of task ``key`` (every
    code version: ``key@...``; or one version, named ``key@digest``), rewriting the rest as a
    save does. A file that is not one of peaks is removed whole, and left alone where only a
    key's entries were to go (``unreadable``).

    Raises:
        OSError: the file could not be removed or rewritten.
    """
    if not path.exists():
        return Forgotten(path, False, False, ())
    with _locked(path):
        return _forget_locked(path, key)


def _forget_locked(path: Path, key: str | None) -> Forgotten:
    entries = read_entries(path)
    existed = path.exists()
    if not existed:
        return Forgotten(path, False, False, ())
    unreadable = entries is None
    known = entries or {}

    def matches(name: str) -> bool:
        head, at, _ = name.rpartition("@")
        return key is None or name == key or (bool(at) and head == key)

    removed = tuple((name, model, value) for (name, model), value in known.items() if matches(name))
    if key is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    elif removed:
        kept = {slot: value for slot, value in known.items() if not matches(slot[0])}
        if kept:
            _write_entries(path, kept)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return Forgotten(path, True, unreadable, removed)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock file (``peaks.json.lock`` beside it) exclusively: one pool's
    read, merge and write of the file at a time (without it, pools that saved at the same
    moment each wrote the file as they read it, and one's keys were lost).

    Raises:
        OSError: the lock file could not be made or locked.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_name(path.name + ".lock"), "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_entries(path: Path) -> dict[tuple[str, str], Remembered] | None:
    """The valid entries of ``path``, by (key, model) (``{}``: none, or no file); ``None``
    where it is not a file of peaks (larger than :data:`MAX_FILE_BYTES`, not JSON), said in a
    warning."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError:
        return {}  # none yet, or unreadable: nothing remembered
    if len(raw) > MAX_FILE_BYTES:
        LOGGER.warning("gpupool: %s is larger than %d bytes: ignored", path, MAX_FILE_BYTES)
        return None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        LOGGER.warning("gpupool: %s is not a JSON file of peaks: ignored", path)
        return None
    found: dict[tuple[str, str], Remembered] = {}
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return found
    for entry in entries:  # at most what 1 MiB holds
        valid = _entry(entry)
        if valid is not None and (
            valid[0] not in found or found[valid[0]].saved_s <= valid[1].saved_s
        ):
            found[valid[0]] = valid[1]
    if len(found) > MAX_ENTRIES:  # the newest, in whatever order the file lists them
        newest = sorted(found.items(), key=lambda item: item[1].saved_s, reverse=True)
        found = dict(newest[:MAX_ENTRIES])
    return found


def _write_entries(path: Path, merged: Mapping[tuple[str, str], Remembered]) -> None:
    """Write ``merged``, the newest :data:`MAX_ENTRIES`, to a temporary file renamed over
    ``path`` (a reader never sees half of one).

    Raises:
        OSError: it could not be written.
    """
    newest = sorted(merged.items(), key=lambda item: item[1].saved_s, reverse=True)
    entries = [
        {
            "key": key,
            "model": model,
            "peak_bytes": value.peak_bytes,
            "samples": value.samples,
            "saved_s": value.saved_s,
        }
        for (key, model), value in newest[:MAX_ENTRIES]
    ]
    body = json.dumps({"version": 1, "entries": entries}).encode()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".peaks-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(body)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


# Public as gpupool.forget_peaks: reprs and docs name it there.
forget_peaks.__module__ = "gpupool"


@functools.lru_cache(maxsize=1024)
def _digest_of(code: Any) -> str:
    parts: list[bytes] = []
    stack = [code]
    while stack and len(parts) < 256:
        current = stack.pop()
        parts.append(current.co_code)
        for const in current.co_consts:
            if hasattr(const, "co_code"):
                stack.append(const)
            else:
                parts.append(_constant_text(const).encode("utf-8", "replace")[:256])
        parts.append(" ".join(current.co_names).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def _constant_text(const: object) -> str:
    """A constant's text, the same in every process: a frozenset's repr follows its items'
    hashes, which differ between interpreters (``x in {"a", "b"}`` compiles to one)."""
    if isinstance(const, frozenset):
        return "frozenset({" + ", ".join(sorted(map(_constant_text, const))) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(map(_constant_text, const)) + ")"
    return repr(const)


def _default_text(value: object) -> str:
    """A default argument's text: a plain value's (a number, a string, bytes, ``None``, tuples
    and frozensets of those), else only its type's name (an object's repr can hold its address,
    which differs every run)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_default_text, value)) + ")"
    if isinstance(value, frozenset):
        return "frozenset({" + ", ".join(sorted(map(_default_text, value))) + "})"
    if value is None or isinstance(value, (int, float, complex, str, bytes)):
        with contextlib.suppress(ValueError):  # an int past the interpreter's digits limit
            return repr(value)[:256]
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def code_digest(fn: Callable[..., Any]) -> str:
    """A digest of ``fn``'s code (its bytecode, constants and names, nested functions
    included) and of its default arguments' values: it changes when the function's code or
    a default does, and is the same in every process. A callable object's is its class's
    ``__call__``'s. ``""`` for a callable without code (a builtin, a class)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner: object = fn
    code = getattr(fn, "__code__", None)
    if code is None and not isinstance(fn, type):
        call = next(
            (vars(kind)["__call__"] for kind in type(fn).__mro__ if "__call__" in vars(kind)), None
        )
        owner = call
        code = getattr(call, "__code__", None)
    if code is None:
        return ""
    positional = getattr(owner, "__defaults__", None)
    keywords = getattr(owner, "__kwdefaults__", None)
    positional = positional if isinstance(positional, tuple) else ()
    keywords = keywords if isinstance(keywords, dict) else {}
    if not positional and not keywords:
        return _digest_of(code)
    text = _default_text(positional) + _default_text(tuple(sorted(keywords.items())))
    return hashlib.sha256(f"{_digest_of(code)}\0{text}".encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Remembered:
    """One key's measured peak on one card model, from an earlier run."""

    peak_bytes: int
    samples: int
    saved_s: float


class PeakMemory:
    """The entries read from the file at construction, and what this run adds to them."""

    def __init__(self, path: Path, models: tuple[str, ...]) -> None:
        self.path = path
        self.models = models
        self._entries: dict[tuple[str, str], Remembered] = {}
        self._learned: dict[tuple[str, str], Remembered] = {}
        self._dropped: set[tuple[str, str]] = set()
        self._read()

    def _read(self) -> None:
        self._entries = read_entries(self.path) or {}

    def recall(self, key: str) -> int | None:
        """The largest peak ``key`` was remembered to hold on this pool's card models."""
        peaks = [
            entry.peak_bytes
            for model in self.models
            if (entry := self._entries.get((key, model))) is not None
        ]
        return max(peaks) if peaks else None

    def learned(self, key: str, peak_bytes: int, samples: int) -> None:
        """This run measured ``key`` at ``peak_bytes`` over ``samples`` tasks (kept for every
        model of its cards: a pool's cards are one model, most often)."""
        now = time.time()
        for model in self.models:
            self._learned[(key, model)] = Remembered(peak_bytes, samples, now)

    def drop(self, key: str) -> None:
        """What was remembered of ``key`` is contradicted: it is not written back."""
        for model in self.models:
            self._entries.pop((key, model), None)
            self._dropped.add((key, model))

    def save(self) -> None:
        """Write this run's entries over the file's as it is now (another pool may have saved
        since this one read it), less those dropped: the newest :data:`MAX_ENTRIES`."""
        if not self._learned:
            return
        try:
            with _locked(self.path):
                merged = read_entries(self.path) or {}
                for slot in self._dropped:
                    merged.pop(slot, None)
                merged.update(self._learned)
                _write_entries(self.path, merged)
        except OSError as exc:
            LOGGER.warning("gpupool could not remember this run's peaks in %s: %s", self.path, exc)


class RunMemory:
    """What the pool keeps between runs: each key's peak from earlier runs (``peaks``), and the
    largest contexts measured on each card model (``contexts``, beside the booking table).
    It returns what it recalls and asks nothing of the planner: the loop tells the planner.
    Only the dispatcher thread calls it once the pool runs."""

    def __init__(
        self,
        peaks: PeakMemory | None,
        contexts: ContextFile | None,
        devices: list[DeviceState],
    ) -> None:
        # What earlier runs measured (None: remembering is off), and each key's name there.
        self.peaks = peaks
        self.names: dict[str, str] = {}
        # The largest contexts measured on each card model, beside the table: each card's
        # workers are priced at its model's until their own row is read (None: no table).
        self.contexts = contexts
        self.devices = devices
        for device in devices:
            device.context_estimate = (
                (CONTEXT_ESTIMATE_BYTES, DEFAULT_SOURCE)
                if contexts is None
                else contexts.estimate(device.info.name).pair()
            )

    def recall(self, item: WorkItem) -> int | None:
        """The first task of its key (``peaks`` on): what earlier runs measured of the key,
        to price it by (``None``: nothing)."""
        assert self.peaks is not None
        name = f"{item.key}@{code_digest(item.call[0])}"
        self.names[item.key] = name
        return self.peaks.recall(name)

    def note_context(self, device: int | None, report: PeakReport) -> None:
        """A worker on ``device`` measured its context from its own row: the host's contexts
        file keeps the largest on its card's model (written only when this one is larger)."""
        if self.contexts is not None and device is not None and report.context_bytes:
            model = self.devices[device].info.name
            self.contexts.note(model, report.context_bytes)

    def keep(self, asks: AskTable) -> None:
        """Keep what this run measured of each key for the next (at shutdown)."""
        if self.peaks is None:
            return
        for key, name in self.names.items():
            ask = asks.ask(key)
            if asks.contradicted(key):
                self.peaks.drop(name)
            if ask.basis == "measured" and ask.measured_peak_bytes and ask.samples:
                self.peaks.learned(name, ask.measured_peak_bytes, ask.samples)
        self.peaks.save()


def _entry(entry: object) -> tuple[tuple[str, str], Remembered] | None:
    """One entry of the file, validated (``None``: skipped)."""
    if not isinstance(entry, dict):
        return None
    key, model = entry.get("key"), entry.get("model")
    peak, samples, saved = entry.get("peak_bytes"), entry.get("samples"), entry.get("saved_s")
    if not (
        isinstance(key, str)
        and isinstance(model, str)
        and 0 < len(key) <= MAX_NAME_CHARS
        and len(model) <= MAX_NAME_CHARS
        and type(peak) is int
        and 0 < peak <= MAX_PEAK_BYTES
        and type(samples) is int
        and samples > 0
        and isinstance(saved, (int, float))
        and not isinstance(saved, bool)
        and 0 <= saved < 1e11
    ):
        return None
    return (key, model), Remembered(peak, samples, float(saved))
