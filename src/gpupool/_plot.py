"""Draw a decision log: per card, the memory terms and the width over time (optional extra).

A reader of :class:`gpupool._postmortem.Postmortem`, never of the pool. For
each card, the upper panel stacks the terms the width was priced from, as
the records carried them: the census co-tenant, the pool's own high-water,
and the width times the ask (what the admitted tasks may hold), under the
card's total. A dashed line shows what the ceiling's width (``max_workers``,
CPUs, RAM) would have needed at the same ask: where it crosses the total, a
fixed-width pool would have run the card out. Live used bytes are dots where
a record read the card; an out-of-memory is a red cross at the bytes the
card was asked for (live used plus the refused allocation) with a red line
through both panels; a refused widen is an orange line. The lower panel is
the width, with the ceiling dashed.

matplotlib is imported on first use, through its object-oriented API with
the Agg canvas, so drawing never touches a user's pyplot state or display.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool._core.units import GiB, format_size
from gpupool._errors import GpuPoolError

if TYPE_CHECKING:
    from gpupool._postmortem import DevicePlot, Postmortem

__all__ = ["PlotUnavailableError", "write_plot"]

#: Inches per card panel pair: a card's two panels stay legible at 100 dpi.
_CARD_HEIGHT_IN = 5.5
_WIDTH_IN = 11.0
_DPI = 100


class PlotUnavailableError(GpuPoolError):
    """matplotlib is not installed (the ``plot`` extra), or the log has nothing to draw."""


def _require_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "drawing needs matplotlib: pip install 'gpupool[plot]' (or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def write_plot(pm: Postmortem, output: str | Path) -> Path:
    """Draw every card of a postmortem into one PNG.

    Args:
        pm: the postmortem of a decision log.
        output: the PNG to write.

    Returns:
        The path written.

    Raises:
        PlotUnavailableError: matplotlib is missing, or no record carries a
            card's terms (a host-only pool has no memory to draw).
        OSError: the file cannot be written.
    """
    figure_cls, canvas_cls = _require_matplotlib()
    cards = [plot for _, plot in sorted(pm.devices.items()) if plot.terms.points]
    if not cards:
        raise PlotUnavailableError(
            f"{pm.path}: no record carries a card's memory terms (a pool without a device "
            "has nothing to draw); see gpupool postmortem for the run"
        )
    figure = figure_cls(figsize=(_WIDTH_IN, _CARD_HEIGHT_IN * len(cards)), dpi=_DPI)
    canvas_cls(figure)
    grid = figure.add_gridspec(2 * len(cards), 1, height_ratios=[3, 1] * len(cards))
    end = max(pm.duration_s, 1e-3)
    for index, card in enumerate(cards):
        memory = figure.add_subplot(grid[2 * index])
        width = figure.add_subplot(grid[2 * index + 1], sharex=memory)
        _draw_card(memory, width, card, end, pm)
    figure.suptitle(f"gpupool run: {Path(pm.path).name}", fontsize=12)
    figure.tight_layout()
    path = Path(output)
    figure.savefig(path, format="png")
    return path


def _steps(
    points: list[tuple[float, ...]], end: float
) -> tuple[list[float], list[tuple[float, ...]]]:
    """Times and values of a step function that holds each point until the next, up to ``end``."""
    times = [p[0] for p in points] + [max(end, points[-1][0])]
    values = [p[1:] for p in points]
    values.append(values[-1])
    return times, values


def _draw_card(memory: Any, width_ax: Any, card: DevicePlot, end: float, pm: Postmortem) -> None:
    points = card.terms.points
    width_now = 1
    ceiling_now = 1
    filled: list[tuple[float, ...]] = []
    for time_s, total_b, co_b, own_b, ask_b, width_b, ceiling_b in points:
        width_now = int(width_b) if width_b >= 0 else width_now
        ceiling_now = int(ceiling_b) if ceiling_b >= 0 else ceiling_now
        filled.append((time_s, total_b, co_b, own_b, ask_b, width_now, ceiling_now))
    times, values = _steps(filled, end)
    total = [v[0] / GiB for v in values]
    co = [v[1] / GiB for v in values]
    own = [(v[1] + v[2]) / GiB for v in values]
    priced = [(v[1] + v[2] + v[4] * v[3]) / GiB for v in values]
    at_ceiling = [(v[1] + v[2] + v[5] * v[3]) / GiB for v in values]
    zero = [0.0] * len(times)
    memory.fill_between(times, zero, co, step="post", color="#9aa5b1", label="co-tenant (census)")
    memory.fill_between(times, co, own, step="post", color="#6c8ebf", label="own high-water")
    memory.fill_between(
        times, own, priced, step="post", color="#82b366", alpha=0.8, label="width x ask (booked)"
    )
    memory.step(times, total, where="post", color="black", linewidth=2, label="card total")
    memory.step(
        times,
        at_ceiling,
        where="post",
        color="#b85450",
        linestyle="--",
        linewidth=1.2,
        label="ceiling's width x ask (what a fixed pool would book)",
    )
    if card.live_used.points:
        memory.plot(
            [p[0] for p in card.live_used.points],
            [p[1] / GiB for p in card.live_used.points],
            "o",
            color="#333333",
            markersize=4,
            label="live used (read)",
        )
    if card.booked.points:
        base = co[0] + (own[0] - co[0])
        memory.plot(
            [p[0] for p in card.booked.points],
            [base + p[1] / GiB for p in card.booked.points],
            "^",
            color="#2d6a2d",
            markersize=7,
            label="booked asks at an out-of-memory",
        )
    for time_s, _ in card.ooms.points:
        for ax in (memory, width_ax):
            ax.axvline(time_s, color="red", linewidth=1, alpha=0.6)
    if card.ooms.points:
        memory.plot(
            [p[0] for p in card.ooms.points],
            [p[1] / GiB for p in card.ooms.points],
            "X",
            color="red",
            markersize=10,
            label="out of memory (used + refused)",
        )
    for time_s, _ in card.refused.points:
        for ax in (memory, width_ax):
            ax.axvline(time_s, color="orange", linestyle=":", linewidth=1.5)
    if card.refused.points:
        width_ax.plot(
            [p[0] for p in card.refused.points],
            [p[1] for p in card.refused.points],
            "D",
            color="orange",
            label="widen refused",
        )
    memory.annotate(
        f"{int(values[-1][5])} x ask: {at_ceiling[-1]:.2f} GiB",
        (times[-1], at_ceiling[-1]),
        xytext=(-4, 4),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="#b85450",
    )
    memory.annotate(
        f"{int(values[-1][4])} x ask: {priced[-1]:.2f} GiB",
        (times[-1], priced[-1]),
        xytext=(-4, 4),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="#2d6a2d",
    )
    top = max([*total, *at_ceiling, *(p[1] / GiB for p in card.ooms.points)])
    memory.set_ylim(0, top * 1.08)
    memory.set_ylabel("GiB")
    last = filled[-1]
    memory.set_title(
        f"card {card.device}: {format_size(int(last[1]))} total; "
        f"{pm.events.get('out_of_memory', 0)} out-of-memory in the run",
        fontsize=10,
    )
    memory.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    memory.grid(axis="y", alpha=0.3)

    series = pm.device_widths.get(card.device)
    width_points: list[tuple[float, ...]] = (
        series.points if series is not None and series.points else [(0.0, 1.0)]
    )
    w_times, w_values = _steps(width_points, end)
    width_ax.step(
        w_times,
        [v[0] for v in w_values],
        where="post",
        color="#2d6a2d",
        linewidth=2,
        label="width",
    )
    width_ax.step(
        times,
        [v[5] for v in values],
        where="post",
        color="#b85450",
        linestyle="--",
        label="ceiling",
    )
    width_ax.set_ylim(0, max([*(v[5] for v in values), *(v[0] for v in w_values)]) + 1)
    width_ax.set_ylabel("tasks at once")
    width_ax.set_xlabel("seconds since the pool was constructed")
    width_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    width_ax.grid(axis="y", alpha=0.3)
    width_ax.yaxis.get_major_locator().set_params(integer=True)
