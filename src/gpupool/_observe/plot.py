"""Draw a decision log: per card and run, the card as it was read, what was booked, the width.

A reader of :class:`gpupool._observe.postmortem.Postmortem`, never of the pool. Each
run is a column, on one time axis shared by every panel of the figure; each
card of a run is three panels:

* **memory**: stacked from the bottom, what the card's readings (the
  ``card_read`` samples and the out-of-memory records) showed of the
  co-tenants (everything not a gpupool pool's), of this process (the parent)
  and of other gpupool pools, then each running task's booking, summed per
  task key and named in the legend; each reading holds until the next. The
  card's used bytes as read are a black line (a dot per reading); the census
  co-tenant the bound was priced at is a dashed grey line, and the bound's
  price (census co-tenant + other pools + own high-water + the width's price,
  which for a key whose tasks are priced together is the pooled price the
  record states, "X for the K together", never width x ask) a dotted green one;
  the card's total is a thick black line. A log without readings (written
  before them) stacks the priced terms instead. Each out-of-memory is a red
  cross at the bytes the card was asked for (used + refused). The axis is
  fitted to the card (a little over its total): a point above it is drawn at
  the top edge with its value written beside it.
* **events**: a lane each for out-of-memory (counted per slice of the run, so
  that many read as numbers, not a smear), width moves refused or caps lifted,
  waits (live gate, share, queue head, critical key) and serial starts.
* **width**: the tasks the card admits at once, and this card's own limits:
  the tasks its room holds at the ask (dashed) and the cap an out-of-memory
  set (dotted). The pool-wide ceiling (``max_workers``, CPUs, RAM) is drawn
  there only when the run had one card; with more, it is drawn once, under
  the cards, beside the width of all the cards together.

Every marker of an event carries its record's reason: in an SVG, as a
``<title>`` (a browser shows it on hover). The legend names each marker.

matplotlib is imported on first use, through its object-oriented API with
the Agg canvas, so drawing never touches a user's pyplot state or display.
The format follows the output's suffix (``.png``, ``.svg``, ``.pdf``) or
``fmt``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from xml.sax.saxutils import escape

from gpupool._core.units import GiB, format_size
from gpupool._errors import GpuPoolError
from gpupool._observe.plot_series import WAIT_EVENTS, CardView, DevicePlot, Mark, PoolView, View

if TYPE_CHECKING:
    from gpupool._observe.postmortem import Postmortem

__all__ = [
    "FORMATS",
    "CardView",
    "PlotUnavailableError",
    "PoolView",
    "card_views",
    "plot_figure",
    "write_plot",
]

#: The formats :func:`write_plot` writes.
FORMATS = ("png", "svg", "pdf")

#: Inches per card (three panels), per pool panel and per run column: legible at 100 dpi.
_CARD_HEIGHT_IN = 5.6
_POOL_HEIGHT_IN = 1.3
_COLUMN_WIDTH_IN = 7.5
_DPI = 100
#: Height ratios of a card's panels (memory, events, width) and of the pool panel.
_CARD_RATIOS = (3.0, 1.0, 1.3)
_POOL_RATIO = 1.3
#: How far over the card's total the memory axis reaches.
_HEADROOM = 1.12
#: Out-of-memory events closer than this part of the run are one burst, drawn with its count.
_BURST_PART = 1 / 60
#: More out-of-memory events than this on a card: no line through the panels for each.
_OOM_LINES = 8

_CO = "#9aa5b1"
_OWN = "#6c8ebf"
_OTHERS = "#d6b656"
_KEYS = ("#82b366", "#5b9a68", "#b5d99c", "#3f7f4f", "#a3c585", "#6fae8a", "#cfe8b8")
_USED = "#222222"
_OOM = "#d62728"
_PRICE = "#2d6a2d"
_LIMIT = "#b85450"

#: Each marked event: its lane in the events panel, its marker, colour and legend label.
_MARKS: dict[str, tuple[str, str, str, str]] = {
    "out_of_memory": (
        "out of memory",
        "X",
        _OOM,
        "out of memory (a burst: first to last, its count)",
    ),
    "widen_refused": ("widen / cap", "v", "#666666", "widen refused"),
    "cap_lifted": ("widen / cap", "^", "#17becf", "cap lifted (an out-of-memory's)"),
    "live_gate_wait": ("waits", "o", "#ff7f0e", "wait: live free bytes short"),
    "share_wait": ("waits", "s", "#8c564b", "wait: another pool's share"),
    "head_wait": ("waits", "D", "#e377c2", "wait: room held for the queue's head"),
    "critical_wait": ("waits", "P", "#bcbd22", "wait: the slowest key first"),
    "serial_start": ("serial start", "|", "#9467bd", "serial start (past the bound)"),
}
_LANES = ("out of memory", "widen / cap", "waits", "serial start")
_HOVER_PREFIX = "gpupool-hover-"


class PlotUnavailableError(GpuPoolError):
    """matplotlib is not installed (the ``plot`` extra), or the log has nothing to draw."""


# -- the views of a run's cards ------------------------------------------------------


def _pool_ceiling(pm: Postmortem) -> list[tuple[float, int]]:
    """The pool-wide ceiling's steps, as every card's records carried it."""
    points = sorted(
        (p[0], int(p[6])) for card in pm.devices.values() for p in card.terms.points if p[6] >= 0
    )
    return [p for i, p in enumerate(points) if i == 0 or p[1] != points[i - 1][1]]


def _width_price(width: int, ask_bytes: int, together_tasks: int, together_bytes: int) -> int:
    """What a record states ``width`` tasks at ``ask_bytes`` were priced at together.

    Unpooled (``together_tasks < 0``: the record states no pooled price): ``width x ask``.
    Pooled, the record states the price of ``together_tasks`` tasks (``K``; of one task
    where ``K`` is 0): at ``K`` that price; below ``K``, the lesser of it and ``width x
    ask`` (the width's own price is at most either); above ``K`` (a floor or fixed width
    past the room), that price and each further task at its full ask.
    """
    if together_tasks < 0 or together_bytes < 0:
        return width * ask_bytes
    priced_for = max(1, together_tasks)
    if width <= priced_for:
        return min(width * ask_bytes, together_bytes)
    return together_bytes + (width - priced_for) * ask_bytes


def _card_view(pm: Postmortem, card: DevicePlot, run: str, one_card: bool) -> CardView | None:
    points = card.terms.points
    if not points and not (card.reads.points and card.total_bytes > 0):
        return None  # a log of samples alone (a long log's tail) draws its readings
    priced: list[tuple[float, int, int, int, int]] = []
    width_now = 1
    for time_s, _total, co, own, ask, width, _ceiling, others, k, together in points:
        width_now = int(width) if width >= 0 else width_now
        price = _width_price(width_now, int(ask), int(k), int(together))
        priced.append((time_s, int(co), int(own), int(others), price))
    series = pm.device_widths.get(card.device)
    total = int(points[-1][1]) if points else card.total_bytes
    marks = {event: m.points for event, m in card.marks.items()}
    counts = {event: m.count for event, m in card.marks.items()}
    view = CardView(
        title="",
        name=f"{run}card {card.device}",
        total_bytes=total,
        end_s=max(pm.duration_s, 1e-3),
        priced=priced,
        reads=[(p[0], int(p[1]), int(p[2]), int(p[3]), int(p[4])) for p in card.reads.points],
        key_names=list(card.key_names),
        keys=[(p[0], tuple(int(b) for b in p[1:])) for p in card.keys.points],
        used=[(p[0], int(p[1])) for p in card.live_used.points],
        width=[(t, int(w)) for t, w in series.points] if series is not None else [],
        limit=[(p[0], int(p[1]), int(p[2])) for p in card.limit.points],
        ceiling=_pool_ceiling(pm) if one_card else [],
        marks=marks,
        counts=counts,
    )
    waits = sum(view.count(e) for e in WAIT_EVENTS)
    view.title = (
        f"{view.name}, {format_size(total)}: {view.count('out_of_memory')} out-of-memory, "
        f"{view.count('widen_refused')} refused widens, {waits} waits"
    )
    return view


def card_views(runs: Postmortem | Sequence[Postmortem]) -> list[list[View]]:
    """One column per run: a :class:`CardView` per card that a record priced, and for a run
    of several cards a :class:`PoolView` under them."""
    runs = [runs] if not isinstance(runs, Sequence) else list(runs)
    columns: list[list[View]] = []
    for pm in runs:
        run = f"run {pm.run_index} " if len(runs) > 1 else ""
        if pm.node:
            run += f"(node {pm.node}) "
        one_card = len(pm.devices) == 1
        column: list[View] = [
            view
            for _, card in sorted(pm.devices.items())
            if (view := _card_view(pm, card, run, one_card)) is not None
        ]
        if len(column) > 1:
            column.append(
                PoolView(
                    title=f"{run}the pool: its cards' widths together, under the pool-wide ceiling",
                    name=f"{run}pool",
                    end_s=max(pm.duration_s, 1e-3),
                    width=[(t, int(w)) for t, w in pm.widths.points],
                    ceiling=_pool_ceiling(pm),
                )
            )
        if column:
            columns.append(column)
    return columns


def _require_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "drawing needs matplotlib: pip install 'gpupool[plot]' (or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def write_plot(
    runs: Postmortem | Sequence[Postmortem],
    output: str | Path | IO[bytes],
    *,
    fmt: str | None = None,
    columns: Sequence[Sequence[View]] | None = None,
    title: str | None = None,
) -> None:
    """Draw every run of a log (a column each), every card of a run (three panels each).

    Args:
        runs: the postmortem of each run to draw (``read_runs``).
        output: the file to write, or a binary stream.
        fmt: ``"png"``, ``"svg"`` or ``"pdf"``; default: the output's suffix
            (``png`` for a stream).
        columns: further columns to draw beside the runs (the demo's fixed
            pool, drawn from its own readings).
        title: the figure's title (default: the log's name).

    Raises:
        PlotUnavailableError: matplotlib is missing, or no record reads a card or
            carries its terms (a host-only pool has no memory to draw).
        ValueError: ``fmt`` (or the suffix) is not one of :data:`FORMATS`.
        OSError: the file cannot be written.
    """
    if fmt is None:
        suffix = Path(output).suffix.lower().lstrip(".") if isinstance(output, (str, Path)) else ""
        fmt = suffix or "png"
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: pass one of {', '.join(FORMATS)}")
    figure, hover = _build(runs, columns=columns, title=title, hover=fmt == "svg")
    if fmt != "svg":
        figure.savefig(output, format=fmt)
        return
    buffer = io.BytesIO()
    figure.savefig(buffer, format="svg")
    svg = _with_titles(buffer.getvalue().decode("utf-8"), hover).encode("utf-8")
    if isinstance(output, (str, Path)):
        Path(output).write_bytes(svg)
    else:
        output.write(svg)


def _with_titles(svg: str, hover: dict[str, str]) -> str:
    """``svg`` with a ``<title>`` (shown on hover) first in each group an event was drawn in."""

    def titled(match: re.Match[str]) -> str:
        text = hover.get(match.group(1))
        return (
            match.group(0) if text is None else f"{match.group(0)}\n<title>{escape(text)}</title>"
        )

    return re.sub(rf'<g id="({_HOVER_PREFIX}\d+)">', titled, svg)


def plot_figure(
    runs: Postmortem | Sequence[Postmortem],
    *,
    columns: Sequence[Sequence[View]] | None = None,
    title: str | None = None,
) -> Any:
    """The figure :func:`write_plot` saves as PNG or PDF (a matplotlib ``Figure`` on the Agg
    canvas; its legend says where the reasons are, as a PNG's does)."""
    return _build(runs, columns=columns, title=title, hover=False)[0]


def _build(
    runs: Postmortem | Sequence[Postmortem],
    *,
    columns: Sequence[Sequence[View]] | None,
    title: str | None,
    hover: bool,
) -> tuple[Any, dict[str, str]]:
    figure_cls, canvas_cls = _require_matplotlib()
    grid_views = card_views(runs) + [list(c) for c in columns or () if c]
    pms = [runs] if not isinstance(runs, Sequence) else list(runs)
    if not grid_views:
        name = pms[0].path if pms else "the log"
        raise PlotUnavailableError(
            f"{name}: no record reads a card or carries its memory terms (a pool without a "
            "device, or one that has not finished its construction, has nothing to draw); "
            "see gpupool postmortem for the run"
        )
    heights = [
        sum(_CARD_HEIGHT_IN if isinstance(v, CardView) else _POOL_HEIGHT_IN for v in c)
        for c in grid_views
    ]
    figure = figure_cls(
        figsize=(_COLUMN_WIDTH_IN * len(grid_views), max(heights) + 1.6),
        dpi=_DPI,
        layout="constrained",
    )
    canvas_cls(figure)
    titles: dict[str, str] = {}
    outer = figure.add_gridspec(1, len(grid_views))
    axes: list[Any] = []
    for col, views in enumerate(grid_views):
        ratios = [r for v in views for r in (_CARD_RATIOS if isinstance(v, CardView) else [1.3])]
        if heights[col] < max(heights):  # keep every column's panels at one scale
            ratios.append(sum(ratios) * (max(heights) - heights[col]) / heights[col])
        cells = outer[0, col].subgridspec(len(ratios), 1, height_ratios=ratios)
        row = 0
        for view in views:
            panels: list[Any] = []
            for i in range(3 if isinstance(view, CardView) else 1):
                panels.append(
                    figure.add_subplot(cells[row + i, 0], sharex=(axes or panels or [None])[0])
                )
            row += len(panels)
            axes.extend(panels)
            if isinstance(view, CardView):
                _draw_card(panels, view, titles)
            else:
                _draw_pool(panels[0], view)
    axes[0].set_xlim(0, max(v.end_s for c in grid_views for v in c))
    figure.suptitle(
        title or (f"gpupool run: {Path(pms[0].path).name}" if pms else "gpupool"), fontsize=12
    )
    _legend(figure, axes, len(grid_views), hover=hover)
    return figure, titles


#: What a marker's legend label ends with: where its reason is shown, by format (an SVG
#: shows it on hover; a PNG or PDF cannot, and gpupool postmortem prints every reason).
_REASON_NOTE = " (reason on hover)"
_REASON_ELSEWHERE = " (why: postmortem)"


def _legend(figure: Any, axes: list[Any], columns: int, *, hover: bool) -> None:
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if not hover and label.endswith(_REASON_NOTE):
                label = label[: -len(_REASON_NOTE)] + _REASON_ELSEWHERE
            handles.setdefault(label, handle)
    figure.legend(
        list(handles.values()),
        list(handles.keys()),
        loc="outside lower center",
        ncol=max(1, min(2 * columns, len(handles))),
        fontsize=8,
        frameon=False,
    )


def _steps(points: Sequence[tuple[Any, ...]], end: float) -> tuple[list[float], list[Any]]:
    """Times and values of a step function that holds each point until ``end``."""
    times = [float(p[0]) for p in points] + [max(end, float(points[-1][0]))]
    values = [p[1:] for p in points]
    values.append(values[-1])
    return times, values


def _step_count(ax: Any, points: Sequence[tuple[Any, ...]], end: float, **style: Any) -> None:
    """Draw a count over time (a width, a ceiling) as steps held until ``end``."""
    times, values = _steps(points, end)
    ax.step(times, [v[0] for v in values], where="post", **style)


def _draw_card(panels: list[Any], view: CardView, hover: dict[str, str]) -> None:
    memory, events, width = panels
    memory.set_label(f"memory: {view.name}")
    events.set_label(f"events: {view.name}")
    width.set_label(f"width: {view.name}")
    _draw_memory(memory, view, hover)
    _draw_events(events, view, hover)
    _draw_width(width, view)
    ooms = view.marks.get("out_of_memory", [])
    if len(ooms) <= _OOM_LINES:
        for time_s, _, _ in ooms:
            for ax in panels:
                ax.axvline(time_s, color=_OOM, linewidth=0.8, alpha=0.4)
    for ax in (memory, events):
        ax.tick_params(labelbottom=False)


def _draw_memory(memory: Any, view: CardView, hover: dict[str, str]) -> None:
    top = view.total_bytes / GiB * _HEADROOM
    if view.reads:
        _draw_read_stack(memory, view)
    elif view.priced:
        _draw_priced_stack(memory, view)
    if view.priced:
        times, values = _steps(view.priced, view.end_s)
        if view.reads and any(v[0] for v in values):
            memory.step(
                times,
                [v[0] / GiB for v in values],
                where="post",
                color="#59636e",
                linestyle="--",
                linewidth=1,
                label="co-tenants at the census (as priced)",
            )
        memory.step(
            times,
            [min(sum(v) / GiB, top) for v in values],
            where="post",
            color=_PRICE,
            linestyle=":",
            linewidth=1.4,
            label="priced: the bound's terms + the width's price",
        )
    memory.axhline(view.total_bytes / GiB, color="black", linewidth=2, label="card total")
    if view.used:
        _draw_used(memory, view, top)
    _draw_oom_crosses(memory, view.marks.get("out_of_memory", []), top, hover)
    memory.set_ylim(0, top)
    memory.set_ylabel("GiB on the card")
    memory.set_title(view.title, fontsize=10)
    memory.grid(axis="y", alpha=0.3)


def _draw_read_stack(memory: Any, view: CardView) -> None:
    """The readings' residents, then each key's bookings, stacked; each held until the next."""
    rows: list[tuple[float, ...]] = []
    keys = view.keys or [(p[0], ()) for p in view.reads]
    at = 0
    for time_s, booked in keys:
        while at + 1 < len(view.reads) and view.reads[at + 1][0] <= time_s:
            at += 1
        _, _, co, own, others = view.reads[at]
        per_key = [booked[i] if i < len(booked) else 0 for i in range(len(view.key_names))]
        rows.append((time_s, co, own, others, *per_key))
    times, values = _steps(rows, view.end_s)
    layers = [
        ("co-tenants, as read", _CO),
        ("this process (the parent), as read", _OWN),
        ("other gpupool pools, as read", _OTHERS),
        *((f"booked: {key}", _KEYS[i % len(_KEYS)]) for i, key in enumerate(view.key_names)),
    ]
    base = [0.0] * len(times)
    for i, (label, color) in enumerate(layers):
        layer = [v[i] / GiB for v in values]
        if not any(layer):
            continue
        upper = [b + x for b, x in zip(base, layer, strict=True)]
        memory.fill_between(
            times,
            base,
            upper,
            step="post",
            color=color,
            alpha=0.85 if i > 2 else 1,
            linewidth=0,
            label=label,
        )
        base = upper


def _draw_priced_stack(memory: Any, view: CardView) -> None:
    """A log without readings: the priced terms stacked (co-tenant, own high-water, other
    pools, the width's price)."""
    times, values = _steps(view.priced, view.end_s)
    co = [v[0] / GiB for v in values]
    own = [(v[0] + v[1]) / GiB for v in values]
    others = [(v[0] + v[1] + v[2]) / GiB for v in values]
    booked = [sum(v) / GiB for v in values]
    for low, high, color, label in (
        ([0.0] * len(co), co, _CO, "co-tenant (census)"),
        (co, own, _OWN, "own high-water"),
        (own, others, _OTHERS, "other gpupool pools (booked)"),
        (others, booked, _KEYS[0], "priced: the width's tasks"),
    ):
        if high == low:
            continue
        memory.fill_between(times, low, high, step="post", color=color, linewidth=0, label=label)


def _draw_used(memory: Any, view: CardView, top: float) -> None:
    times = [p[0] for p in view.used]
    gib = [min(p[1] / GiB, top) for p in view.used]
    if view.used_sampled:
        memory.plot(times, gib, "-", color=_USED, linewidth=1, label=view.used_label)
        return
    steps, values = _steps(view.used, view.end_s)
    memory.step(
        steps, [min(v[0] / GiB, top) for v in values], where="post", color=_USED, linewidth=1.2
    )
    memory.plot(times, gib, "o", color=_USED, markersize=3, label=view.used_label)


def _hover(artist: Any, text: str, hover: dict[str, str]) -> None:
    gid = f"{_HOVER_PREFIX}{len(hover)}"
    artist.set_gid(gid)
    hover[gid] = text


def _draw_oom_crosses(memory: Any, ooms: list[Mark], top: float, hover: dict[str, str]) -> None:
    """Each out-of-memory a cross at the bytes asked of the card, its reason on hover."""
    many = len(ooms) > _OOM_LINES
    for time_s, asked, reason in ooms:
        (cross,) = memory.plot(
            [time_s],
            [min(asked / GiB, top * 0.98)],
            "X",
            color=_OOM,
            markersize=5 if many else 9,
            alpha=0.5 if many else 1,
            label=f"out of memory at used + refused{_REASON_NOTE}",
        )
        _hover(cross, f"{time_s:.2f} s: {reason}", hover)
    if ooms:
        high = max(ooms, key=lambda p: p[1])
        if high[1] / GiB > top:
            memory.annotate(
                f"asked {format_size(high[1])}",
                (high[0], top * 0.98),
                xytext=(6, -4),
                textcoords="offset points",
                fontsize=8,
                color=_OOM,
            )


def _draw_events(ax: Any, view: CardView, hover: dict[str, str]) -> None:
    lanes = [lane for lane in _LANES if any(_MARKS[e][0] == lane for e in view.marks)]
    ax.set_ylim(-0.6, max(1, len(lanes)) - 0.4)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="y", alpha=0.3)
    if not lanes:
        ax.text(
            0.5,
            0.5,
            "no out-of-memory, refused widen, cap lifted, wait or serial start",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            color="#666666",
        )
        return
    for event, marks in view.marks.items():
        lane, marker, color, label = _MARKS[event]
        y = lanes.index(lane)
        if event == "out_of_memory":
            _draw_oom_counts(ax, marks, y, view.end_s, hover)
            continue
        for time_s, _, reason in marks:
            (dot,) = ax.plot(
                [time_s], [y], marker, color=color, markersize=8, label=f"{label}{_REASON_NOTE}"
            )
            _hover(dot, f"{time_s:.2f} s, {event}: {reason}", hover)


