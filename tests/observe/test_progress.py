"""The progress bar where users look: its text, when it shows, and log lines beside it."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from progress_pool import FakePool

from gpupool._observe.progress import progress_enabled, track

#: The module tqdm.auto (and gpupool) find loaded inside a Jupyter kernel.
KERNEL_MODULE = "ipykernel.zmqshell"


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as tqdm.auto sees a Jupyter kernel: ``ipykernel.zmqshell`` loaded."""
    monkeypatch.setitem(sys.modules, KERNEL_MODULE, types.ModuleType(KERNEL_MODULE))
    for name in list(os.environ):
        if name == "QT_API" or name.startswith("SPYDER"):
            monkeypatch.delenv(name)


@contextlib.contextmanager
def _gpupool_to_stderr() -> Iterator[logging.StreamHandler[Any]]:
    """A handler that prints the ``gpupool`` logger's lines on stderr, as a user sets one
    (made inside the test: stderr is then the one capsys captures)."""
    logger = logging.getLogger("gpupool")
    handler: logging.StreamHandler[Any] = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _chunks(err: str) -> list[str]:
    """What a terminal shows of each write: the text between carriage returns and newlines."""
    return [chunk for chunk in re.split(r"[\r\n]", err) if chunk.strip()]


def test_the_postfix_follows_the_times_without_a_stray_space(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pool's terms follow the times as tqdm's own do: ``00:00<00:00, failed 0, ...``."""
    pytest.importorskip("tqdm")
    list(track(range(3), total=3, executor=FakePool(), enabled=True))
    last = _chunks(capsys.readouterr().err)[-1]
    assert re.search(r"\| \d\d:\d\d<\d\d:\d\d, failed 0, width 2, ask 6\.94 GiB", last), last
    assert " ," not in last


def test_auto_is_on_inside_a_jupyter_kernel(kernel: None) -> None:
    """In a Jupyter kernel stderr is no terminal, yet the user is looking: the bar is on."""
    assert progress_enabled(None, io.StringIO()) is True
    assert progress_enabled(False, io.StringIO()) is False


def test_auto_is_off_outside_a_kernel_without_a_terminal() -> None:
    """Neither a terminal nor a kernel (a batch job, a pipe): no bar unless asked for."""
    assert KERNEL_MODULE not in sys.modules
    assert progress_enabled(None, io.StringIO()) is False


def test_the_bar_shows_by_default_in_a_kernel_and_is_tqdm_auto(
    kernel: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``enabled=None`` in a kernel the bar is drawn, and it is tqdm.auto's class
    (a notebook widget where ipywidgets is installed, the text bar otherwise)."""
    tqdm_auto = pytest.importorskip("tqdm.auto")
    from tqdm import tqdm as std_tqdm

    shown: list[type[Any]] = []
    for _ in track(range(3), total=3, executor=FakePool()):
        shown.extend(type(bar) for bar in list(std_tqdm._instances))
    assert shown and all(issubclass(cls, tqdm_auto.tqdm) for cls in shown)
    assert "3/3" in capsys.readouterr().err


def test_log_lines_go_through_tqdm_write_while_a_bar_is_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ``gpupool`` log line printed while the bar shows takes a line of its own (tqdm
    clears the bar, writes it, redraws): never glued to the bar's text. After the bar,
    the handler writes to its stream again."""
    pytest.importorskip("tqdm")
    logger = logging.getLogger("gpupool")
    with _gpupool_to_stderr() as handler:
        for i in track(range(3), total=3, executor=FakePool(), enabled=True):
            logger.warning("gpupool test line %d", i)
        assert handler.stream is sys.stderr
        chunks = _chunks(capsys.readouterr().err)
        logger.warning("after the bar")
    for i in range(3):
        assert f"gpupool test line {i}" in chunks, chunks
    assert not [c for c in chunks if "test line" in c and "|" in c], chunks
    assert capsys.readouterr().err == "after the bar\n"


def test_log_lines_are_left_alone_without_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """With the bar off, log lines reach the handler's stream exactly as they would."""
    logger = logging.getLogger("gpupool")
    with _gpupool_to_stderr():
        for i in track(range(2), total=2, enabled=False):
            logger.warning("plain %d", i)
    assert capsys.readouterr().err == "plain 0\nplain 1\n"
