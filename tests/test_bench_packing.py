"""bench/packing.py --quick --rounds 1: it runs end to end, and gpupool loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "packing.py"


@pytest.mark.slow
def test_the_quick_limit_run_completes_and_gpupool_loses_nothing(tmp_path: Path) -> None:
    """The smoke run covers every limit scenario; gpupool loses no task in any of them and runs
    none out of memory where the estimates are not below the truth or the inputs' sizes are
    told (all but ``jump``)."""
    out = tmp_path / "packing.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--rounds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["scenario"]: row for row in json.loads(out.read_text())["limit"]}
    assert set(rows) == {
        "stable",
        "stable-close",
        "uniform",
        "uniform-20",
        "lognormal",
        "mixed",
        "jump",
        "jump-sized",
        "sized",
    }
    for name, row in rows.items():
        assert row["gpupool_lost"] == 0, name
        assert row["best_fixed_widths"], name  # the search found a width that lost nothing
        if name != "jump":
            assert row["gpupool_ooms"] == 0, name
