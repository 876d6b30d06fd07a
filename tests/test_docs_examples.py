"""Every Python block in the docs and the README runs as written, with its inputs defined.

Each ```` ```python ```` block is one program, run in a fresh interpreter in
an empty directory (a block that starts ``# test_<name>.py`` is a test file,
run with pytest). A block that starts ``# <name>.py`` is a module: it runs
too, and is written beside every later block of its page, which may import
it. A block preceded by ``<!-- not run: REASON -->`` is skipped with that
reason; the test below keeps that list short.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")
_MODULE = re.compile(r"# ((?!test_)\w+\.py)")
#: Blocks that may be skipped (each needs something a test machine lacks).
MAX_NOT_RUN = 2


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    not_run: str | None
    #: The page's earlier module blocks, as (file name, code).
    modules: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        modules: list[tuple[str, str]] = []
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _NOT_RUN.search(before)
            code = match.group(1)
            reason = marker.group(1) if marker else None
            blocks.append(Block(page, line, code, reason, tuple(modules)))
            module = _MODULE.fullmatch(code.splitlines()[0].strip())
            if module:
                modules.append((module.group(1), code))
    return blocks


BLOCKS = _blocks()


def test_the_pages_have_blocks_and_few_are_skipped() -> None:
    """The extraction finds the pages' blocks, and at most MAX_NOT_RUN carry a not-run reason."""
    assert len(BLOCKS) >= 10
    skipped = [b.id for b in BLOCKS if b.not_run]
    assert len(skipped) <= MAX_NOT_RUN, skipped


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    """The block runs to completion (exit 0) in a fresh interpreter, as a reader would run it."""
    if block.not_run:
        pytest.skip(f"{block.id}: {block.not_run}")
    every_code = "\n".join([block.code, *(code for _, code in block.modules)])
    for module in ("dask", "distributed", "joblib", "matplotlib", "ray", "tqdm", "torch"):
        imported = re.search(rf"^\s*(import|from) {module}\b", every_code, re.MULTILINE)
        if imported and importlib.util.find_spec(module) is None:
            pytest.skip(f"{block.id} needs {module} (an optional extra or framework)")
    for name, code in block.modules:
        (tmp_path / name).write_text(code)
    first = block.code.splitlines()[0].strip()
    named = re.fullmatch(r"# (test_\w+\.py)", first)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPOOL_SIMULATOR", "PYTEST_ADDOPTS")}
    if named:
        script = tmp_path / named.group(1)
        script.write_text(block.code)
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", script.name]
    else:
        script = tmp_path / "example.py"
        script.write_text(block.code)
        argv = [sys.executable, script.name]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.id}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


# -- the configuration page against the code ------------------------------------------------


def _signature_block() -> str:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    match = re.search(r"```text\n(GpuPoolExecutor\(.*?\))\n```", text, re.DOTALL)
    assert match is not None
    return match.group(1)


def test_the_configuration_page_matches_the_signature() -> None:
    """The page's signature lists every parameter, in order, with its real default."""
    import ast
    import inspect

    from gpupool import GpuPoolExecutor

    shown = _signature_block().replace("*,", "").replace("GpuPoolExecutor(", "f(")
    call = ast.parse(shown).body[0].value  # type: ignore[attr-defined]
    documented = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    params = {
        name: p.default
        for name, p in inspect.signature(GpuPoolExecutor.__init__).parameters.items()
        if name != "self"
    }
    assert list(documented) == list(params)
    assert documented == params


def test_every_parameter_has_an_entry_and_a_docstring_line() -> None:
    """Each parameter has a definition on the page and an Args line in the class docstring."""
    import inspect

    from gpupool import GpuPoolExecutor

    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    terms = set(re.findall(r"^`(\w+)`", page, re.MULTILINE))
    terms |= set(re.findall(r"^`\w+`, `(\w+)`", page, re.MULTILINE))
    terms |= set(re.findall(r"^`\w+` \(default [^)]*\) and `(\w+)`", page, re.MULTILINE))
    doc = inspect.getdoc(GpuPoolExecutor) or ""
    for name in inspect.signature(GpuPoolExecutor.__init__).parameters:
        if name == "self":
            continue
        assert name in terms, f"{name} has no entry on docs/configuration.md"
        assert re.search(rf"^\s+{name}:", doc, re.MULTILINE), f"{name} is not in the docstring"
