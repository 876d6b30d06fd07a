"""The account drawn as the pool priced: the plot's priced line and width panel, and the
postmortem's figures, read against the records of real runs on the simulated host.

Two runs: a key whose tasks are priced together (a learned margin over varying peaks)
that then runs its card out; and a co-tenant spike that caps a card, whose cap lifts once
the spike is over.
"""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import observe_tasks
import pytest

from gpupool import GpuPoolExecutor
from gpupool._core.units import format_size
from gpupool._observe.postmortem import format_postmortem, read_postmortem
from gpupool.testing import SimulatedDevice, SimulatedHost

pytest.importorskip("matplotlib")

from gpupool._observe.plot import card_views, plot_figure, write_plot

#: Seconds a run's step may take before the test says which step never came.
WAIT_S = 60.0


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S} s"
        time.sleep(0.01)


def _logged(log: Path, event: str) -> bool:
    return any(r["event"] == event for r in _records(log))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two runs' decision logs."""
    root = tmp_path_factory.mktemp("priced")
    out: dict[str, Path] = {}

    # A 24 GiB card beside a 3 GiB co-tenant. Nine tasks of one key hold 5 to 6 GiB: the
    # key learns a margin and its tasks are priced together: three for 20.71 GiB where
    # 3 x 7 GiB would pass the 20.75 GiB room. Then three hold 8 GiB each, started together:
    # the card runs out with tasks booked at their shares of the pooled price.
    pooled = root / "pooled.jsonl"
    gate = root / "pooled.gate"
    gate.mkdir()
    sizes = [f"{5 + (i % 5) * 0.25:.2f}GiB" for i in range(9)]
    with SimulatedHost(
        [SimulatedDevice("24GiB", co_tenants={"serve": "3GiB"})], cpus=8, host_ram="64GiB"
    ):
        with GpuPoolExecutor(max_workers=3, task_peak="7GiB", log_path=pooled) as pool:
            step = pool.options(key="step")
            list(step.map(observe_tasks.entry, range(9), sizes, [0.05] * 9))
            big = [
                step.submit(observe_tasks.entry_together, i, str(gate), 3, "8GiB")
                for i in (9, 10, 11)
            ]
            assert [f.result(timeout=WAIT_S) for f in big] == [9, 10, 11]
    out["pooled"] = pooled

    # A 36 GiB card beside a 1 GiB co-tenant, five tasks at 5 GiB. While all five hold their
    # first 2 GiB the co-tenant grows 16 GiB: their second steps run the card out, and the
    # out-of-memory caps narrow the card. The spike ends; five more tasks hold 4 GiB until
    # the cap has lifted.
    spike = root / "spike.jsonl"
    first_gate, later_gate = root / "spike.gate", root / "later.gate"
    first_gate.mkdir()
    later_gate.mkdir()
    with SimulatedHost(
        [SimulatedDevice("36GiB", co_tenants={"batch": "1GiB"})], cpus=8, host_ram="64GiB"
    ) as host:
        with GpuPoolExecutor(max_workers=5, task_peak="5GiB", log_path=spike) as pool:
            first = [
                pool.submit(observe_tasks.staged, i, "2GiB", "2.5GiB", str(first_gate))
                for i in range(5)
            ]
            _wait(lambda: len(list(first_gate.glob("ready-*"))) == 5, "five first steps")
            host.grow("batch", "16GiB")
            (first_gate / "go").touch()
            _wait(lambda: pool.statistics().out_of_memory >= 1, "the spike's out-of-memory")
            host.shrink("batch", "16GiB")
            assert [f.result(timeout=WAIT_S) for f in first] == list(range(5))
            later = [
                pool.submit(observe_tasks.hold_until, i, "4GiB", str(later_gate)) for i in range(5)
            ]
            try:
                _wait(lambda: _logged(spike, "cap_lifted"), "the cap's lift")
            finally:
                (later_gate / "release").touch()
            assert [f.result(timeout=WAIT_S) for f in later] == list(range(5))
    out["spike"] = spike
    return out


