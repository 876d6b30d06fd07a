"""``gpupool plot`` writes a real PNG; ``track`` passes results through; the demo compares."""

from __future__ import annotations

import io
import re
import struct
from concurrent.futures import Future
from pathlib import Path

import pytest
from progress_pool import FakeAsk, FakePool, FakeStats

from gpupool._commands.cli import EXIT_BAD_LOG, main
from gpupool._observe.progress import describe_asks, progress_enabled, track

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("name", ["incident", "ask"])
def test_plot_is_a_png(
    logs: dict[str, Path], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plot is a PNG of a sensible size (IHDR), for a clean run and one with OOMs."""
    pytest.importorskip("matplotlib")
    out = tmp_path / f"{name}.png"
    assert main(["plot", str(logs[name]), "-o", str(out)]) == 0
    width, height = _png_size(out)
    assert 600 <= width <= 3000
    assert 300 <= height <= 3000
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_of_a_bad_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A corrupt log gets the postmortem's message and exit 2 from plot too, and no file."""
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\n")
    out = tmp_path / "bad.png"
    assert main(["plot", str(path), "-o", str(out)]) == EXIT_BAD_LOG
    assert "line 1" in capsys.readouterr().err
    assert not out.exists()


def test_track_passes_results_through_when_off() -> None:
    """Disabled, the bar yields every result unchanged and in order."""
    assert list(track(iter(range(5)), total=5, executor=FakePool(), enabled=False)) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_track_auto_is_off_without_a_terminal() -> None:
    """Automatic mode is off when the stream is not a terminal, on when forced."""
    assert progress_enabled(None, io.StringIO()) is False
    assert progress_enabled(True, io.StringIO()) is True


def test_track_shows_width_and_ask(capsys: pytest.CaptureFixture[str]) -> None:
    """Forced on, the tqdm bar on stderr carries the count, the width and the key's ask."""
    pytest.importorskip("tqdm")
    assert list(track(range(3), total=3, executor=FakePool(), enabled=True)) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "3/3" in err
    assert "failed 0, width 2, ask 6.94 GiB measured" in err
    assert describe_asks(FakePool().statistics().asks) == "ask 6.94 GiB measured"


def test_track_counts_failed_futures(capsys: pytest.CaptureFixture[str]) -> None:
    """Over futures (as_completed), the bar counts the ones that failed, not only the done."""
    pytest.importorskip("tqdm")
    futures: list[Future[int]] = []
    for i in range(4):
        future: Future[int] = Future()
        if i % 2:
            future.set_exception(RuntimeError("boom"))
        else:
            future.set_result(i)
        futures.append(future)
    assert list(track(iter(futures), total=4, enabled=True)) == futures
    assert "failed 2" in capsys.readouterr().err


def test_track_fits_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    """With many keys and long names, every line of the bar stays within 80 columns."""
    pytest.importorskip("tqdm")

    class _Many(FakePool):
        def statistics(self) -> FakeStats:
            return FakeStats(
                {
                    f"package.module.a_long_task_name_{i}": FakeAsk(i * 2**30, "measured")
                    for i in range(9)
                }
            )

    list(track(range(50), total=50, executor=_Many(), enabled=True))
    err = capsys.readouterr().err
    lines = [line for chunk in err.split("\r") for line in chunk.splitlines() if line.strip()]
    assert lines
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "|" in lines[-1] and "50/50" in lines[-1]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo runs the incident both ways: the stdlib runs out N > 0 times, gpupool 0."""
    log = tmp_path / "demo.jsonl"
    plot = tmp_path / "demo.png"
    status = main(["demo", "--simulate", "--log", str(log), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert status == 0, out
    match = re.search(
        r"^comparison: the same 36 tasks ran the card out of memory\n"
        r"  (\d+) times under a fixed pool of 4, (\d+) under gpupool\.$",
        out,
        re.MULTILINE,
    )
    assert match is not None, out
    assert int(match.group(1)) > 0
    assert int(match.group(2)) == 0
    assert "36 completed, 0 failed" in out
    assert "'The demo, explained': gpupool docs demo" in out
    short = [line for line in out.splitlines() if str(tmp_path) not in line]
    assert max(len(line) for line in short) <= 80, out
    assert main(["postmortem", str(log)]) == 0
    assert "tasks lost: none" in capsys.readouterr().out
    if plot.exists():
        width, _height = _png_size(plot)
        assert width >= 1200  # two columns: gpupool's run and the fixed pool's


def test_the_memory_axis_is_fitted_to_the_card() -> None:
    """A 602 GiB ask on an 80 GiB card does not squash the card: the axis stops just above
    the total, and the point is drawn at the top edge with its value written beside it."""
    pytest.importorskip("matplotlib")
    from gpupool._core.units import GiB
    from gpupool._observe.plot import CardView, plot_figure

    view = CardView(
        title="card 0",
        name="card 0",
        total_bytes=80 * GiB,
        end_s=2.0,
        priced=[(0.0, 10 * GiB, 5 * GiB, 0, 40 * GiB)],
        width=[(0.0, 4)],
        ceiling=[(0.0, 8)],
        marks={"out_of_memory": [(1.0, 602 * GiB, "card 0: ran out")]},
    )
    figure = plot_figure([], columns=[[view]])
    memory, width = (
        next(ax for ax in figure.axes if ax.get_label() == f"{panel}: card 0")
        for panel in ("memory", "width")
    )
    assert memory.get_ylim()[1] == pytest.approx(80 * 1.12)
    assert any(text.get_text() == "asked 602.00 GiB" for text in memory.texts)
    assert width.get_ylim()[1] == 9  # the ceiling of 8, plus one
