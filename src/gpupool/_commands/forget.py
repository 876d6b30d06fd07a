"""``gpupool forget [KEY]``: clear what pools remember of earlier runs' peaks.

With no key, the whole file goes (``gpupool.forget_peaks()``); with one (a function's
``module.qualname``, or a key given with ``options(key=...)``), only that task key's entries,
of every version of its code (or of one, named ``KEY@DIGEST``). It says what it removed: each
entry's key, card model and remembered peak.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool._core.units import format_size

if TYPE_CHECKING:
    from gpupool._pool.memory import Forgotten

__all__ = ["add_forget_parser", "run_forget"]

EXIT_OK = 0
EXIT_FAILURE = 1


def add_forget_parser(sub: Any, *, handler: Callable[[argparse.Namespace], int]) -> None:
    """Register ``forget`` on the subcommands ``sub``."""
    forget = sub.add_parser(
        "forget",
        help="clear what pools remember of earlier runs' peaks (all, or one task key's)",
        description=(
            "Clear the per-user memory of measured peaks that a pool reads when it is built "
            "and writes when it shuts down ($GPUPOOL_MEMORY, else "
            "$XDG_CACHE_HOME/gpupool/peaks.json, ~/.cache/gpupool/peaks.json). With KEY, "
            "only that task key's entries go (a function's module.qualname, or the key "
            "given with options(key=...); KEY@DIGEST names one version of its code). Prints "
            "each entry removed. Exit status: 0 done (also when nothing was remembered), "
            "1 the file could not be read or written."
        ),
    )
    forget.add_argument(
        "key", nargs="?", metavar="KEY", help="only this task key's entries (default: all)"
    )
    forget.add_argument(
        "--file",
        metavar="PATH",
        help="the memory file (default: the one pools use, from GPUPOOL_MEMORY)",
    )
    forget.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"path", "existed", "removed": [...]}',
    )
    forget.set_defaults(handler=handler)


def run_forget(
    args: argparse.Namespace, *, out: Callable[[str], None], err: Callable[[str], None]
) -> int:
    """``gpupool forget``: remove the entries, and say which (``out``) or why not (``err``)."""
    from gpupool._pool.memory import MEMORY_ENV, forget_entries, memory_path

    path = Path(args.file).expanduser() if args.file else memory_path(os.environ)
    if path is None:
        out(f"gpupool forget: remembering is off ({MEMORY_ENV}=off): nothing to forget")
        return EXIT_OK
    try:
        found = forget_entries(path, args.key)
    except OSError as exc:
        err(f"gpupool forget: could not clear {path}: {exc}")
        return EXIT_FAILURE
    if args.json:
        removed = [
            {"key": key, "model": model, "peak_bytes": value.peak_bytes, "samples": value.samples}
            for key, model, value in found.removed
        ]
        out(
            json.dumps(
                {
                    "path": str(path),
                    "existed": found.existed,
                    "unreadable": found.unreadable,
                    "removed": removed,
                },
                indent=2,
            )
        )
    else:
        for line in _described(found, args.key):
            out(line)
    if found.unreadable and args.key is not None:
        err(
            f"gpupool forget: {path} is not a file of peaks; run gpupool forget without a "
            "key to remove it"
        )
        return EXIT_FAILURE
    return EXIT_OK


def _described(found: Forgotten, key: str | None) -> list[str]:
    """What was forgotten, in words."""
    whose = "" if key is None else f" of {_shown(key)}"
    if not found.existed:
        return [f"nothing remembered: {found.path} does not exist"]
    if found.unreadable and key is None:
        return [f"removed {found.path} (not a file of peaks)"]
    if not found.removed:
        gone = "" if key is not None else f"; removed {found.path}"
        return [f"nothing remembered{whose} in {found.path}{gone}"]
    count = len(found.removed)
    lines = [f"forgot {count} remembered peak{'s' if count != 1 else ''}{whose} in {found.path}:"]
    for name, model, value in found.removed:
        lines.append(
            f"  {_shown(name)} on {_shown(model) or 'an unnamed card model'}: "
            f"{format_size(value.peak_bytes)} "
            f"over {value.samples} task{'s' if value.samples != 1 else ''}"
        )
    if key is None:
        lines.append(f"removed {found.path}")
    return lines


def _shown(text: str) -> str:
    """``text`` (from a file anything could write) with its unprintable characters escaped,
    so a key or model name cannot move the cursor or recolour the terminal."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
