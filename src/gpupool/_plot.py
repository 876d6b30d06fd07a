"""Draw a decision log: per card and run, memory booked and read, and the width (extra ``plot``).

A reader of :class:`gpupool._postmortem.Postmortem`, never of the pool. Each
run is a column; each card of a run is a pair of panels:

* the upper panel stacks what the pool **booked** on the card, as the records
  carried it: the census co-tenant, the pool's own high-water, and the width
  times the ask the width was priced at; the card's total is a black line.
  What the card **held**, where it was read (a record's live used bytes, or
  a caller's samples), is a dark line with dots. An out-of-memory is a red
  cross at the bytes the card was asked for (used + refused) and a red line
  through both panels; a live-gate wait is an orange tick, a serial start a
  purple one. The axis is fitted to the card (a little over its total): a
  point above it is drawn at the top edge with its value written beside it.
* the lower panel is the width (tasks the pool admits at once) and the
  ceiling it may not pass (``max_workers``, CPUs, RAM), dashed.

matplotlib is imported on first use, through its object-oriented API with
the Agg canvas, so drawing never touches a user's pyplot state or display.
The format follows the output's suffix (``.png``, ``.svg``, ``.pdf``) or
``fmt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gpupool._core.units import GiB, format_size
from gpupool._errors import GpuPoolError

if TYPE_CHECKING:
    from gpupool._postmortem import DevicePlot, Postmortem

__all__ = ["FORMATS", "CardView", "PlotUnavailableError", "card_views", "write_plot"]

#: The formats :func:`write_plot` writes.
FORMATS = ("png", "svg", "pdf")

#: Inches per card (two panels) and per run column: legible at 100 dpi.
_CARD_HEIGHT_IN = 4.6
_COLUMN_WIDTH_IN = 7.0
_DPI = 100
#: How far over the card's total the memory axis reaches.
_HEADROOM = 1.12

_CO = "#9aa5b1"
_OWN = "#6c8ebf"
_BOOKED = "#82b366"
_USED = "#222222"
_OOM = "#d62728"
_WAIT = "#ff7f0e"
_SERIAL = "#9467bd"
_CEILING = "#b85450"


class PlotUnavailableError(GpuPoolError):
    """matplotlib is not installed (the ``plot`` extra), or the log has nothing to draw."""


@dataclass(slots=True, kw_only=True)
class CardView:
    """What the plot draws for one card in one run (times in seconds from the run's start).

    Attributes:
        title: the panel's title.
        total_bytes: the card's capacity.
        end_s: the run's last second.
        booked: ``(time_s, co_tenant_bytes, own_high_water_bytes, booked_bytes)``
            steps: what the pool had priced, held until the next point.
        used: ``(time_s, used_bytes)``: the card as read.
        used_label: what ``used`` is (a record's reading, a caller's samples).
        used_sampled: ``used`` is dense samples (drawn as a line), not a few
            readings (drawn as points, never joined).
        width: ``(time_s, width)`` steps.
        ceiling: ``(time_s, ceiling)`` steps.
        ooms: ``(time_s, bytes)``: where the card ran out (used + refused).
        waits: times of live-gate waits.
        serial: times of serial starts (a start past the bound).
        refused: times of refused widens.
    """

    title: str
    total_bytes: int
    end_s: float
    booked: list[tuple[float, int, int, int]] = field(default_factory=list)
    used: list[tuple[float, int]] = field(default_factory=list)
    used_label: str = "used (read by the pool)"
    used_sampled: bool = False
    width: list[tuple[float, int]] = field(default_factory=list)
    ceiling: list[tuple[float, int]] = field(default_factory=list)
    ooms: list[tuple[float, int]] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    serial: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)


def _require_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "drawing needs matplotlib: pip install 'gpupool[plot]' (or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def _card_view(pm: Postmortem, card: DevicePlot, runs: int) -> CardView | None:
    points = card.terms.points
    if not points:
        return None
    booked: list[tuple[float, int, int, int]] = []
    ceiling: list[tuple[float, int]] = []
    width_now = 1
    for time_s, _total, co, own, ask, width, ceil in points:
        width_now = int(width) if width >= 0 else width_now
        booked.append((time_s, int(co), int(own), int(ask) * width_now))
        if ceil >= 0:
            ceiling.append((time_s, int(ceil)))
    series = pm.device_widths.get(card.device)
    widths = [(t, int(w)) for t, w in series.points] if series is not None else []
    total = int(points[-1][1])
    run = f"run {pm.run_index} ({pm.run_id[:28]}): " if runs > 1 else ""
    ooms = len(card.ooms.points)
    return CardView(
        title=(
            f"{run}card {card.device}, {format_size(total)}; "
            f"{ooms} out-of-memory, {len(card.gate_waits.points)} live-gate waits"
        ),
        total_bytes=total,
        end_s=max(pm.duration_s, 1e-3),
        booked=booked,
        used=[(p[0], int(p[1])) for p in card.live_used.points],
        width=widths,
        ceiling=ceiling,
        ooms=[(p[0], int(p[1])) for p in card.ooms.points],
        waits=[p[0] for p in card.gate_waits.points],
        serial=[p[0] for p in card.serial.points],
        refused=[p[0] for p in card.refused.points],
    )


def card_views(runs: Postmortem | Sequence[Postmortem]) -> list[list[CardView]]:
    """One column per run, one :class:`CardView` per card that a record priced."""
    runs = [runs] if not isinstance(runs, Sequence) else list(runs)
    columns = []
    for pm in runs:
        column = [
            view
            for _, card in sorted(pm.devices.items())
            if (view := _card_view(pm, card, len(runs))) is not None
        ]
        if column:
            columns.append(column)
    return columns


def write_plot(
    runs: Postmortem | Sequence[Postmortem],
    output: str | Path | IO[bytes],
    *,
    fmt: str | None = None,
    columns: Sequence[Sequence[CardView]] | None = None,
    title: str | None = None,
) -> None:
    """Draw every run of a log (a column each), every card of a run (two panels each).

    Args:
        runs: the postmortem of each run to draw (``read_runs``).
        output: the file to write, or a binary stream.
        fmt: ``"png"``, ``"svg"`` or ``"pdf"``; default: the output's suffix
            (``png`` for a stream).
        columns: further columns to draw beside the runs (the demo's fixed
            pool, drawn from its own readings).
        title: the figure's title (default: the log's name).

    Raises:
        PlotUnavailableError: matplotlib is missing, or no record carries a
            card's terms (a host-only pool has no memory to draw).
        ValueError: ``fmt`` (or the suffix) is not one of :data:`FORMATS`.
        OSError: the file cannot be written.
    """
    if fmt is None:
        suffix = Path(output).suffix.lower().lstrip(".") if isinstance(output, (str, Path)) else ""
        fmt = suffix or "png"
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: pass one of {', '.join(FORMATS)}")
    figure = plot_figure(runs, columns=columns, title=title)
    figure.savefig(output, format=fmt)


def plot_figure(
    runs: Postmortem | Sequence[Postmortem],
    *,
    columns: Sequence[Sequence[CardView]] | None = None,
    title: str | None = None,
) -> Any:
    """The figure :func:`write_plot` saves (a matplotlib ``Figure`` on the Agg canvas)."""
    figure_cls, canvas_cls = _require_matplotlib()
    grid_views = card_views(runs) + [list(c) for c in columns or () if c]
    pms = [runs] if not isinstance(runs, Sequence) else list(runs)
    if not grid_views:
        name = pms[0].path if pms else "the log"
        raise PlotUnavailableError(
            f"{name}: no record carries a card's memory terms (a pool without a device "
            "has nothing to draw); see gpupool postmortem for the run"
        )
    rows = max(len(c) for c in grid_views)
    figure = figure_cls(
        figsize=(_COLUMN_WIDTH_IN * len(grid_views), _CARD_HEIGHT_IN * rows + 0.9), dpi=_DPI
    )
    canvas_cls(figure)
    grid = figure.add_gridspec(2 * rows, len(grid_views), height_ratios=[3, 1.2] * rows)
    handles: dict[str, Any] = {}
    for col, views in enumerate(grid_views):
        for row, view in enumerate(views):
            memory = figure.add_subplot(grid[2 * row, col])
            width = figure.add_subplot(grid[2 * row + 1, col], sharex=memory)
            _draw(memory, width, view)
            for ax in (memory, width):
                for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                    handles.setdefault(label, handle)
    figure.suptitle(
        title or (f"gpupool run: {Path(pms[0].path).name}" if pms else "gpupool"), fontsize=12
    )
    figure.legend(
        list(handles.values()),
        list(handles.keys()),
        loc="lower center",
        ncol=min(2 + len(grid_views), len(handles)),
        fontsize=8,
        frameon=False,
    )
    legend_rows = -(-len(handles) // min(2 + len(grid_views), max(1, len(handles))))
    figure.tight_layout(rect=(0, 0.035 * legend_rows * 4.6 / (_CARD_HEIGHT_IN * rows), 1, 0.96))
    return figure


def _steps(points: Sequence[tuple[Any, ...]], end: float) -> tuple[list[float], list[Any]]:
    """Times and values of a step function that holds each point until ``end``."""
    times = [float(p[0]) for p in points] + [max(end, float(points[-1][0]))]
    values = [p[1:] for p in points]
    values.append(values[-1])
    return times, values


def _draw(memory: Any, width_ax: Any, view: CardView) -> None:
    total_gib = view.total_bytes / GiB
    top = total_gib * _HEADROOM
    end = view.end_s
    if view.booked:
        times, values = _steps(view.booked, end)
        co = [v[0] / GiB for v in values]
        own = [(v[0] + v[1]) / GiB for v in values]
        booked = [(v[0] + v[1] + v[2]) / GiB for v in values]
        memory.fill_between(times, 0, co, step="post", color=_CO, label="co-tenant (census)")
        memory.fill_between(times, co, own, step="post", color=_OWN, label="own high-water")
        memory.fill_between(
            times, own, booked, step="post", color=_BOOKED, alpha=0.8, label="booked: width x ask"
        )
        last = view.booked[-1]
        memory.annotate(
            f"booked {format_size(last[1] + last[2] + last[3])}",
            (times[-1], min(booked[-1], top)),
            xytext=(-4, -12),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="#2d6a2d",
        )
    memory.axhline(total_gib, color="black", linewidth=2, label="card total")
    if view.used:
        memory.plot(
            [p[0] for p in view.used],
            [min(p[1] / GiB, top) for p in view.used],
            # Dense samples are a line; a few readings are only points (no interpolation).
            "-" if view.used_sampled else "o",
            color=_USED,
            linewidth=1,
            markersize=3,
            label=view.used_label,
        )
    for time_s, _ in view.ooms:
        for ax in (memory, width_ax):
            ax.axvline(time_s, color=_OOM, linewidth=0.8, alpha=0.5)
    if view.ooms:
        memory.plot(
            [p[0] for p in view.ooms],
            [min(p[1] / GiB, top * 0.98) for p in view.ooms],
            "X",
            color=_OOM,
            markersize=9,
            label="out of memory (used + refused)",
        )
        high = max(view.ooms, key=lambda p: p[1])
        if high[1] / GiB > top:
            memory.annotate(
                f"asked {format_size(high[1])}",
                (high[0], top * 0.98),
                xytext=(6, -4),
                textcoords="offset points",
                fontsize=8,
                color=_OOM,
            )
    for times_s, color, label in (
        (view.waits, _WAIT, "live-gate wait"),
        (view.serial, _SERIAL, "serial start (past the bound)"),
        (view.refused, "#888888", "widen refused"),
    ):
        if times_s:
            width_ax.plot(
                times_s, [0.25] * len(times_s), "|", color=color, markersize=14, label=label
            )
    memory.set_ylim(0, top)
    memory.set_xlim(0, end)
    memory.set_ylabel("GiB on the card")
    memory.set_title(view.title, fontsize=10)
    memory.grid(axis="y", alpha=0.3)
    memory.tick_params(labelbottom=False)

    if view.width:
        w_times, w_values = _steps(view.width, end)
        width_ax.step(
            w_times,
            [v[0] for v in w_values],
            where="post",
            color="#2d6a2d",
            linewidth=2,
            label="width (tasks at once)",
        )
    if view.ceiling:
        c_times, c_values = _steps(view.ceiling, end)
        width_ax.step(
            c_times,
            [v[0] for v in c_values],
            where="post",
            color=_CEILING,
            linestyle="--",
            label="ceiling (max_workers, CPUs, RAM)",
        )
    highest = max([1, *(w for _, w in view.width), *(c for _, c in view.ceiling)])
    width_ax.set_ylim(0, highest + 1)
    width_ax.set_ylabel("tasks")
    width_ax.set_xlabel("seconds since the pool started")
    width_ax.grid(axis="y", alpha=0.3)
    width_ax.yaxis.get_major_locator().set_params(integer=True)
