"""Futures keep the submitted function's types: mypy --strict on a snippet that uses the pool."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import gpupool

api = pytest.importorskip(
    "mypy.api", reason="the typing test runs mypy: install the 'typing' dependency group"
)

SNIPPET = """
from collections.abc import Iterator
from concurrent.futures import Future

from gpupool import GpuPoolExecutor


def f(x: int) -> str:
    return str(x)


def g(x: int, *, scale: float = 1.0) -> float:
    return x * scale


with GpuPoolExecutor(task_peak="1GiB") as ex:
    view = ex.options(key="f", task_peak="2GiB")
    reveal_type(ex.submit(f, 1))  # line: submit
    reveal_type(view.submit(f, 1))  # line: view.submit
    reveal_type(ex.map(f, [1, 2]))  # line: map
    reveal_type(view.map(f, [1, 2]))  # line: view.map
    reveal_type(ex.submit(g, 1, scale=2.0))  # line: keyword
    ok: Future[str] = ex.submit(f, 2)
    results: Iterator[str] = ex.map(f, range(3))
    ex.submit(f, "x")  # line: bad submit
    view.submit(f, "x")  # line: bad view.submit
    ex.submit(g, 1, scale="big")  # line: bad keyword
    ex.submit(f)  # line: missing argument
    wrong: Future[int] = ex.submit(f, 1)  # line: bad result
"""


def _lines() -> dict[str, int]:
    """The snippet's line number of each ``# line: <name>`` comment."""
    found = {}
    for number, text in enumerate(SNIPPET.splitlines(), start=1):
        match = re.search(r"# line: (.+)$", text)
        if match:
            found[match.group(1)] = number
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_submit_and_map_keep_the_function_types(tmp_path: Path) -> None:
    """reveal_type shows Future[str] / Iterator[str]; wrong arguments and results are errors."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(SNIPPET))
    # The gpupool under test (this checkout's src), not whichever one is installed.
    source_root = Path(gpupool.__file__).resolve().parent.parent
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\nstrict = True\nmypy_path = {source_root}\n")
    stdout, stderr, status = api.run(
        [
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            "--show-error-codes",
            str(snippet),
        ]
    )
    assert stderr == ""
    by_line: dict[int, list[str]] = {}
    for text in stdout.splitlines():
        match = re.match(r".*snippet\.py:(\d+): (.*)$", text)
        assert match is not None, f"mypy wrote a line that is not about the snippet: {text}"
        by_line.setdefault(int(match.group(1)), []).append(match.group(2))
    line = _lines()
    # mypy 2 names builtins briefly ("Future[str]"), mypy 1 in full ("Future[builtins.str]").
    revealed = r'note: Revealed type is "{}\[(builtins\.)?{}\]"'
    future_str = revealed.format(r"concurrent\.futures\._base\.Future", "str")
    iterator_str = revealed.format(r"typing\.Iterator", "str")
    future_float = revealed.format(r"concurrent\.futures\._base\.Future", "float")
    for name, pattern in [
        ("submit", future_str),
        ("view.submit", future_str),
        ("map", iterator_str),
        ("view.map", iterator_str),
        ("keyword", future_float),
    ]:
        (message,) = by_line.pop(line[name])
        assert re.fullmatch(pattern, message), (name, message)
    for name in ("bad submit", "bad view.submit", "bad keyword"):
        (message,) = by_line.pop(line[name])
        assert message.startswith("error: Argument "), (name, message)
        assert "incompatible type" in message, (name, message)
        assert message.endswith("[arg-type]"), (name, message)
    (missing,) = by_line.pop(line["missing argument"])
    assert missing.startswith("error: "), missing
    assert missing.endswith("[call-arg]"), missing
    (result,) = by_line.pop(line["bad result"])
    # mypy infers from the annotation, so it names the function that returns str, not int.
    assert result.startswith("error: ") and "str" in result and "int" in result, result
    assert result.endswith(("[assignment]", "[arg-type]")), result
    assert by_line == {}, f"mypy reported more than the snippet expects: {by_line}"
    assert status == 1  # the snippet's deliberate errors