def _bursts(ooms: list[Mark], gap_s: float) -> list[list[Mark]]:
    """Out-of-memory events in bursts: each closer than ``gap_s`` to the one before."""
    bursts: list[list[Mark]] = []
    for mark in sorted(ooms, key=lambda m: m[0]):
        if bursts and mark[0] - bursts[-1][-1][0] < gap_s:
            bursts[-1].append(mark)
        else:
            bursts.append([mark])
    return bursts


def _draw_oom_counts(
    ax: Any, ooms: list[Mark], y: int, end_s: float, hover: dict[str, str]
) -> None:
    """Out-of-memory events counted per burst (events closer than :data:`_BURST_PART` of the run):
    a lone one is a cross; a burst a bar from its first to its last, with its count."""
    for burst in _bursts(ooms, end_s * _BURST_PART):
        first, last = burst[0][0], burst[-1][0]
        label = _MARKS["out_of_memory"][3]
        if len(burst) == 1:
            (artist,) = ax.plot([first], [y], "X", color=_OOM, markersize=9, label=label)
            text = f"{first:.2f} s: {burst[0][2]}"
        else:
            (artist,) = ax.plot(
                [first, last],
                [y, y],
                "X-",
                color=_OOM,
                markersize=9,
                linewidth=6,
                solid_capstyle="butt",
                label=label,
            )
            ax.annotate(
                f"{len(burst)}",
                (last, y),
                xytext=(6, 0),
                textcoords="offset points",
                va="center",
                fontsize=9,
                fontweight="bold",
                color=_OOM,
            )
            text = (
                f"{len(burst)} out-of-memory from {first:.2f} to {last:.2f} s; "
                f"the first: {burst[0][2]}"
            )
        _hover(artist, text, hover)


