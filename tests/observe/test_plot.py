"""``gpupool plot`` draws the card as it was: readings, bookings by key, limits, reasons."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from gpupool import GpuPoolExecutor
from gpupool._core.units import GiB
from gpupool._observe.postmortem import read_postmortem, read_runs
from gpupool.testing import SimulatedDevice, SimulatedHost

pytest.importorskip("matplotlib")

from gpupool._commands.demo import demo_columns
from gpupool._observe.plot import CardView, card_views, plot_figure, write_plot


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _axes(figure: Any, label: str) -> Any:
    found = [ax for ax in figure.axes if ax.get_label() == label]
    assert len(found) == 1, [ax.get_label() for ax in figure.axes]
    return found[0]


def test_a_co_tenant_that_grew_mid_run_is_drawn_growing(logs: dict[str, Path]) -> None:
    """The serving co-tenant grows 6 GiB while tasks run: the census said 9.54 GiB, the
    readings say 15.54 GiB; the co-tenant drawn follows the readings, not the census."""
    census = 9.54 * GiB
    pm = read_postmortem(logs["co_tenant"])
    series = [p[2] for p in pm.devices[0].reads.points]  # (time_s, used, co_tenant, ...)
    assert series[0] == pytest.approx(census, rel=0.01)
    assert max(series) == pytest.approx(census + 6 * GiB, rel=0.01)
    (view,) = card_views(pm)[0]
    co_tenant = [p[2] for p in view.reads]
    assert co_tenant[0] == pytest.approx(census, rel=0.01)
    assert max(co_tenant) == pytest.approx(census + 6 * GiB, rel=0.01)
    # The measured used line is drawn from the same readings.
    assert max(p[1] for p in view.used) >= census + 6 * GiB + 16 * GiB


def test_the_bookings_are_stacked_by_key(logs: dict[str, Path]) -> None:
    """Each running task's booking is drawn under its key's name, from the samples' tables."""
    (view,) = card_views(read_postmortem(logs["co_tenant"]))[0]
    assert view.key_names == ["observe_tasks.staged"]
    assert max(p[1][0] for p in view.keys if p[1]) == 2 * 6.5 * GiB  # two running at 6.50 GiB each


def _titles(svg: Path) -> list[str]:
    root = ET.parse(svg).getroot()
    return [el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}title")]


def test_an_svg_names_each_out_of_memory_and_refused_widen_on_hover(
    logs: dict[str, Path], tmp_path: Path
) -> None:
    """Every out-of-memory and refused widen is a marker whose SVG ``<title>`` is its reason."""
    wanted = 0
    for name in ("ask", "incident"):
        svg = tmp_path / f"{name}.svg"
        write_plot(read_runs(logs[name]), svg)
        titles = _titles(svg)
        for record in _records(logs[name]):
            if record["event"] in ("out_of_memory", "widen_refused"):
                wanted += 1
                assert any(record["reason"] in title for title in titles), record["reason"]
    assert wanted >= 2


LIMIT = "this card's limit (tasks its room holds)"


def test_each_card_shows_its_own_limit_and_the_pool_its_ceiling(logs: dict[str, Path]) -> None:
    """Two cards of 24 GiB (4 GiB co-tenant) and 12 GiB at 5 GiB a task: each card's panel
    draws its own limit, the tasks its room holds as its records state them (on a discrete
    card, room over ask); the pool-wide ceiling of 8 is drawn once, for the pool."""
    records = _records(logs["two_cards"])
    runs = read_runs(logs["two_cards"])
    figure = plot_figure(runs)
    fits: dict[int, set[int]] = {0: set(), 1: set()}
    for record in records:
        if record.get("room_bytes") is not None and record.get("device") is not None:
            assert record["tasks_fit"] == max(0, record["room_bytes"] // record["ask_bytes"])
            fits[record["device"]].add(record["tasks_fit"])
    assert fits[0] != fits[1]
    for device in (0, 1):
        view = card_views(runs)[0][device]
        assert view.ceiling == []
        assert {int(p[1]) for p in view.limit} == fits[device]
        ax = _axes(figure, f"width: card {device}")
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines[LIMIT].get_ydata()) == fits[device]
        assert all(max(line.get_ydata(), default=0) < 8 for line in lines.values())
    pool = _axes(figure, "pool")
    lines = {line.get_label(): line for line in pool.get_lines()}
    assert set(lines["pool-wide ceiling (max_workers, CPUs, RAM)"].get_ydata()) == {8}