def test_the_priced_line_is_the_pooled_price_the_bound_stated(runs: dict[str, Path]) -> None:
    """Where a record prices the width's tasks together ("X for the K together", K the
    width), the dotted line is co-tenant + other pools + own high-water + X: the price the
    bound checked against the room, never width x ask, which reads as an overbooked card.
    Several records may share one instant (the line steps through each there): the record's
    point is one of that instant's (before: the last of them was taken for it, and where
    another record of that instant priced its width apart, the test failed under load)."""
    (view,) = card_views(read_postmortem(runs["pooled"]))[0]
    drawn: dict[float, list[tuple[int, int, int, int]]] = {}
    for time_s, co, own, others, price in view.priced:
        drawn.setdefault(time_s, []).append((co, own, others, price))
    checked = below_width_x_ask = 0
    for record in _records(runs["pooled"]):
        if record.get("together_tasks") is None or record["event"] == "out_of_memory":
            continue
        if record["together_tasks"] != record["width_after"]:
            continue
        stated = (
            record["co_tenant_bytes"],
            record["own_high_water_bytes"],
            record["other_pools_bytes"],
            record["together_bytes"],
        )
        assert stated in drawn[record["time_s"]], (record["reason"], drawn[record["time_s"]])
        price = record["together_bytes"]
        checked += 1
        below_width_x_ask += price < record["width_after"] * record["ask_bytes"]
    assert checked >= 1 and below_width_x_ask >= 1
    # No point of the line is over the card where the bound priced the tasks within its room.
    for record in _records(runs["pooled"]):
        if (
            record.get("together_tasks") is not None
            and record["together_tasks"] == record["width_after"]
            and record["event"] != "out_of_memory"
        ):
            line = (
                record["co_tenant_bytes"]
                + record["own_high_water_bytes"]
                + record["other_pools_bytes"]
                + record["together_bytes"]
            )
            assert line <= record["total_bytes"] - record["reserve_bytes"]


def test_the_width_panel_and_the_postmortem_show_a_lifted_cap(runs: dict[str, Path]) -> None:
    """A ``cap_lifted`` record widens the card (3 -> 5 here): the width panel and the
    postmortem's "widths over time" step up at its time, to its width."""
    lifted = [r for r in _records(runs["spike"]) if r["event"] == "cap_lifted"]
    assert lifted
    pm = read_postmortem(runs["spike"])
    (view,) = card_views(pm)[0]
    text = "\n".join(format_postmortem(pm))
    widths = re.search(r"^widths over time: (.*)$", text, re.M)
    assert widths is not None
    for record in lifted:
        assert (record["time_s"], record["width_after"]) in view.width
        assert f"{record['width_after']} at {record['time_s']:.2f} s" in widths.group(1)
        assert (
            f"card 0 at {record['time_s']:.2f} s (width {record['width_before']} -> "
            f"{record['width_after']})" in text
        )
    assert view.width[-1][1] == lifted[-1]["width_after"]


def _oom_sections(text: str) -> list[str]:
    return re.split(r"^out of memory #\d+ ", text, flags=re.M)[1:]


def test_the_postmortem_prints_each_booking_as_the_record_states_it(
    runs: dict[str, Path],
) -> None:
    """The bookings of a key priced together differ task by task: the postmortem prints each
    as the record's ``runs`` table states it, and the failing task's booking beside its ask
    (never an average, "2 x 5.99 GiB", that no record states)."""
    text = "\n".join(format_postmortem(read_postmortem(runs["pooled"])))
    ooms = [r for r in _records(runs["pooled"]) if r["event"] == "out_of_memory"]
    assert ooms
    sections = _oom_sections(text)
    assert len(sections) == len(ooms)
    differing = 0
    for record, section in zip(ooms, sections, strict=True):
        stated = {format_size(row["booked_bytes"]) for row in record["runs"]}
        stated.add(format_size(record["booked_bytes"]))
        stated.add(format_size(sum(row["booked_bytes"] for row in record["runs"])))
        (line,) = [x for x in section.splitlines() if x.startswith("    ") and " x step: " in x]
        printed = set(re.findall(r"\d+\.\d\d [KMG]iB|\d+ B", line))
        assert printed <= stated, (line, record["runs"])
        failing = next(x for x in section.splitlines() if "failing task's ask" in x)
        assert format_size(record["task_ask_bytes"]) in failing
        if record["task_booked_bytes"] != record["task_ask_bytes"]:
            assert f"booked {format_size(record['task_booked_bytes'])} at its start" in failing
        differing += len({row["booked_bytes"] for row in record["runs"]}) > 1
    assert differing >= 1  # the case that printed an average


def _legend_texts(figure: Any) -> list[str]:
    return [t.get_text() for legend in figure.legends for t in legend.get_texts()]


def test_a_png_legend_promises_no_hover_and_an_svg_keeps_it(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A PNG cannot show a reason on hover: its legend says where the reasons are. An SVG
    shows them on hover, and its legend says so."""
    pm = read_postmortem(runs["spike"])
    png = _legend_texts(plot_figure(pm))
    assert not any("hover" in label for label in png), png
    assert any(label.endswith("(why: postmortem)") for label in png)
    svg = tmp_path / "spike.svg"
    write_plot(pm, svg)
    root = ET.parse(svg).getroot()
    texts = " ".join(el.text or "" for el in root.iter() if el.text)
    assert "(reason on hover)" in texts or "reason on hover" in svg.read_text()
