"""The command line: ``gpupool plan | census | demo | postmortem | plot`` (the only module that prints).

Each subcommand is a function ``_cmd_<name>(args) -> int`` registered in
:func:`build_parser`; ``main`` returns the exit status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="Pack GPU work onto cards by measured memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    status: int = handler(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
