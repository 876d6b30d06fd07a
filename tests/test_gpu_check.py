"""bench/gpu_check.py: without a card it says so; its dry run passes on the simulated host,
and with a probe that under-reports, every check that guards peaks fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"

STEPS = [
    "environment",
    "census",
    "context",
    "peaks",
    "peaks-eager",
    "cap",
    "hidden-rows",
    "ooms",
    "co-tenant",
]

#: The checks that guard peaks, as the dry run has them (CuPy and JAX stand-ins included).
PEAK_GUARDS = {
    "peaks.torch-first.floor",
    "peaks.torch-spike.floor",
    "peaks.torch-conv.floor",
    "peaks.cupy-spike.floor",
    "peaks.jax.floor",
    "peaks.subprocess.floor",
    "peaks.double-fork.floor",
    "peaks.torch-child.floor",
    "peaks-eager.torch-conv-eager.floor",
    "co-tenant.width",
}


def _has_card() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


without_a_card = pytest.mark.skipif(
    _has_card(), reason="this host has an NVIDIA driver: the check would really run"
)


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _report(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "gpu_check.json").read_text()))


def test_help_shows_the_one_command() -> None:
    """--help names the one command to run from the source tree, with --out "$OUT"."""
    done = _run("--help")
    assert done.returncode == 0
    assert 'python3 bench/gpu_check.py --require-gpu --out "$OUT"' in " ".join(done.stdout.split())


@without_a_card
def test_without_a_card_it_exits_0_saying_it_checked_nothing(tmp_path: Path) -> None:
    """No card and no --require-gpu: exit 0, 'checked nothing', and the JSON says why."""
    done = _run("--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked nothing" in done.stdout
    report = _report(tmp_path)
    assert report["checked"] is False
    assert report["reason"]
    assert "checked nothing" in (tmp_path / "gpu_check.txt").read_text()


@without_a_card
def test_require_gpu_without_a_card_fails(tmp_path: Path) -> None:
    """No card with --require-gpu: a non-zero exit (3) and FAILED in the summary."""
    done = _run("--require-gpu", "--out", str(tmp_path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "FAILED" in done.stdout
    assert _report(tmp_path)["exit"] == 3


@without_a_card
def test_without_out_it_writes_into_a_new_temporary_directory(tmp_path: Path) -> None:
    """No --out: the results go to a new directory under the temporary root, never the cwd."""
    done = _run(cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []
    temp_root = Path(tempfile.gettempdir()).resolve()
    written = [
        p for p in temp_root.glob("gpu-check-*/gpu_check.json") if str(p.parent) in done.stdout
    ]
    assert len(written) == 1, done.stdout
    assert json.loads(written[0].read_text())["checked"] is False
    shutil.rmtree(written[0].parent)


def test_break_probe_without_dry_run_is_refused(tmp_path: Path) -> None:
    """--break-probe alone is a usage error (exit 2) that says to add --dry-run."""
    done = _run("--break-probe", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "--dry-run" in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--dry-run", "--require-gpu"), "--require-gpu asks for a real card"),
        (("--dry-run", "--device", "3"), "one simulated card, index 0"),
        (("--dry-run", "--tolerance-mib", "-5"), "--tolerance-mib must be 0 or more"),
        (("--dry-run", "--out", "{file}"), "exists and is not a directory"),
    ],
    ids=["require-gpu", "device", "tolerance", "out-file"],
)
def test_options_that_cannot_hold_together_are_refused(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    """Options the run could not honour are a usage error (exit 2) naming the option, before
    anything runs: a dry run with --require-gpu would pass with no card, --device picks a
    card the dry run does not have, a negative slack, and --out naming a file (was a
    traceback, exit 1: the code of a failed check)."""
    file = tmp_path / "results.txt"
    file.write_text("kept")
    done = _run(*(arg.format(file=file) for arg in args), "--steps", "census")
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr
    assert file.read_text() == "kept"


def test_an_unknown_step_is_refused(tmp_path: Path) -> None:
    """--steps with a name that is no step: a usage error (exit 2) that lists the steps."""
    done = _run("--dry-run", "--steps", "peaks,nope", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "unknown step(s) nope" in done.stderr
    assert ",".join(STEPS) in done.stderr


def test_dry_run_passes_on_the_simulated_host(tmp_path: Path) -> None:
    """--dry-run runs every step on the simulated card, through the real NVML sensor over the
    simulator-fed pynvml double, and every check holds (exit 0)."""
    done = _run("--dry-run", "--out", str(tmp_path))
    report = _report(tmp_path)
    assert list(report["steps"]) == STEPS
    assert report["exit"] == done.returncode
    assert "gpu_check: PASSED" in done.stdout or "gpu_check: FAILED" in done.stdout
    names = {f"{c['step']}.{c['name']}" for c in report["checks"]}
    assert names >= PEAK_GUARDS
    assert not any(c["name"] == "raised" for c in report["checks"]), done.stdout
    assert report["failures"] == [], done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
    # The context step compares the card's context with the probe's estimate (the figure
    # the probe prices an unread context at), not a name that no longer exists.
    from gpupool._child.probe import CONTEXT_ESTIMATE_BYTES

    assert report["steps"]["context"]["probe_figure_bytes"] == CONTEXT_ESTIMATE_BYTES
    # Beside it, reported and never judged, the figure the check's own pools would price a
    # hidden worker of this card's model at (nothing recorded yet on this fresh host).
    model = report["steps"]["context"]["model_figure"]
    assert (model["context_bytes"], model["source"]) == (
        CONTEXT_ESTIMATE_BYTES,
        "estimated (default)",
    )
    assert any(c["name"] == "figure.model" and c["report"] for c in report["checks"])
    # The workers measured through NVML (sampled rows, torch's counters), never the
    # simulator's exact ledger; on the cards that hide the rows, the peaks were flagged.
    sources = {c["detail"] for c in report["checks"] if c["name"].endswith(".source")}
    assert sources and not any("'simulator'" in detail for detail in sources)
    assert any("'nvml-sampled'" in detail for detail in sources)
    hidden = [c for c in report["checks"] if c["step"] == "hidden-rows"]
    assert {c["name"] for c in hidden} == {
        f"{mode}.{name}"
        for mode in ("hidden", "zero", "unavailable", "mig")
        for name in ("flagged", "ask")
    }
    assert all(
        "reading(s) of the tree could not tell" in c["detail"]
        for c in hidden
        if c["name"].endswith(".flagged")
    )


def test_dry_run_with_a_broken_probe_fails_naming_every_peak_guard(tmp_path: Path) -> None:
    """--break-probe (peaks / 4): exit 1, and every check that guards peaks caught it."""
    done = _run("--dry-run", "--break-probe", "--out", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    report = _report(tmp_path)
    assert report["broken_probe"] is True
    assert set(report["break_probe_caught_by"]) == PEAK_GUARDS
    assert report["break_probe_missed_by"] == []
    assert set(report["failures"]) >= PEAK_GUARDS
    caught_line = next(line for line in done.stdout.splitlines() if "caught by 10:" in line)
    assert all(name in caught_line for name in PEAK_GUARDS)
    assert "gpu_check: FAILED" in (tmp_path / "gpu_check.txt").read_text()
