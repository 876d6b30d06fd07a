"""Child side: measure one task's device and host peaks, classify device out-of-memory errors.

Runs inside every worker. It never creates a CUDA context: it looks at
torch only when the task has already initialised CUDA in this process.
Sources of the device peak; the report takes the largest that is trusted:

1. the sensor's exact per-process high-water window (the simulator's ledger);
2. NVML accounting's lifetime maximum of the process, when accounting is on
   and that maximum rose during the task (it cannot be reset, so a task that
   stayed below an earlier one falls through to the next source);
3. the sensor's per-process reading (NVML), sampled on a thread while the
   task runs, which includes the context and non-PyTorch allocations;
4. the frameworks' own counters (:mod:`gpupool._child.frameworks`: torch's reserved
   peak, CuPy's pool, JAX's device peak; each only where the task loaded it
   and started its backend) plus what this process holds outside them (its
   CUDA context, NCCL, cuBLAS workspaces, other libraries). That figure is
   measured from this process's own device row, less what the frameworks
   held at the same moment (``torch+context``, ``cupy+context``, ...), the
   most such a worker was seen holding; where no row of this process was
   ever read, it is the card's context estimate (:func:`set_context_estimate`: the
   largest context the host's pools measured on the card's model, else
   :data:`~gpupool._core.contexts.CONTEXT_ESTIMATE_BYTES`) and the source says so
   (``torch+context-estimated``). The report carries the figure and its
   basis (``context_bytes``, ``context_source``: ``"process-row"``, or the
   estimate's own, ``"estimated (default)"`` or ``"estimated (largest measured on
   <model>: ...)"``).

The sensor's per-process figures (1 and 3) are the worker's process tree's:
the worker and every process alive under it during the task
(:mod:`gpupool._child.probe_tree`). Figures 2 and 4 are the worker's own: the most
its descendants held in one reading of the tree's rows is added to them (the
source ends ``+descendants``). A per-process reading that is not plausible is
not a measurement (:func:`gpupool._core.readings.judge_tree_rows`: a list
holding an impossible PID, a row smaller than any context, such as the 0 that
drivers 535.113 to 560 report inside a container, rows above the device's used
bytes); it is ignored like a missing row, and the reason rides in the report.
A task that only such readings saw reports no device peak (``"none"``), so its
ask stays at its estimate.

After each task, :func:`release_caches` gives the cached blocks of torch's
and CuPy's allocators back to the driver, so an idle worker holds its context
and its live objects only.

The optional allocator cap (:func:`apply_allocator_cap`) caps torch's caching
allocator at the task's booked ask less what the process holds outside
torch's allocator (the figure above, and what CuPy's and JAX's pools hold),
with ``torch.cuda.set_per_process_memory_fraction``, set when torch
initialises CUDA (torch's lazy-initialisation queue), never by creating a
context itself.
"""

from __future__ import annotations

import builtins
import importlib.util
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from gpupool._child.frameworks import (
    FRAMEWORKS,
    FrameworkWindow,
    guard_torch_resets,
    initialised_torch_cuda,
    read_held_bytes,
)
from gpupool._child.probe_tree import TREE_SAMPLE_INTERVAL_S, TreeWatch
from gpupool._core.contexts import (
    CONTEXT_ESTIMATE_BYTES,
    CONTEXT_PLAUSIBLE_MAX_BYTES,
    DEFAULT_SOURCE,
)
from gpupool._core.peak import PeakReport
from gpupool._core.units import MiB, format_size, parse_size
from gpupool._sensors.process import read_rss_high_water

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gpupool._child.tree_sensor import TreeSensor
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = [
    "ALLOCATOR_CAP_NOTE",
    "CONTEXT_ESTIMATE_BYTES",
    "CONTEXT_PLAUSIBLE_MAX_BYTES",
    "Probe",
    "allocator_cap_message",
    "allocator_cap_state",
    "apply_allocator_cap",
    "card_full_free_bytes",
    "card_full_in_task",
    "context_figure",
    "device_oom_of",
    "is_device_oom",
    "oom_in_output",
    "oom_recognised_by",
    "read_allocator_cap_message",
    "release_caches",
    "requested_bytes_of",
    "set_context_estimate",
]

#: Interval of the device sampling, when the sensor has no exact high-water: the
#: tree's sampler (:data:`~gpupool._child.probe_tree.TREE_SAMPLE_INTERVAL_S`) reads the
#: device right after the tree, so every reading judges the tree it was taken with.
#: 10 ms catches allocations that live as long as a kernel launch sequence;
#: torch's own peak counters catch the shorter ones that torch allocates.
SAMPLE_INTERVAL_S = TREE_SAMPLE_INTERVAL_S

#: A card whose free bytes read below this (or :func:`card_full_free_bytes`'s share of a
#: larger card) during a task is full: a task that failed then, while its tree grew, ran
#: it out of memory even where no text said so. A framework that runs out leaves less
#: than one more block free; a card left with a few hundred MiB by its tenants is full to
#: any task that grows.
CARD_FULL_FREE_BYTES = 512 * MiB


