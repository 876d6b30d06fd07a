"""What a child reports about one task: its peaks and how each was measured (pure core)."""

# No postponed annotations here: a named tuple's string annotations are compiled as it is made,
# which a worker would pay at every start.

from typing import NamedTuple

__all__ = ["MAX_REJECTIONS", "PeakReport", "TreeSummary"]

#: How many distinct reasons one task's report carries (the log grows with
#: decisions, not with samples).
MAX_REJECTIONS = 8


class PeakReport(NamedTuple):
    """One task's peaks, as its child process measured them.

    A named tuple, not a dataclass, so that a worker's start does not load
    :mod:`dataclasses` (and the :mod:`inspect` it imports): it travels as its
    values, in field order (:mod:`gpupool._pool.wire`). Build one by keyword.

    Attributes:
        device: the pool's device index the child is pinned to, or ``None``.
        device_peak_bytes: the most device bytes the child's process tree (the
            worker and every process alive under it during the task) held
            during the task (contexts and non-PyTorch allocations included),
            or ``None`` when no source could tell.
        device_source: how: ``"nvml-accounting"``, ``"nvml-sampled"``,
            ``"simulator"``, the frameworks' counters plus the context
            (``"torch+context"``, ``"torch+cupy+context"``, ``"jax+context"``,
            ...; ending ``"-estimated"`` where the context was not measured),
            or ``"none"``; a figure of the worker's own (accounting, the
            frameworks' counters) to which its descendants' bytes were added
            ends ``"+descendants"``.
        baseline_bytes: device bytes the child held when the task started (its
            context, typically), or ``None``.
        context_bytes: what the child holds outside the frameworks' allocators
            (its CUDA context, other libraries), or ``None`` where the report
            neither measured nor needed it.
        context_source: ``"process-row"`` (the child's device row less what
            the frameworks held); where no row of the child could be read, the
            estimate's: ``"estimated (default)"`` (``CONTEXT_ESTIMATE_BYTES``) or
            ``"estimated (largest measured on <model>: <size>, by <who>)"`` (the
            host's contexts file); or ``"none"``.
        rss_peak_bytes: the child's host RSS high-water, plus its descendants'
            high-water during the task.
        rss_source: how (``"vmhwm"``, ``"vmhwm+descendants"``, ``"none"``).
        oom: the task ended in a device out-of-memory.
        oom_requested_bytes: the allocation that failed, when the error said.
        descendants: how many processes were seen under the worker during the task.
        outliving_descendants: how many processes the task started were still
            running when it ended (the worker keeps them until it exits).
        outliving_device_bytes: what those held on the device when it ended,
            or ``None`` when no trusted row said.
        rejected_readings: why readings were not taken as measurements
            (implausible per-process rows), at most
            :data:`MAX_REJECTIONS`, each once.
        incomplete_reason: why the peak is a partial view, or ``None`` where it
            is whole: processes ran under the worker during the task and no
            reading told their device bytes (their rows hidden, as in a
            container, of 0, or not available, as on MIG). Such a peak is a
            lower bound: the planner never lowers a key's ask on it.
        card_used_peak_bytes: the most the whole card was seen using during
            the task (an upper bound on the tree's peak, whatever its rows
            hide), or ``None`` where the card's used bytes were not read.
        card_used_at_start_bytes: what the card used when the task started,
            or ``None``.
        oom_recognised: how the out-of-memory was recognised, where ``oom``:
            ``"type"`` (a framework's out-of-memory class), ``"message"`` (its
            words in the error's message), ``"subprocess-output"`` (in the error
            output of a subprocess the error carries), ``"command-output"``
            (in a ``gpupool run`` command's error output) or ``"card-full"`` (no
            text said so, but the task failed while its card was full and its
            tree had grown: :attr:`card_full_reason`).
        card_full_reason: what showed the card full during a task that failed
            (an allocation the card refused to a process of the task's tree, or
            its free bytes read below the probe's threshold), where that made
            the failure an out-of-memory; else ``None``.
    """

    device: int | None
    device_peak_bytes: int | None
    device_source: str
    baseline_bytes: int | None = None
    context_bytes: int | None = None
    context_source: str = "none"
    rss_peak_bytes: int | None = None
    rss_source: str = "none"
    oom: bool = False
    oom_requested_bytes: int | None = None
    descendants: int = 0
    outliving_descendants: int = 0
    outliving_device_bytes: int | None = None
    rejected_readings: tuple[str, ...] = ()
    incomplete_reason: str | None = None
    card_used_peak_bytes: int | None = None
    card_used_at_start_bytes: int | None = None
    oom_recognised: str | None = None
    card_full_reason: str | None = None

    @property
    def incomplete(self) -> bool:
        """Whether the peak is a partial view of the task's tree (:attr:`incomplete_reason`)."""
        return self.incomplete_reason is not None


class TreeSummary(NamedTuple):
    """What one task window saw of the worker's tree (the probe's tree watch).

    Attributes:
        descendants: processes seen under the worker during the window.
        outliving_pids: the descendants started during the window and still
            running at its end.
        outliving_device_bytes: what those held on the device then, from
            trusted rows, or ``None`` when none said.
        rss_peak_bytes: the descendants' host RSS high-water during the
            window, or ``None`` when none was seen.
        rejected: why readings of the tree were not measurements.
    """

    descendants: int
    outliving_pids: tuple[int, ...]
    outliving_device_bytes: int | None
    rss_peak_bytes: int | None
    rejected: tuple[str, ...]