def test_the_demo_panels_share_one_time_axis(logs: dict[str, Path]) -> None:
    """The pool's run and the fixed pool's are drawn on one time axis, however long each ran."""
    pm = read_postmortem(logs["incident"])
    fixed = CardView(
        title="fixed pool",
        total_bytes=int(44.39 * GiB),
        end_s=pm.duration_s / 3,
        used=[(0.0, 26 * GiB), (pm.duration_s / 3, 40 * GiB)],
        used_sampled=True,
        width=[(0.0, 4)],
    )
    figure = plot_figure([], columns=demo_columns(logs["incident"], beside=fixed))
    ranges = {tuple(ax.get_xlim()) for ax in figure.axes if ax.get_visible()}
    assert len(ranges) == 1, ranges
    ((low, high),) = ranges
    assert low == 0 and high >= pm.duration_s


def test_a_reading_without_rows_draws_the_census_co_tenant(
    logs: dict[str, Path], tmp_path: Path
) -> None:
    """Where a sample could not split the card (no process rows: its co-tenant and parent
    are null), the co-tenant drawn is the census's and the parent its own high-water."""
    path = tmp_path / "no_rows.jsonl"
    lines = []
    for record in _records(logs["co_tenant"]):
        if record["event"] == "card_read":
            record["live_co_tenant_bytes"] = record["live_own_bytes"] = None
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    census = next(r for r in _records(path) if r["event"] == "constructed")
    (view,) = card_views(read_postmortem(path))[0]
    read = [p for p in view.reads if p[0] not in {r[0] for r in view.marks["out_of_memory"]}]
    assert read
    assert {p[2] for p in read} == {census["co_tenant_bytes"]}
    assert {p[3] for p in read} == {census["own_high_water_bytes"]}


def test_a_log_of_samples_alone_draws_the_card_as_read(
    logs: dict[str, Path], tmp_path: Path
) -> None:
    """The tail of a long log (``tail -n``, a rotated file) can hold only ``card_read``
    samples: no record priced the bound, but each sample read the card. The plot draws
    them on the card's total, not refuse the log as a pool with no device."""
    tail = tmp_path / "tail.jsonl"
    tail.write_text(
        "".join(
            json.dumps(r) + "\n" for r in _records(logs["co_tenant"]) if r["event"] == "card_read"
        )
    )
    (view,) = card_views(read_postmortem(tail))[0]
    assert view.total_bytes == int(44.39 * GiB)
    assert view.priced == [] and view.reads and view.keys
    assert max(p[2] for p in view.reads) >= int(15.5 * GiB)  # the co-tenant, grown
    out = tmp_path / "tail.png"
    write_plot(read_runs(tail), out)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_on_unified_memory_the_limit_drawn_is_the_planners_count(tmp_path: Path) -> None:
    """On a unified card (GB10, Jetson) each task is priced at its ask plus its child's RSS:
    16 GiB at 3 GiB + 1 GiB holds 4, not the 5 that room over ask would say. The plot's
    limit is the count the record states, which is the planner's width and its bound's."""
    log = tmp_path / "unified.jsonl"
    host = SimulatedHost([SimulatedDevice("16GiB", unified=True)], cpus=16, host_ram="16GiB")
    with host, GpuPoolExecutor(max_workers=8, task_peak="3GiB", reserve=0, log_path=log) as ex:
        constructed = ex.decisions[0]
    assert constructed.bound is not None
    assert constructed.bound.host_per_task_bytes == GiB
    assert (constructed.width_after, constructed.bound.tasks_fit) == (4, 4)
    (record,) = [r for r in _records(log) if r["event"] == "constructed"]
    assert (record["tasks_fit"], record["host_per_task_bytes"]) == (4, GiB)
    assert record["room_bytes"] // record["ask_bytes"] == 5  # what the plot drew before
    runs = read_runs(log)
    (view,) = card_views(runs)[0]
    assert {p[1] for p in view.limit} == {4}
    lines = {line.get_label(): line for line in _axes(plot_figure(runs), "width: card 0").lines}
    assert set(lines[LIMIT].get_ydata()) == {4}


def test_a_log_written_before_tasks_fit_draws_no_limit(
    logs: dict[str, Path], tmp_path: Path
) -> None:
    """Records without ``tasks_fit`` (written before it) draw no limit line: the reader does
    not work out again what the planner counted (on unified memory it would draw more); an
    out-of-memory's cap they state is still drawn."""
    old = tmp_path / "old.jsonl"
    lines = []
    for record in _records(logs["co_tenant"]):
        record.pop("tasks_fit", None)
        lines.append(json.dumps(record))
    old.write_text("\n".join(lines) + "\n")
    runs = read_runs(old)
    (view,) = card_views(runs)[0]
    assert view.limit
    assert {p[1] for p in view.limit} == {-1}
    assert any(p[2] >= 0 for p in view.limit)
    drawn = {line.get_label() for line in _axes(plot_figure(runs), "width: card 0").lines}
    assert LIMIT not in drawn
    assert "this card's cap after an out-of-memory" in drawn
