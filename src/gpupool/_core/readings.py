"""Which per-process rows are measurements (pure core).

A driver's per-process list is the child's source for its task's device peak
where no exact high-water exists. Some lists are not what they say:

* drivers 535.113 to 560 report 0 bytes for every process inside a container;
* a binding whose process struct does not match the driver's (the early R535
  ``_v3`` break) reads every entry after the first at the wrong offset: PIDs
  come out as 0, as ``0xFFFFFFFF`` (NVML's "no value") or as another field,
  and byte counts as another entry's PID (a "16,040-byte" process);
* a row can claim more than the whole device holds.

:func:`judge_tree_rows` takes one reading of a device (its rows and, where
the device reports it, its used bytes) and the PIDs of one process tree, and
returns the tree's bytes or ``None`` with the reasons, which the probe sends
to the decision log. A reading that is not a measurement is never replaced by
a guess: the task then reports what other sources measured, or no peak.
"""

# No postponed annotations here: a named tuple's string annotations are compiled as it is made,
# which a worker would pay at every start.

from collections.abc import Collection, Sequence
from typing import NamedTuple

from gpupool._core.units import MiB

__all__ = [
    "CONTEXT_FLOOR_BYTES",
    "IMPOSSIBLE_PIDS",
    "TreeRows",
    "judge_tree_rows",
]

#: The least bytes a process the driver lists can hold: every listed process
#: holds a CUDA context, which current drivers report at hundreds of MiB (a
#: lazily loaded context measures 250-430 MiB). 4 MiB is 2**22, Linux's
#: ``PID_MAX_LIMIT``: a row misread at the wrong struct offset, whose bytes are
#: another entry's PID, always lands below it, and so does a container
#: driver's 0. A row this small is a misreading, never a context.
CONTEXT_FLOOR_BYTES = 4 * MiB

#: PIDs no process has: 0 is the kernel's idle task, which holds no context;
#: ``0xFFFFFFFF`` is NVML's "not available". A list that holds one was misread.
IMPOSSIBLE_PIDS = frozenset({0, 0xFFFFFFFF})


class TreeRows(NamedTuple):
    """One reading of a device, judged for one process tree.

    Attributes:
        tree_bytes: the tree's device bytes, or ``None`` when the reading is
            not a measurement of it (a row rejected, or one without a figure),
            or lists none of its processes.
        reasons: why rows were rejected, in words with their figures.
    """

    tree_bytes: int | None
    reasons: tuple[str, ...] = ()


def judge_tree_rows(
    rows: Sequence[tuple[int, int | None]],
    members: Collection[int],
    *,
    device_used_bytes: int | None,
    floor_bytes: int = CONTEXT_FLOOR_BYTES,
) -> TreeRows:
    """The bytes ``members`` hold by these rows, where the reading is a measurement of them.

    Args:
        rows: ``(pid, used_bytes)`` per process listed (``None``: the driver does not say).
        members: the tree's PIDs (a member without a row holds no device memory).
        device_used_bytes: the device's used bytes from the same reading,
            or ``None`` where it has none (unified memory, a failed reading).
        floor_bytes: the least a listed process holds (:data:`CONTEXT_FLOOR_BYTES`).

    Returns:
        The tree's bytes, or ``None`` and the reasons. A list that holds an
        impossible PID is rejected whole (it was misread, so its other rows
        are at the wrong offsets too). A member's row below ``floor_bytes``,
        or without a figure, leaves the tree's bytes unknown (a sum without
        it would be too low). Rows that add up to more than the device's used
        bytes disagree with the device: nothing the tree holds is outside
        ``used``, whatever the rest of the card freed since.
    """
    for pid, _ in rows:
        if pid in IMPOSSIBLE_PIDS:
            return TreeRows(
                tree_bytes=None,
                reasons=(
                    f"the driver's process list holds PID {pid}, which no process has: the "
                    "list was misread (a binding whose process struct does not match the "
                    "driver's, as with early R535 drivers), so none of its rows is a measurement",
                ),
            )
    summed = _sum_member_rows(rows, members, floor_bytes)
    total = summed.tree_bytes
    if total is not None and device_used_bytes is not None and total > device_used_bytes:
        return TreeRows(
            tree_bytes=None,
            reasons=(
                f"the rows of the task's processes add up to {total} bytes, more than the "
                f"{device_used_bytes} bytes in use on the whole device: not a measurement",
            ),
        )
    return summed


def _sum_member_rows(
    rows: Sequence[tuple[int, int | None]], members: Collection[int], floor_bytes: int
) -> TreeRows:
    """The members' rows summed, unless one of them is not a measurement or none is listed."""
    total = 0
    listed = False
    for pid, used in rows:
        if pid not in members:
            continue
        if used is None:  # the driver does not say (WDDM, MIG instances)
            return TreeRows(
                tree_bytes=None,
                reasons=(
                    f"PID {pid}'s row has no figure (the driver's \"not available\", as on a "
                    "MIG instance): not a measurement",
                ),
            )
        if used < floor_bytes:
            return TreeRows(
                tree_bytes=None,
                reasons=(
                    f"PID {pid}'s row says {used} bytes, less than any CUDA context "
                    f"({floor_bytes} bytes): a misread or withheld figure, not a measurement",
                ),
            )
        total += used
        listed = True
    return TreeRows(tree_bytes=total if listed else None)
