"""``gpupool top``, the command: the snapshot (:mod:`gpupool._observe.top`) once, as JSON
lines, or redrawn live (:mod:`gpupool._observe.top_view`, with ``rich``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from gpupool._errors import ConfigurationError, SensorError
from gpupool._observe.top import INSTALL_HINT, Gatherer, plain_text

__all__ = ["run_top"]


def run_top(args: argparse.Namespace, write: Callable[[str], object]) -> int:
    """``gpupool top``: returns the exit status (0; 1 where the sensor fails, the census
    refuses the environment or the live view lacks ``rich``; 2 for the live view on an
    output that is not a terminal)."""
    live = not args.once and not args.json
    if live:
        try:
            from gpupool._observe import top_view as _top_view
        except ImportError:
            sys.stderr.write(
                "gpupool top: the live view needs the 'rich' library: "
                f"{INSTALL_HINT} (--once and --json work without it)\n"
            )
            return 1
    if live and not sys.stdout.isatty():
        sys.stderr.write(
            "gpupool top: standard output is not a terminal, so the live view cannot be "
            "redrawn in place; use --once (one snapshot) or --json (one line per refresh)\n"
        )
        return 2
    try:
        gatherer = Gatherer()
    except (SensorError, ConfigurationError) as exc:  # a bad LOKY_MAX_CPU_COUNT, as census
        sys.stderr.write(f"gpupool top: {exc}\n")
        return 1
    try:
        if live:
            return _top_view.live(gatherer, args.interval)
        if args.once:
            snapshot = gatherer.snapshot()
            write(json.dumps(snapshot, indent=2) + "\n" if args.json else _once_text(snapshot))
            return 0
        while True:  # --json alone: one line per refresh, until interrupted
            write(json.dumps(gatherer.snapshot(), separators=(",", ":")) + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        gatherer.close()


def _once_text(snapshot: dict[str, Any]) -> str:
    """One snapshot for people: with ``rich`` as the live view draws it, else plain text."""
    try:
        from gpupool._observe.top_view import render_text
    except ImportError:
        return plain_text(snapshot)
    return render_text(snapshot)
