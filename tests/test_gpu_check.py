"""bench/gpu_check.py on a machine without a card: it says so, and --require-gpu fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def _has_card() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


pytestmark = pytest.mark.skipif(
    _has_card(), reason="this host has an NVIDIA driver: the check would really run"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_help_shows_the_one_command() -> None:
    """--help names the one command to run from the source tree."""
    done = _run("--help")
    assert done.returncode == 0
    assert "python3 bench/gpu_check.py --require-gpu --out" in " ".join(done.stdout.split())


def test_without_a_card_it_exits_0_saying_it_checked_nothing(tmp_path: Path) -> None:
    """No card and no --require-gpu: exit 0, 'checked nothing', and the JSON says why."""
    done = _run("--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked nothing" in done.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["checked"] is False
    assert report["reason"]
    assert "checked nothing" in (tmp_path / "gpu_check.txt").read_text()


def test_require_gpu_without_a_card_fails(tmp_path: Path) -> None:
    """No card with --require-gpu: a non-zero exit (3) and FAILED in the summary."""
    done = _run("--require-gpu", "--out", str(tmp_path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "FAILED" in done.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["exit"] == 3
