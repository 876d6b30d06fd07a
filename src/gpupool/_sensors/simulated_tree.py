"""The simulator's exact high-water of a process tree (I/O edge, part of the ledger).

A task's bytes may live in processes it starts. Every process's ledger entry
keeps its ancestors as they were at its first allocation, so a tree is known
even after a middle process exits. A *tree window* (one per root PID and
device, opened by :meth:`~gpupool._sensors.simulated.Ledger.open_tree`) keeps
the most bytes the root and its descendants held together since it opened,
updated under the ledger's lock at every allocation: exact, as a driver's
accounting would be, with no sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from gpupool._sensors.simulated_state import DeviceState, ProcessState

__all__ = ["TreeWindow", "is_pid_key", "note_trees", "tree_bytes", "tree_window_problem"]


class TreeWindow(TypedDict):
    """One open tree window: its root's identity and the tree's high-water since it opened."""

    start: str  # the root's start token: a reused PID is not the root
    window: int


def _in_tree(key: str, proc: ProcessState, root: str) -> bool:
    return key == root or int(root) in proc["ancestors"]


def tree_bytes(dev: DeviceState, root: str) -> int:
    """What ``root`` and every process under it hold on ``dev`` now."""
    if not dev["procs"]:
        return 0
    return sum(
        proc["context"] + proc["held"]
        for key, proc in dev["procs"].items()
        if _in_tree(key, proc, root)
    )


def note_trees(dev: DeviceState, key: str, proc: ProcessState) -> None:
    """After process ``key`` allocated: raise the window of every tree it belongs to."""
    for root, window in dev["trees"].items():
        if _in_tree(key, proc, root):
            window["window"] = max(window["window"], tree_bytes(dev, root))


def is_pid_key(key: object) -> bool:
    """Whether ``key`` is a PID as the ledger writes one: ASCII decimal digits, no leading 0
    (``str.isdigit`` alone takes a superscript "2", which ``int`` refuses, and other scripts'
    digits, which ``int`` reads as another spelling of a PID)."""
    return (
        isinstance(key, str)
        and key.isascii()
        and key.isdigit()
        and (key == "0" or not key.startswith("0"))
    )


def tree_window_problem(root: object, window: object) -> str | None:
    """What makes ``window`` not a tree window, or ``None``."""
    if not is_pid_key(root) or not isinstance(window, dict):
        return f"tree window {root!r} is {window!r}"
    size = window.get("window")
    if not isinstance(window.get("start"), str) or type(size) is not int or size < 0:
        return f"tree window {root!r} is {window!r}"
    return None
