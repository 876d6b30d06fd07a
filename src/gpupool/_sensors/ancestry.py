"""Who started a process: parent PIDs from ``/proc`` (I/O edge).

Apart from the host's census (:mod:`gpupool._sensors.host`, which re-exports
these), so that a worker, which asks only whose process a reading is, does
not load the census and its parsers.
"""

from __future__ import annotations

import os

__all__ = ["is_descendant", "read_ancestors", "read_parent_pid"]

#: How many parents :func:`read_ancestors` follows: process trees are shallow,
#: and a loop (a PID reused while we walk) must end.
_MAX_ANCESTRY = 64


def read_parent_pid(pid: int, proc: str | os.PathLike[str] = "/proc") -> int | None:
    """``pid``'s parent PID from ``/proc/<pid>/stat`` (field 4), or ``None`` if it is gone."""
    try:
        with open(os.path.join(proc, str(pid), "stat"), "rb") as file:
            text = file.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(b")") + 2 :].split()
    if len(fields) < 2 or not fields[1].isdigit():
        return None
    return int(fields[1])


def read_ancestors(pid: int, proc: str | os.PathLike[str] = "/proc") -> tuple[int, ...]:
    """``pid``'s parent, its parent's parent... up to and excluding init (PID 1)."""
    found: list[int] = []
    current = read_parent_pid(pid, proc)
    while current is not None and current > 1 and len(found) < _MAX_ANCESTRY:
        if current in found:
            break  # a PID reused while we walked
        found.append(current)
        current = read_parent_pid(current, proc)
    return tuple(found)


def is_descendant(pid: int, ancestor: int, proc: str | os.PathLike[str] = "/proc") -> bool:
    """Whether process ``pid`` is ``ancestor`` or was started under it (a child, a grandchild...).

    A pool's workers and the processes their tasks start are descendants of
    the pool's parent: on unified memory they are the pool itself, not
    competitors. A PID this namespace cannot see is not a descendant.
    """
    return pid == ancestor or ancestor in read_ancestors(pid, proc)
