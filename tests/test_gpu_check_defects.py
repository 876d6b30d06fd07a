"""bench/gpu_check.py --dry-run fails on each sensor defect of issue 34, injected into the code.

Each test copies the parts of the source tree the dry run runs (``src/gpupool``, the
check's modules in ``bench/``, the NVML double and the stand-in torch in ``tests/``)
into a temporary directory, makes one textual change to the library's code there,
and runs the copy's dry run in real processes: its parent, its pools' workers and
their children all import the changed copy. The dry run must fail (exit 1), and
the checks named here must be among its failures. Each runs only the steps that
can catch its defect (``--steps``), to keep the suite quick; the whole dry run's
table, defect by defect, is in ``docs/device-check.md``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What the dry run needs of the source tree (the copy is only these).
COPIED = (
    "src/gpupool",
    "bench/gpu_check.py",
    "bench/gpu_check_steps.py",
    "bench/gpu_check_tasks.py",
    "tests/standin_torch.py",
    "tests/standin_cupy.py",
    "tests/standin_jax.py",
    "tests/sensors/fake_pynvml.py",
    "tests/sensors/simulated_pynvml.py",
    "tests/sensors/nvml_double/pynvml.py",
)


@dataclass(frozen=True)
class Defect:
    """One change to the library's code: in the first of ``places`` whose file holds ``old``
    exactly once, ``old`` becomes ``new`` (``(path, old, new)``; more than one where the code
    may live in either of two modules); the dry run's ``steps`` must then fail with every
    check of ``caught``."""

    places: tuple[tuple[str, str, str], ...]
    steps: str
    caught: frozenset[str]


HIDDEN = ("hidden", "zero", "unavailable", "mig")

DEFECTS = {
    # The tree sensor sees no process under the worker: every child's bytes are dropped.
    "tree-without-descendants": Defect(
        (
            (
                "src/gpupool/_child/probe_tree.py",
                "found = read_descendants(self.root_pid, self._proc, own=own)",
                "found = ()",
            ),
        ),
        "peaks,cap,hidden-rows",
        frozenset(
            {
                "peaks.subprocess.floor",
                "peaks.double-fork.floor",
                "peaks.torch-child.floor",
                "cap.descendants",
                "cap.binds",
                *(f"hidden-rows.{mode}.flagged" for mode in HIDDEN),
            }
        ),
    ),
    # The worker's context, measured from its own row, is read as 0.
    "context-0": Defect(
        (
            (
                "src/gpupool/_child/probe.py",
                "outside = max(0, process_bytes - max(held_before, held_after))",
                "outside = 0",
            ),
        ),
        "context,peaks",
        frozenset(
            {"peaks.torch-first.context", "peaks.torch-spike.context", "peaks.torch-child.context"}
        ),
    ),
    # The estimate a context is priced at where no row of the worker can be read is 0.
    "estimate-0": Defect(
        tuple(
            (path, "CONTEXT_ESTIMATE_BYTES = 640 * MiB", "CONTEXT_ESTIMATE_BYTES = 0")
            for path in ("src/gpupool/_core/contexts.py", "src/gpupool/_child/probe.py")
        ),
        "context",
        frozenset({"context.figure.lazy"}),
    ),
    # torch's allocator cap leaves out what the worker's descendants hold.
    "cap-ignores-descendants": Defect(
        (
            (
                "src/gpupool/_child/probe.py",
                'read_held_bytes(leave_out="torch") + _CAP.descendant_bytes',
                'read_held_bytes(leave_out="torch")',
            ),
        ),
        "cap",
        frozenset({"cap.binds"}),
    ),
    # Rows hidden while a child ran: the peak is not flagged incomplete (and is learned from).
    "hidden-rows-not-flagged": Defect(
        (
            (
                "src/gpupool/_child/probe.py",
                "incomplete = self._reads.partial_view(",
                "incomplete = None and self._reads.partial_view(",
            ),
        ),
        "hidden-rows",
        frozenset(
            {
                *(f"hidden-rows.{mode}.flagged" for mode in HIDDEN),
                *(f"hidden-rows.{mode}.ask" for mode in HIDDEN),
            }
        ),
    ),
}


def _copy_tree(to: Path) -> None:
    for name in COPIED:
        source, target = ROOT / name, to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)


def _inject(tree: Path, defect: Defect) -> None:
    for name, old, new in defect.places:
        path = tree / name
        text = path.read_text() if path.is_file() else ""
        if text.count(old) == 1:
            path.write_text(text.replace(old, new))
            return
    # Code that moved fails here: a defect is never silently left out.
    raise AssertionError(f"no place holds the defect's code once: {defect.places}")


def _dry_run(
    tree: Path, out: Path, steps: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    script = str(tree / "bench" / "gpu_check.py")
    done = subprocess.run(
        [sys.executable, script, "--dry-run", "--steps", steps, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_the_dry_run_fails_on_an_injected_sensor_defect(name: str, tmp_path: Path) -> None:
    """With the defect in the copy's code, its dry run exits 1 and the named checks failed;
    no step raised (the failure is the checks', not a broken copy's)."""
    defect = DEFECTS[name]
    tree = tmp_path / "tree"
    _copy_tree(tree)
    _inject(tree, defect)
    done, report = _dry_run(tree, tmp_path / "out", defect.steps)
    assert done.returncode == 1, done.stdout + done.stderr
    assert not [c for c in report["checks"] if c["name"] == "raised"], done.stdout
    missed = defect.caught - set(report["failures"])
    assert not missed, f"not caught by {sorted(missed)}:\n{done.stdout}"


def test_the_copy_without_a_defect_passes_the_same_steps(tmp_path: Path) -> None:
    """The copy as it is passes every step the defects are run with: each failure above is
    its defect's."""
    tree = tmp_path / "tree"
    _copy_tree(tree)
    steps = ",".join(sorted({s for d in DEFECTS.values() for s in d.steps.split(",")}))
    done, report = _dry_run(tree, tmp_path / "out", steps)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["failures"] == []
    names = {f"{c['step']}.{c['name']}" for c in report["checks"]}
    assert names >= set().union(*(d.caught for d in DEFECTS.values()))
