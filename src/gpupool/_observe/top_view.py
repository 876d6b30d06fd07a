"""``gpupool top``'s live view, drawn with ``rich`` (the ``top`` extra): imports it at once."""

from __future__ import annotations

import io
import shutil
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpupool._observe.top import COLUMNS, card_heading, no_device_line, pool_lines, pools_note

if TYPE_CHECKING:
    from rich.console import RenderableType

    from gpupool._observe.top import Gatherer

__all__ = ["live", "render", "render_text"]

#: How each kind of row is drawn.
_STYLES = {"pool": "bold", "task": "", "waiting": "yellow", "last": "dim"}


def render(snapshot: dict[str, Any], *, live: bool = True) -> RenderableType:
    """The snapshot as ``rich`` renderables: a heading, then a table per card."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot["time_s"]))
    hint = "  (Ctrl-C to leave)" if live else ""
    parts: list[RenderableType] = [Text(f"gpupool top  {stamp}{hint}", style="bold")]
    no_device = no_device_line(snapshot)
    if no_device is not None:
        parts.append(Text(no_device))
    for card in snapshot["cards"]:
        parts.append(_card(card))
    return Group(*parts)


def _card(card: dict[str, Any]) -> RenderableType:
    heading = Text(card_heading(card), style="bold cyan")
    note = pools_note(card)
    if note is not None:
        return Group(heading, Text(note))
    table = Table(box=None, pad_edge=False, padding=(0, 2), show_edge=False)
    for n, name in enumerate(COLUMNS):
        table.add_column(name, justify="right" if n in (2, 3) else "left", no_wrap=n < 4)
    for pool in card["pools"]:
        for kind, cells in pool_lines(pool):
            # Text, not markup: a key such as "[/]" is shown as written.
            table.add_row(*(Text(cell) for cell in cells), style=_STYLES[kind])
    return Group(heading, table)


def render_text(snapshot: dict[str, Any]) -> str:
    """The snapshot drawn as the live view draws it, as text without colour (``--once``)."""
    buffer = io.StringIO()
    width = shutil.get_terminal_size((120, 40)).columns
    Console(file=buffer, width=width, color_system=None, highlight=False).print(
        render(snapshot, live=False)
    )
    return buffer.getvalue()


def live(gatherer: Gatherer, interval_s: float) -> int:
    """Redraw the view in place every ``interval_s`` until interrupted; returns 0."""
    with Live(render(gatherer.snapshot()), auto_refresh=False, screen=True) as view:
        try:
            while True:
                time.sleep(interval_s)
                view.update(render(gatherer.snapshot()), refresh=True)
        except KeyboardInterrupt:
            return 0
