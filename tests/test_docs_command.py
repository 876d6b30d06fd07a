"""``gpupool docs``: the pages from the package, and every message that points at them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool._commands.cli import main
from gpupool._commands.docs import docs_directory, topics

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "gpupool"


def test_without_a_topic_it_lists_every_page_with_its_title(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["docs"]) == 0
    out = capsys.readouterr().out
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    table, _, hint = out.partition("\n\n")
    listed = [line.split()[0] for line in table.splitlines()]
    assert listed == pages
    assert re.search(r"^demo +The demo, explained$", out, re.M)
    assert "gpupool docs TOPIC prints a page" in hint


def test_a_topic_prints_its_page_or_its_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "joblib"]) == 0
    assert capsys.readouterr().out == (ROOT / "docs" / "joblib.md").read_text().rstrip() + "\n"
    assert main(["docs", "demo.md", "--path"]) == 0
    assert Path(capsys.readouterr().out.strip()).samefile(ROOT / "docs" / "demo.md")


@pytest.mark.parametrize("topic", ["joblb", "../README", ".hidden", ""])
def test_an_unknown_topic_is_a_usage_error_that_names_the_closest(
    capsys: pytest.CaptureFixture[str], topic: str
) -> None:
    assert main(["docs", topic]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no page {topic!r}" in captured.err
    assert "gpupool docs lists them" in captured.err
    if topic == "joblb":
        assert "did you mean 'joblib'?" in captured.err


def test_the_console_script_runs_it() -> None:
    """As a user types it: ``python -m gpupool docs demo --path``, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "docs", "demo", "--path"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("demo.md")


def _messages() -> list[tuple[str, str]]:
    """Every string constant in the package's code but docstrings: (file, text)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
            ):
                found.append((path.name, node.value))
    return found


def test_every_message_that_points_at_the_docs_names_a_page_the_command_shows() -> None:
    """A message that sends the user to the documentation says ``gpupool docs TOPIC`` with a
    topic that exists (a wheel has no docs folder to point at)."""
    directory = docs_directory()
    assert directory is not None
    known = set(topics(directory))
    pointing = [
        (name, text)
        for name, text in _messages()
        if re.search(r"documentation|docs/|\.md\b|gpupool docs \w", text)
        and name != "docs.py"  # the command's own texts
    ]
    assert pointing, "the demo's last line points at its page"
    for name, text in pointing:
        named = re.findall(r"gpupool docs ([\w-]+)", text)
        assert named, f"{name}: {text!r} points at the docs without naming a topic"
        assert set(named) <= known, f"{name}: {text!r} names no page of {sorted(known)}"