def _draw_width(width_ax: Any, view: CardView) -> None:
    end = view.end_s
    if view.width:
        _step_count(
            width_ax, view.width, end, color=_PRICE, linewidth=2, label="width (tasks at once)"
        )
    shown = [w for _, w in view.width] + [c for _, c in view.ceiling]
    shown += [cap for _, _, cap in view.limit if cap >= 0]
    fits = [fit for _, fit, _ in view.limit]
    top = max([1, *shown, *[f for f in fits if f <= 2 * max([1, *shown])]]) + 1
    if view.limit:
        times, values = _steps(view.limit, end)
        if max(fits) >= 0:  # not where the log states none (-1: written before tasks_fit)
            width_ax.step(
                times,
                [min(v[0], top) if v[0] >= 0 else float("nan") for v in values],
                where="post",
                color=_LIMIT,
                linestyle="--",
                linewidth=1.6,
                zorder=3,
                label="this card's limit (tasks its room holds)",
            )
        if max(fits) > top:
            width_ax.annotate(
                f"room holds {max(fits)}",
                (0, top),
                xytext=(4, -10),
                textcoords="offset points",
                fontsize=8,
                color=_LIMIT,
            )
        if any(v[1] >= 0 for v in values):
            width_ax.step(
                times,
                [v[1] if v[1] >= 0 else float("nan") for v in values],
                where="post",
                color=_OOM,
                linestyle=":",
                linewidth=2,
                label="this card's cap after an out-of-memory",
            )
    if view.ceiling:
        _draw_ceiling(width_ax, view.ceiling, end)
    _finish_counts(width_ax, top)


def _draw_ceiling(ax: Any, ceiling: list[tuple[float, int]], end: float) -> None:
    _step_count(
        ax,
        ceiling,
        end,
        color="#444444",
        linestyle="-.",
        label="pool-wide ceiling (max_workers, CPUs, RAM)",
    )


def _draw_pool(ax: Any, view: PoolView) -> None:
    ax.set_label(view.name)
    if view.width:
        _step_count(
            ax,
            view.width,
            view.end_s,
            color=_PRICE,
            linewidth=2,
            label="the pool's width (all cards)",
        )
    if view.ceiling:
        _draw_ceiling(ax, view.ceiling, view.end_s)
    ax.set_title(view.title, fontsize=10)
    _finish_counts(ax, max([1, *(w for _, w in view.width), *(c for _, c in view.ceiling)]) + 1)


def _finish_counts(ax: Any, top: float) -> None:
    """The axes of a count over time (tasks, from 0 to ``top``, in whole steps)."""
    ax.set_ylim(0, top)
    ax.set_ylabel("tasks")
    ax.set_xlabel("seconds since the pool started")
    ax.grid(axis="y", alpha=0.3)
    ax.yaxis.get_major_locator().set_params(integer=True)