def card_full_free_bytes(total_bytes: int) -> int:
    """Below how many free bytes a card of ``total_bytes`` is full: :data:`CARD_FULL_FREE_BYTES`,
    or 1/64 of a card larger than 32 GiB."""
    return max(CARD_FULL_FREE_BYTES, total_bytes // 64)


#: How many exceptions of a ``__cause__`` / ``__context__`` / group chain are
#: searched for an out-of-memory; a chain is never longer in practice, and a
#: hostile cycle must not loop.
_MAX_CHAIN = 64


class _Pattern:
    """A regular expression compiled at its first search, not at import: every worker imports
    this module before its first task, and only a task that fails is searched (the patterns
    below take about 1.5 ms to compile, on a worker's path to its first result)."""

    __slots__ = ("_args", "_compiled")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self._args = (pattern, flags)
        self._compiled: re.Pattern[str] | None = None

    def search(self, text: str) -> re.Match[str] | None:
        if self._compiled is None:
            self._compiled = re.compile(*self._args)
        return self._compiled.search(text)


# Messages of device out-of-memory errors, by library.
_OOM_PATTERNS = _Pattern(
    r"CUDA out of memory|CUDA (?:driver )?error: out of memory|CUDA_ERROR_OUT_OF_MEMORY"
    # torch before 1.0: "cuda runtime error (2) : out of memory"
    r"|cuda runtime error \(2\)\s*:\s*out of memory"
    # cuBLAS, cuDNN, cuSOLVER, cuSPARSE: CUBLAS_STATUS_ALLOC_FAILED and kin
    r"|CU[A-Z]+_STATUS_ALLOC(?:ATION)?_FAILED|CUFFT_ALLOC_FAILED"
    r"|cudaErrorMemoryAllocation"
    # JAX / PJRT / XLA: "RESOURCE_EXHAUSTED: Out of memory while trying to allocate",
    # "RESOURCE_EXHAUSTED: Error allocating device buffer", "Resource exhausted:
    # Failed to allocate request for 32.00MiB"; a quota's RESOURCE_EXHAUSTED is not one.
    r"|resource[_ ]exhausted\b[^\n]{0,300}?(?:out of memory|allocat)"
    # XLA placing a constant: "INTERNAL: Failed to allocate 1073741824 bytes for new constant"
    r"|failed to allocate [0-9,]+ bytes for new constant"
    # CuPy's OutOfMemoryError, by its words where its type was lost:
    # "Out of memory allocating 1,024 bytes (allocated so far: 0 bytes)."
    r"|out of memory allocating [0-9,]+ bytes"
    # TensorFlow's ResourceExhaustedError
    r"|OOM when allocating"
    # NCCL: "Cuda failure 'out of memory'", "Cuda failure 2 'out of memory'"
    r"|cuda failure\b[^\n]{0,120}?'out of memory'"
    r"|device \d+ out of memory|HIP out of memory|out of memory on device",
    re.IGNORECASE,
)
_OOM_TYPES = {
    ("torch", "OutOfMemoryError"),
    ("torch.cuda", "OutOfMemoryError"),
    ("cupy.cuda.memory", "OutOfMemoryError"),
    ("cuda.core.experimental", "CUDAOutOfMemoryError"),
    ("cuda.core", "CUDAOutOfMemoryError"),
    ("gpupool.testing", "SimulatedOutOfMemory"),
    ("gpupool._commands.run", "CommandOutOfMemory"),
}

# Sizes of the failed allocation, as each library words them. XLA's
# "15.65G" is binary (its HumanReadableNumBytes counts in 1024s).
_REQUESTED_SIZED = _Pattern(
    r"(?:[Tt]ried to allocate|allocate request for)\s+([0-9.]+\s*[KMGTP]i?B)\b"
)
_REQUESTED_XLA = _Pattern(r"[Aa]ttempting to allocate\s+([0-9.]+)\s*([KMGTP]?)(?:i?B)?\b")
_REQUESTED_BYTES = _Pattern(r"allocat\w*\s+([0-9][0-9,]*)\s*bytes", re.IGNORECASE)

_EXCEPTION_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or while handling, and the members of groups."""
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < _MAX_CHAIN:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if _EXCEPTION_GROUP is not None and isinstance(current, _EXCEPTION_GROUP):
            members = getattr(current, "exceptions", ())
            stack.extend(reversed([m for m in members if isinstance(m, BaseException)]))
        for linked in (current.__context__, current.__cause__):
            if linked is not None:
                stack.append(linked)


def _is_oom_itself(exc: BaseException) -> bool:
    for cls in type(exc).__mro__:
        if (cls.__module__, cls.__name__) in _OOM_TYPES:
            return True
    return bool(_OOM_PATTERNS.search(_text(exc)))


def device_oom_of(exc: BaseException) -> BaseException | None:
    """The device out-of-memory error in ``exc``'s chain, or ``None``.

    The chain is ``exc`` itself, its ``__cause__`` (``raise ... from oom``),
    its ``__context__`` (raised while handling one) and the members of an
    exception group, followed to any depth (at most 64 exceptions).
    """
    for linked in _chain(exc):
        if _is_oom_itself(linked):
            return linked
    return None


def is_device_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is, wraps or was raised while handling a device out-of-memory error:
    one of ``_OOM_TYPES``, or a message of ``_OOM_PATTERNS`` (each library's, listed there).
    A host :class:`MemoryError` without a device message is not one."""
    return device_oom_of(exc) is not None


def _text(exc: BaseException) -> str:
    """``str(exc)``, with the tail of a subprocess's error output where the exception carries
    it (:class:`subprocess.CalledProcessError`'s ``stderr``, ``output``), or ``""`` when the
    exception's own ``__str__`` raises."""
    try:
        text = str(exc)
    except Exception:
        text = ""
    streams = [getattr(exc, name, None) for name in ("stderr", "output")]
    tail = [_tail_text(stream) for stream in streams if isinstance(stream, (str, bytes))]
    return "\n".join([text, *tail]) if tail else text


#: How much of a subprocess's output is searched for an out-of-memory text (its end: a
#: framework's error is the last thing a failed process writes).
OUTPUT_TAIL_BYTES = 64 * 1024


def _tail_text(stream: str | bytes) -> str:
    """The last :data:`OUTPUT_TAIL_BYTES` of ``stream``, as text."""
    if isinstance(stream, bytes):
        return stream[-OUTPUT_TAIL_BYTES:].decode("utf-8", "replace")
    return stream[-OUTPUT_TAIL_BYTES:]


def oom_in_output(output: str | bytes) -> str | None:
    """The line of ``output`` (a command's error output) that says the device ran out of
    memory (CUDA's, cuDNN's, cuBLAS's, NCCL's, torch's, CuPy's, JAX's words: the patterns
    :func:`is_device_oom` searches), or ``None``. Only its last
    :data:`OUTPUT_TAIL_BYTES` are read."""
    text = _tail_text(output)
    match = _OOM_PATTERNS.search(text)
    if match is None:
        return None
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return text[start : end if end >= 0 else len(text)].strip()[:400]


def oom_recognised_by(exc: BaseException) -> str | None:
    """How the device out-of-memory in ``exc``'s chain was recognised: ``"type"`` (a
    framework's out-of-memory class), ``"message"`` (its words in the exception's message),
    ``"subprocess-output"`` (in the error output of a subprocess the exception carries),
    ``"command-output"`` (in a ``gpupool run`` command's error output), or ``None`` where
    there is none."""
    for linked in _chain(exc):
        for cls in type(linked).__mro__:
            if (cls.__module__, cls.__name__) == ("gpupool._commands.run", "CommandOutOfMemory"):
                # Its error output said so, or its card was full as it failed ("card-full").
                how = getattr(linked, "recognised", None)
                return how if how in ("command-output", "card-full") else "command-output"
            if (cls.__module__, cls.__name__) in _OOM_TYPES:
                return "type"
        try:
            own = str(linked)
        except Exception:
            own = ""
        if _OOM_PATTERNS.search(own):
            return "message"
        if _OOM_PATTERNS.search(_text(linked)):
            return "subprocess-output"
    return None


def requested_bytes_of(exc: BaseException) -> int | None:
    """The size of the allocation that failed, when the out-of-memory error in the chain says it."""
    oom = device_oom_of(exc) or exc
    value = getattr(oom, "requested_bytes", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = _text(oom)
    try:
        match = _REQUESTED_SIZED.search(text)
        if match:
            return parse_size(match.group(1))
        match = _REQUESTED_XLA.search(text)
        if match:
            unit = match.group(2)
            return parse_size(f"{match.group(1)}{unit}iB" if unit else match.group(1))
        match = _REQUESTED_BYTES.search(text)
        if match:
            return int(match.group(1).replace(",", ""))
    except ValueError:
        return None
    return None


# -- after a task ----------------------------------------------------------------------


def release_caches() -> None:
    """Give cached allocator blocks back to the driver: torch's and CuPy's.

    torch: ``torch.cuda.empty_cache()``, only where the task initialised
    CUDA. CuPy: ``free_all_blocks()`` on its default device and pinned pools,
    only where the task imported CuPy. Live objects and the context stay. JAX's
    allocator has no call that gives memory back (only
    ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` frees on release). Never raises:
    a release that fails leaves the memory held, which the next reading shows.
    """
    cuda = initialised_torch_cuda()
    if cuda is not None:
        try:
            cuda.empty_cache()
        except Exception:
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        for getter in ("get_default_memory_pool", "get_default_pinned_memory_pool"):
            try:
                getattr(cupy, getter)().free_all_blocks()
            except Exception:
                pass


def _reset_torch_peaks(cuda: Any) -> None:
    """Start torch's peak counters afresh, after :func:`release_caches`: the peak is what is held.

    c10's ``reset_peak_stat`` sets each peak to the current value: reset
    before ``empty_cache`` and the next task inherits this one's cached bytes.
    """
    try:
        cuda.reset_peak_memory_stats()
    except Exception:
        pass


# -- the allocator cap --------------------------------------------------------------------

_CAP_PREFIX = b"gpupool-allocator-cap:"

#: What the decision log says of the cap, once per card, when it is on.
ALLOCATOR_CAP_NOTE = (
    "torch's caching allocator capped at the booked ask less what the worker holds outside "
    "it (context, measured or estimated; CuPy/JAX pools); binds torch's allocator only"
)


def allocator_cap_message(ask_bytes: int) -> bytes:
    """The message that tells a worker the booked ask of its next task (parent side)."""
    return _CAP_PREFIX + str(int(ask_bytes)).encode("ascii")


def read_allocator_cap_message(message: bytes | bytearray) -> int | None:
    """The ask in an :func:`allocator_cap_message`, or ``None`` for any other message."""
    if not message.startswith(_CAP_PREFIX):
        return None
    digits = message[len(_CAP_PREFIX) :]
    if not digits.isdigit() or len(digits) > 30:
        return None
    return int(digits)


class _CapState:
    """The allocator cap's state in this process (one, :data:`_CAP`)."""

    __slots__ = (
        "ask_bytes",
        "context_bytes",
        "descendant_bytes",
        "error",
        "estimate_bytes",
        "estimate_source",
        "fraction",
        "hooked",
        "outside_bytes",
        "total_bytes",
    )

    def __init__(self) -> None:
        self.ask_bytes: int | None = None
        self.hooked = False
        self.fraction: float | None = None
        self.total_bytes: int | None = None
        self.error: str | None = None
        # What this process holds outside the frameworks, as its probe last measured it
        # (None: never measured, the estimate stands in), and what the cap last left out.
        self.context_bytes: int | None = None
        self.outside_bytes: int | None = None
        # What the worker's descendants hold now, by the probe's last reading of the tree's
        # rows (0 where none was read: rows hidden leave them out, and the cap cannot see
        # them).
        self.descendant_bytes = 0
        # The context this worker is priced at until its own row is read, and where it
        # comes from (set_context_estimate: the pool tells it at the worker's start).
        self.estimate_bytes = CONTEXT_ESTIMATE_BYTES
        self.estimate_source = DEFAULT_SOURCE


_CAP = _CapState()


def allocator_cap_state() -> dict[str, Any]:
    """The cap's state in this process: the ask, the fraction set, the error if any (for tests)."""
    return {
        "ask_bytes": _CAP.ask_bytes,
        "hooked": _CAP.hooked,
        "fraction": _CAP.fraction,
        "total_bytes": _CAP.total_bytes,
        "error": _CAP.error,
        "outside_bytes": _CAP.outside_bytes,
        "outside_source": context_figure()[1],
        "descendant_bytes": _CAP.descendant_bytes,
    }


def set_context_estimate(context_bytes: int, source: str) -> None:
    """Price this worker's context at ``context_bytes`` (``source`` says where the figure comes
    from) until a device row of it is read: the pool's estimate for the card's model
    (:func:`gpupool._core.contexts.decide_context_estimate`), told at the worker's start."""
    if type(context_bytes) is int and 0 < context_bytes <= CONTEXT_PLAUSIBLE_MAX_BYTES:
        _CAP.estimate_bytes, _CAP.estimate_source = context_bytes, str(source)


def context_figure() -> tuple[int, str]:
    """What this worker holds outside the frameworks, and its source: the most its own row
    was seen holding outside them (``"process-row"``), else the estimate. The one figure the
    report and the allocator cap both use."""
    if _CAP.context_bytes is not None:
        return _CAP.context_bytes, "process-row"
    return _context_estimate()


def _context_estimate() -> tuple[int, str]:
    """The context this worker is priced at while no row of it was read, and its source."""
    return _CAP.estimate_bytes, _CAP.estimate_source


def apply_allocator_cap(ask_bytes: int) -> None:
    """Cap torch's caching allocator in this process at ``ask_bytes`` (the task's booked ask)
    less what the process holds outside torch's allocator, so that torch and the rest
    together stay within the booking.

    Outside torch: the bytes the probe measured outside every framework (its
    context; the estimate until a device row of this process was read:
    :func:`context_figure`, the report's figure), plus what CuPy's and JAX's pools hold
    when the cap is set, plus what the worker's descendants hold by the probe's last
    reading of their rows; the cap is set again each time a reading finds that changed.

    Called by the worker before each task when the pool has ``cap_allocator=True``.
    Where the task's CUDA is already initialised the fraction is set now
    (re-set only when the ask changed); otherwise it is queued with torch's
    lazy-initialisation hook (``torch.cuda._lazy_call``) and set when the
    task's first CUDA call initialises CUDA, so no context is created early.
    If torch is not imported yet, it is armed when the task starts
    (:meth:`Probe.start`). Never raises: a cap that cannot be set is recorded
    in :func:`allocator_cap_state` and the task runs uncapped.
    """
    _CAP.ask_bytes = int(ask_bytes)
    torch = sys.modules.get("torch")
    if torch is not None:
        _arm_cap(torch)


def _arm_cap_at_task_start() -> None:
    """Arm a wanted cap once the task's module has been imported (so torch may be loaded)."""
    if _CAP.ask_bytes is None:
        return
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            if importlib.util.find_spec("torch") is None:
                return
            torch = importlib.import_module("torch")  # importing torch creates no CUDA context
        except Exception as exc:
            _CAP.error = f"torch could not be imported: {type(exc).__name__}: {exc}"
            return
    _arm_cap(torch)


def _arm_cap(torch: Any) -> None:
    try:
        cuda = torch.cuda
        if cuda.is_initialized():
            _set_fraction(torch)
            return
        if not _CAP.hooked:
            lazy_call = getattr(cuda, "_lazy_call", None)
            if lazy_call is None:
                # No hook in this torch: the cap is set at the first task that
                # starts with CUDA initialised.
                return
            lazy_call(lambda: _set_fraction(torch))
            _CAP.hooked = True
    except Exception as exc:
        _CAP.error = f"{type(exc).__name__}: {exc}"


def _set_fraction(torch: Any) -> None:
    """Set ``(ask - outside torch) / total`` on device 0 (the only one a pinned worker sees),
    at least 0. Never raises.

    It runs inside torch's lazy initialisation, where an exception would
    fail the task's first CUDA call: every error is kept, not raised.
    """
    ask = _CAP.ask_bytes
    if ask is None:
        return
    try:
        cuda = torch.cuda
        if _CAP.total_bytes is None:
            _CAP.total_bytes = int(cuda.get_device_properties(0).total_memory)
        outside = context_figure()[0] + read_held_bytes(leave_out="torch") + _CAP.descendant_bytes
        allowed = max(0, ask - outside)
        _CAP.outside_bytes = outside
        fraction = min(1.0, allowed / _CAP.total_bytes) if _CAP.total_bytes > 0 else 1.0
        if fraction == _CAP.fraction:
            return
        cuda.set_per_process_memory_fraction(float(fraction), 0)
        _CAP.fraction = fraction
        _CAP.error = None
    except Exception as exc:
        _CAP.error = f"{type(exc).__name__}: {exc}"


def _note_descendants_for_cap(descendant_bytes: int) -> None:
    """The worker's descendants hold ``descendant_bytes`` now: where a cap is wanted and the
    figure moved, the cap is set again (now, where torch's CUDA is initialised)."""
    if _CAP.ask_bytes is None or descendant_bytes == _CAP.descendant_bytes:
        return
    _CAP.descendant_bytes = max(0, descendant_bytes)
    torch = sys.modules.get("torch")
    if torch is not None and initialised_torch_cuda() is not None:
        _set_fraction(torch)


# -- the probe ----------------------------------------------------------------------------


def _trusted(value: int | None) -> int | None:
    """A per-process reading, or ``None`` where it is missing or 0 (never a measurement)."""
    return value if value is not None and value > 0 else None


#: The probe whose task window is open in this process (a worker runs one task at a time).
_WINDOW: Probe | None = None


def card_full_in_task() -> str | None:
    """What has shown the card full so far in this process's open task window (see
    :meth:`Probe.stop`), or ``None``: for a task that fails without raising, such as a
    ``gpupool run`` command's exit status."""
    probe = _WINDOW
    if probe is None:
        return None
    full = probe._card_full(probe._sampled_peak_bytes, probe._tree.seen())
    return full[0] if full is not None else None


class _CardSeen:
    """What one task's readings showed of its whole card: its used bytes at the first
    reading and the most since, the least free bytes it was read with (and its total then),
    and when the task's window opened (``time.time()``: the card's refusals since are the
    task's)."""

    __slots__ = (
        "free_least_bytes",
        "since_s",
        "total_bytes",
        "used_at_start_bytes",
        "used_peak_bytes",
    )

    def __init__(self, *, since_s: float) -> None:
        self.since_s = since_s
        self.used_at_start_bytes: int | None = None
        self.used_peak_bytes: int | None = None
        self.free_least_bytes: int | None = None
        self.total_bytes: int | None = None

    def note(self, sensor: TreeSensor) -> None:
        """Keep the card's figures of the reading ``sensor`` just judged: its used bytes (the
        first, and the most) and its free bytes (the least, with the card's total)."""
        used = sensor.used_bytes
        if used is None:
            return
        if self.used_at_start_bytes is None:
            self.used_at_start_bytes = used
        if self.used_peak_bytes is None or used > self.used_peak_bytes:
            self.used_peak_bytes = used
        free = sensor.free_bytes
        if free is not None and (self.free_least_bytes is None or free < self.free_least_bytes):
            self.free_least_bytes = free
            self.total_bytes = sensor.total_bytes

    def rise_bytes(self) -> int | None:
        """How much the card's used bytes rose from the first reading to the most (``None``:
        never read)."""
        used, start = self.used_peak_bytes, self.used_at_start_bytes
        return None if used is None or start is None else used - start


class _TreeReads:
    """How a worker's readings of its tree went: in this task, how many readings taken while
    processes ran under the worker told their bytes and how many could not (rows hidden,
    0, or not available); and whether the driver ever listed the worker's own row (it lists
    this host's processes, so a descendant without a row holds nothing, else it may be
    hidden), for the worker's life."""

    __slots__ = ("partial", "root_listed", "whole")

    def __init__(self) -> None:
        self.whole = 0
        self.partial = 0
        self.root_listed = False

    def start(self) -> None:
        """A task's window opens: its readings are counted from none."""
        self.whole = self.partial = 0

    def note(self, *, root_listed: bool, tree: int | None, members: frozenset[int] | None) -> None:
        """One reading: whether it listed the worker's row, the tree's bytes it told
        (``None``: none), and the tree it read (``None``: not read with it)."""
        if root_listed:
            self.root_listed = True
        if members is not None and len(members) > 1:  # processes ran under the worker
            if tree is not None:
                self.whole += 1
            else:
                self.partial += 1

    def partial_view(
        self, descendants: int, peak: int | None, baseline_bytes: int | None, card: _CardSeen
    ) -> str | None:
        """Why the peak is a partial view of a tree that had ``descendants``, or ``None``.

        A reading of the tree while processes ran under the worker that told none of
        their bytes (rows hidden by a container, rows of 0, MIG's "not available")
        makes the peak partial; so does a tree whose descendants no reading caught
        where the driver never listed this worker's own row (it may list none of
        this host's processes). Where the card's used bytes were read, the reason
        says what they bound the true peak by (against the task's ``peak`` over
        ``baseline_bytes``).
        """
        if self.partial:
            said = (
                f"{descendants} process(es) ran under the worker and {self.partial} "
                f"reading(s) of the tree could not tell their device bytes (the driver lists "
                "none of them, or only rows of 0 or without a figure)"
            )
        elif not self.whole and not self.root_listed:
            said = (
                f"{descendants} process(es) ran under the worker and the driver never listed "
                "this worker's processes, so their device bytes were not read"
            )
        else:
            return None
        rise, used = card.rise_bytes(), card.used_peak_bytes
        if rise is not None and used is not None:
            rise = max(0, rise)
            said += (
                f"; the card's used bytes, as sampled, rose by {format_size(rise)} during the "
                f"task (to {format_size(used)})"
            )
            if peak is not None and rise > peak - (baseline_bytes or 0):
                said += (
                    f", more than the {format_size(peak)} reported rose: the unread processes "
                    "(or another tenant) held the difference"
                )
        return said


class Probe:
    """Measures one task at a time in worker ``pid``, pinned to ``device`` (the pool's
    ``device_index``); ``sensor`` is ``None`` for a worker without a device."""

    def __init__(
        self, sensor: Sensor | None, device: DeviceInfo | None, device_index: int | None, pid: int
    ) -> None:
        # The worker's bytes are its process tree's: see gpupool._child.probe_tree.
        self._tree = TreeWatch(pid)
        self._sensor: TreeSensor | None = None
        if sensor is not None:  # a worker without a device never loads a sensor's module
            from gpupool._child.tree_sensor import tree_sensor

            self._sensor = tree_sensor(sensor, self._tree)
        self._device = device
        self._device_index = device_index
        self._pid = pid
        self._baseline_bytes: int | None = None
        self._max_at_start: int | None = None
        self._sampled_peak_bytes: int | None = None
        # The most the worker's descendants held together in one reading of the window
        # (the tree less the worker's own row): what the worker's own figures (NVML
        # accounting, the frameworks' counters) leave out.
        self._descendant_bytes = 0
        self._frameworks = FrameworkWindow()
        # The most bytes this process was seen holding outside every framework's
        # allocator (its context, NCCL, other libraries), from its own device row:
        # it only grows, as a lazily loaded context does. None: never measured.
        self._context_bytes: int | None = None
        # How the readings of the tree told (or could not tell) its bytes.
        self._reads = _TreeReads()
        # Whether a row under this worker's PID was found to be another namespace's process.
        self._foreign = False
        # What the task's readings showed of the whole card.
        self._card = _CardSeen(since_s=0.0)
        # Whether the sensor keeps an exact high-water (the simulator's tree window), or the
        # window is sampled.
        self._exact = self._sensor is None or self._sensor.exact

    def resident_bytes(self) -> int | None:
        """This process's device bytes now (one per-process reading, no task window).

        ``None`` when unknown: no device, no row for this process, a 0 row
        (which may be the driver's silence), or a reading that failed.
        """
        if self._sensor is None or self._device is None:
            return None
        try:
            return _trusted(self._sensor.read_process_bytes(self._device, self._pid))
        except Exception:
            return None

    def start(self) -> None:
        """Open the measuring window for one task."""
        modules = sys.modules  # torch's hooks only where the worker imported it
        if "torch" in modules:
            guard_torch_resets()
        members = self._tree.open()
        if _CAP.ask_bytes is not None:
            _arm_cap_at_task_start()  # may import torch
        if "torch" in modules:
            cuda = initialised_torch_cuda()
            if cuda is not None:
                _reset_torch_peaks(cuda)
        held = self._frameworks.open()
        self._descendant_bytes = 0
        self._reads.start()
        self._foreign = False
        self._card = _CardSeen(since_s=time.time())  # the card's refusals since are its
        global _WINDOW
        _WINDOW = self
        sensor, device = self._sensor, self._device
        if sensor is None or device is None:
            return
        try:
            self._baseline_bytes = sensor.start_peak_window(device, self._pid)
        except Exception:
            self._baseline_bytes = None
        if not self._exact:
            try:  # the driver's lifetime maximum, for the sampled path's stop
                self._max_at_start = sensor.read_process_max_bytes(device, self._pid)
            except Exception:
                self._max_at_start = None
            if self._baseline_bytes is not None and self._baseline_bytes <= 0:
                self._baseline_bytes = None  # a 0 row is the driver's silence, not a reading
            self._read_tree(sensor, device, held, members)
            if self._foreign:
                self._baseline_bytes = None  # the row under this PID is not this worker's
            self._sampled_peak_bytes = self._baseline_bytes
            # Sampled on the tree's sampler thread, with the tree it just read.
            self._tree.tick_with(self._sample)
        elif _CAP.ask_bytes is not None:
            # The exact high-water needs no sampling, but the cap follows the descendants.
            self._read_tree(sensor, device, held, members)
            self._tree.tick_with(self._sample)

    def _note_context(
        self, process_bytes: int | None, held_before: int | None, held_after: int | None
    ) -> None:
        """Note what the process holds outside the frameworks: its row less what they held.

        The frameworks are read just before and just after the row; the larger of
        the two is taken off, so a framework that shrank meanwhile (a task's own
        ``empty_cache``) is never taken for context: one reading may come out
        low, never high, and the figure is the most of all readings.
        """
        if process_bytes is None or held_before is None or held_after is None:
            return  # no framework started: nothing tells the context from the task's bytes
        outside = max(0, process_bytes - max(held_before, held_after))
        if self._context_bytes is None or outside > self._context_bytes:
            self._context_bytes = outside
        _CAP.context_bytes = self._context_bytes

    def _read_tree(
        self,
        sensor: TreeSensor,
        device: DeviceInfo,
        held_before: int | None,
        members: frozenset[int] | None = None,
    ) -> int | None:
        """One reading of the tree: its bytes (``None``: not a measurement), noting the
        worker's context from its own row and what its descendants held. ``members``:
        the tree as just read (read now if ``None``)."""
        try:
            tree, own = sensor.read_root_bytes(device, members)
        except Exception:
            return None
        return self._note_tree(tree, own, held_before, members)

    def _note_tree(
        self,
        tree: int | None,
        own: int | None,
        held_before: int | None,
        members: frozenset[int] | None = None,
    ) -> int | None:
        """Note the worker's context and its descendants' bytes from one reading of the tree
        (``tree``: its bytes, ``own``: the worker's row, ``members``: the tree it read), and
        whether that reading told the descendants' bytes; the tree's bytes, or ``None``."""
        own = _trusted(own)
        if own is not None and held_before is not None:  # else nothing to tell apart
            held_after = self._frameworks.sample()
            if self._foreign_row(own, held_before, held_after):
                own = tree = None  # another process's row: this reading measures nothing
            else:
                self._note_context(own, held_before, held_after)
        tree = _trusted(tree)
        if tree is not None:
            self._descendant_bytes = max(self._descendant_bytes, tree - (own or 0))
            _note_descendants_for_cap(tree - (own or 0))
        self._reads.note(root_listed=own is not None, tree=tree, members=members)
        if self._sensor is not None:
            self._card.note(self._sensor)
        return tree

    def _foreign_row(self, own: int, held_before: int, held_after: int | None) -> bool:
        """Whether the row under this worker's PID holds more outside its frameworks than any
        context could (:data:`CONTEXT_PLAUSIBLE_MAX_BYTES`): a process of another PID
        namespace under the same PID (a container's driver lists host PIDs), not this one.
        The reason is kept with the task's rejected readings."""
        outside = own - max(held_before, held_after or 0)
        if outside <= CONTEXT_PLAUSIBLE_MAX_BYTES:
            return False
        self._foreign = True
        self._tree.note_rejections(
            (
                f"the row under this worker's PID ({self._pid}) holds {format_size(outside)} "
                "outside its frameworks, more than any CUDA context "
                f"({format_size(CONTEXT_PLAUSIBLE_MAX_BYTES)}): a process of another PID "
                "namespace listed under the same PID (a container), not this worker; "
                "refused as implausible",
            )
        )
        return True

    def _sample(self, members: frozenset[int]) -> None:
        """One sample of the device, for the tree's sampler: the tree's bytes now."""
        sensor, device = self._sensor, self._device
        assert sensor is not None and device is not None
        guard_torch_resets()  # a task that imports torch in its body is guarded too
        now = self._read_tree(sensor, device, self._frameworks.sample(), members)
        if now is not None and (self._sampled_peak_bytes is None or now > self._sampled_peak_bytes):
            self._sampled_peak_bytes = now

    def stop(
        self, *, oom: BaseException | None = None, failure: BaseException | None = None
    ) -> PeakReport:
        """Close the window; return the task's peaks and how each was measured.

        ``oom``: the task's device out-of-memory error, recognised by its type or text.
        ``failure``: the task's error where it is none such: it is taken as an
        out-of-memory all the same (``oom_recognised="card-full"``) where the card was
        full during the task and the task's tree grew (:meth:`_card_full`).

        Then the allocators' cached blocks are given back (:func:`release_caches`)
        and torch's peak counters reset, in that order.
        """
        peak, source, context = self._device_peak()
        if "torch" in sys.modules or "cupy" in sys.modules:  # else no cache to give back
            release_caches()
            cuda = initialised_torch_cuda()
            if cuda is not None:
                _reset_torch_peaks(cuda)
        tree = self._tree.close(self._device)
        oom, recognised, requested, full = self._oom_terms(oom, failure, peak, tree.descendants)
        global _WINDOW
        _WINDOW = None
        # What the task left running still holds its bytes; the next reading says more.
        _CAP.descendant_bytes = tree.outliving_device_bytes or 0
        rss = read_rss_high_water()
        rss_source = "vmhwm" if rss is not None else "none"
        if rss is not None and tree.rss_peak_bytes is not None:
            rss, rss_source = rss + tree.rss_peak_bytes, "vmhwm+descendants"
        incomplete = None
        if not self._exact and tree.descendants:
            incomplete = self._reads.partial_view(
                tree.descendants, peak, self._baseline_bytes, self._card
            )
        return PeakReport(
            device=self._device_index,
            device_peak_bytes=peak,
            device_source=source if peak is not None else "none",
            baseline_bytes=self._baseline_bytes,
            context_bytes=context[0] if context is not None else None,
            context_source=context[1] if context is not None else "none",
            rss_peak_bytes=rss,
            rss_source=rss_source,
            oom=oom is not None,
            oom_requested_bytes=requested,
            oom_recognised=recognised,
            card_full_reason=full[0] if full is not None else None,
            descendants=tree.descendants,
            outliving_descendants=len(tree.outliving_pids),
            outliving_device_bytes=tree.outliving_device_bytes,
            rejected_readings=tree.rejected,
            incomplete_reason=incomplete,
            card_used_peak_bytes=self._card.used_peak_bytes,
            card_used_at_start_bytes=self._card.used_at_start_bytes,
        )

    def _device_peak(self) -> tuple[int | None, str, tuple[int, str] | None]:
        """The task's device peak and its source, from the card (exact or sampled) and the
        frameworks' counters (with the context and the descendants' bytes), whichever says
        more; and the context counted, with its source (``None``: none read nor needed)."""
        peak: int | None = None
        source = "none"
        sensor, device = self._sensor, self._device
        if sensor is not None and device is not None:
            if self._exact:
                peak, source = self._read_exact(sensor, device)
            else:
                peak, source = self._stop_sampling(sensor, device)
        framework_peaks, _ = self._frameworks.close()
        context: tuple[int, str] | None = None
        if self._context_bytes is not None:
            context = (self._context_bytes, "process-row")
        if framework_peaks:
            if context is None:
                context = _context_estimate()  # no row of this worker was read
            names = "+".join(name for name in FRAMEWORKS if name in framework_peaks)
            # The frameworks' counters are the worker's: its descendants' bytes are added.
            counted = sum(framework_peaks.values()) + context[0] + self._descendant_bytes
            if peak is None or counted > peak:
                suffix = "" if context[1] == "process-row" else "-estimated"
                peak, source = counted, f"{names}+context{suffix}{self._with_descendants()}"
        return peak, source, context

    def _oom_terms(
        self,
        oom: BaseException | None,
        failure: BaseException | None,
        peak: int | None,
        descendants: int,
    ) -> tuple[BaseException | None, str | None, int | None, tuple[str, int | None] | None]:
        """The task's out-of-memory (its ``oom``, or its ``failure`` where the card was full
        during the task and its tree grew), how it was recognised, the allocation refused
        where it says, and what showed the card full (``None``: nothing did)."""
        recognised = oom_recognised_by(oom) if oom is not None else None
        full = None
        if (oom is None and failure is not None) or recognised == "card-full":
            full = self._card_full(peak, descendants)
            if full is not None and oom is None:
                oom, recognised = failure, "card-full"
        requested = requested_bytes_of(oom) if oom is not None else None
        if full is not None and requested is None:
            requested = full[1]  # the allocation the card refused, where it says
        return oom, recognised, requested, full

    def _card_full(self, peak: int | None, descendants: int) -> tuple[str, int | None] | None:
        """What showed the card full during the task, and the allocation it refused where it
        says; ``None`` where nothing did.

        The card refused an allocation to a process of the worker's tree (the sensor
        keeps such a record: the simulator's ledger); or its free bytes were read below
        :func:`card_full_free_bytes` while processes ran under the worker and the task's
        tree grew (its bytes rose above what it held at the start, or the card's used bytes
        rose). A card that never came near full is never taken for one, and neither is an
        error of a task that started no process (the worker's own frameworks say when they
        run out).
        """
        sensor, device = self._sensor, self._device
        if sensor is None or device is None:
            return None
        try:
            refused = sensor.read_refused_bytes(device, self._pid, self._card.since_s)
        except Exception:
            refused = None
        if refused:
            return (
                f"the card refused an allocation of {format_size(refused)} to a process of "
                "the task's tree",
                refused,
            )
        least, total = self._card.free_least_bytes, self._card.total_bytes
        if least is None or total is None or least >= card_full_free_bytes(total):
            return None
        if not descendants:
            # Only the worker ran: its own frameworks raise their out-of-memory errors
            # (recognised by type or text), so its other errors are not the card's doing.
            return None
        rise = self._card.rise_bytes()
        rose = rise is not None and rise > 0
        if not ((peak is not None and peak > (self._baseline_bytes or 0)) or rose):
            return None
        return (
            f"the card's free bytes were read at {format_size(least)} of {format_size(total)} "
            f"during the task (full: below {format_size(card_full_free_bytes(total))}) while "
            "the task's tree grew",
            None,
        )

    def _read_exact(self, sensor: TreeSensor, device: DeviceInfo) -> tuple[int | None, str]:
        """The sensor's exact high-water of the window; the context noted from its row now."""
        members = self._tree.end()
        held_before = self._frameworks.sample()
        # The high-water and the tree's rows, from one reading where the sensor can.
        peak, tree, own = sensor.read_peak_and_root(device, members)
        self._note_tree(tree, own, held_before, members)
        return peak, "simulator" if sensor.name == "simulator" else f"{sensor.name}-exact"

    def _stop_sampling(self, sensor: TreeSensor, device: DeviceInfo) -> tuple[int | None, str]:
        members = self._tree.end()  # the sampler's last device sample has been taken
        # Read before the caches are released: the worker's own row then holds the
        # frameworks' bytes plus everything outside them (the context).
        now = self._read_tree(sensor, device, self._frameworks.sample(), members)
        peak = max((v for v in (self._sampled_peak_bytes, now) if v is not None), default=None)
        source = f"{sensor.name}-sampled"
        try:
            lifetime_max = _trusted(sensor.read_process_max_bytes(device, self._pid))
        except Exception:
            lifetime_max = None
        if self._foreign:
            lifetime_max = None  # the driver's maximum under this PID is another process's
        # The driver's own maximum rose during this task: it misses no spike of the
        # worker's. It is the worker's alone: its descendants' bytes are added.
        rose = lifetime_max is not None and lifetime_max > (self._max_at_start or 0)
        if rose and lifetime_max is not None:
            counted = lifetime_max + self._descendant_bytes
            if peak is None or counted >= peak:
                peak, source = counted, f"{sensor.name}-accounting{self._with_descendants()}"
        return peak, source

    def _with_descendants(self) -> str:
        """What a source of the worker's own figure adds when its descendants' bytes are added."""
        return "+descendants" if self._descendant_bytes > 0 else ""
