"""The demo's time: what it is made of, so that the docs' figure stays true (no clock read)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool._commands.demo import ENTRY_HOLD_S, INCIDENT

#: The width gpupool reaches on the incident's card (the demo's decisions: 1 -> 2).
GPUPOOL_WIDTH = 2


def test_the_tasks_hold_the_card_under_a_second_in_all() -> None:
    """At gpupool's width of 2 the 36 entries' holds add up to under a second of the
    run: the part of the demo that is sleeping by design (the rest is starting
    processes and drawing)."""
    assert INCIDENT["entries"] * ENTRY_HOLD_S / GPUPOOL_WIDTH < 1.0


def test_plotting_is_imported_beside_the_runs() -> None:
    """The demo starts importing matplotlib (the larger part of the plot's time) in a
    thread of its own before its pools run, so the plot does not wait for it after them."""
    pytest.importorskip("matplotlib")
    src = str(Path(__file__).resolve().parents[2] / "src")
    script = (
        "import sys, threading\n"
        "import gpupool._commands.demo as demo\n"
        "assert 'matplotlib.figure' not in sys.modules\n"
        "demo._preload_plotting()\n"
        "(loader,) = [t for t in threading.enumerate() if t.name == 'gpupool-demo-preload']\n"
        "assert loader.daemon\n"
        "loader.join(60)\n"
        "print('matplotlib.figure' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
