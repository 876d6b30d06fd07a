"""``gpupool docs [TOPIC]``: the documentation pages, read from the installed package.

The wheel carries the pages (``docs/*.md``) as ``gpupool/_docs``; a source
checkout (an editable install) reads them from its ``docs`` directory. With no
topic the command lists the pages; with one it prints the page (MyST Markdown,
as written), or with ``--path`` where the file is.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["add_docs_parser", "docs_directory", "page_path", "topics"]

#: Where the wheel puts the pages, inside the package.
PACKAGED = Path(__file__).resolve().parent.parent / "_docs"
#: Where a source checkout keeps them (src/gpupool/_commands -> the repository's docs).
CHECKOUT = Path(__file__).resolve().parents[3] / "docs"

EXIT_OK = 0
EXIT_USAGE = 2


def docs_directory() -> Path | None:
    """The directory of the pages: the package's own, else the source checkout's; ``None``
    when neither has them."""
    for directory in (PACKAGED, CHECKOUT):
        if (directory / "index.md").is_file():
            return directory
    return None


def topics(directory: Path) -> dict[str, str]:
    """Every page's topic (its file name without ``.md``) and title (its first heading)."""
    found: dict[str, str] = {}
    for page in sorted(directory.glob("*.md")):
        title = page.stem
        with page.open(encoding="utf-8") as text:
            for line in text:
                if line.startswith("# "):
                    title = line[2:].strip()
                    break
        found[page.stem] = title
    return found


def page_path(directory: Path, topic: str) -> Path | None:
    """The page of ``topic`` (a topic as listed, or its file name), or ``None``."""
    name = topic.removesuffix(".md")
    if not name or "/" in name or name.startswith("."):
        return None
    page = directory / f"{name}.md"
    return page if page.is_file() else None


def add_docs_parser(sub: Any, handler: Callable[[argparse.Namespace], int]) -> None:
    """The ``docs`` subcommand."""
    docs = sub.add_parser(
        "docs",
        help="list the documentation's pages, or print one",
        description=(
            "The documentation, from the installed package: with no TOPIC, list the "
            "pages; with one, print it (Markdown), or with --path where its file is."
        ),
    )
    docs.add_argument("topic", nargs="?", metavar="TOPIC", help="a page, as listed (demo, joblib)")
    docs.add_argument("--path", action="store_true", help="print the page's file path instead")
    docs.set_defaults(handler=handler)


def run_docs(args: argparse.Namespace, out: Callable[[str], None]) -> int:
    """List the pages, print one, or print its path; 2 for an unknown topic."""
    directory = docs_directory()
    if directory is None:
        sys.stderr.write(
            "gpupool docs: this installation has no documentation pages (a wheel built "
            "from a source tree without docs/); reinstall gpupool from its wheel or sdist.\n"
        )
        return EXIT_USAGE
    pages = topics(directory)
    if args.topic is None:
        if args.path:
            out(str(directory))
            return EXIT_OK
        width = max(map(len, pages))
        for topic, title in pages.items():
            out(f"{topic:<{width}}  {title}")
        out("")
        out("gpupool docs TOPIC prints a page; gpupool docs TOPIC --path, where its file is.")
        return EXIT_OK
    page = page_path(directory, args.topic)
    if page is None:
        close = difflib.get_close_matches(args.topic, list(pages), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        sys.stderr.write(f"gpupool docs: no page {args.topic!r}{hint}; gpupool docs lists them.\n")
        return EXIT_USAGE
    if args.path:
        out(str(page))
    else:
        out(page.read_text(encoding="utf-8").rstrip("\n"))
    return EXIT_OK
