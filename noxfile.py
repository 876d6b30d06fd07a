"""Developer sessions: ``nox`` runs the CPU gate (lint, typecheck, tests, docs).

``tests-minimal``, ``tests-versions``, ``bench``, ``demo``, ``gpu`` and ``build``
are opt-in: ``nox -s build``. The tools come from ``[dependency-groups]`` in
pyproject.toml (never from the published extras).
"""

from __future__ import annotations

import glob

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "docs"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

PYTHON = "3.11"
#: Every Python the package supports (its classifiers); a missing one is skipped.
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
#: A quick, representative part of the suite for ``tests-versions``: the pure
#: core, the executor's contract on real workers, the postmortem, the public API.
VERSIONS_SUBSET = [
    "tests/core",
    "tests/pool/test_contract.py",
    "tests/observe/test_postmortem.py",
    "tests/test_public_api.py",
]
PYPROJECT = nox.project.load_toml("pyproject.toml")
# The test session's torch: the suite measures a real torch allocation in
# its children. A version pin does not choose a build: where a local wheel
# directory offers the CPU build it is taken, otherwise the index's default.
TORCH = "torch==2.13.0"


def _group(name: str) -> list[str]:
    return list(nox.project.dependency_groups(PYPROJECT, name))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff format --check and ruff check."""
    session.install(*_group("lint"))
    session.run("ruff", "format", "--check", "src", "tests", "bench", "docs", "noxfile.py")
    session.run("ruff", "check", "src", "tests", "bench", "docs", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src."""
    session.install("-e", ".[dask,joblib,top,ray]", *_group("typing"))
    session.run("mypy", "--strict", "src/gpupool")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on the simulated host (the gpu marker skips without a card)."""
    session.install("-e", ".[plot,progress,dask,joblib,top,ray]", *_group("test"), TORCH)
    session.run("pytest", *session.posargs)


@nox.session(name="tests-minimal", python=PYTHON)
def tests_minimal(session: nox.Session) -> None:
    """The suite without the optional extras: proves they are optional."""
    session.install("-e", ".", *_group("test"))
    session.run("pytest", *session.posargs)


@nox.session(name="tests-versions", python=PYTHONS)
def tests_versions(session: nox.Session) -> None:
    """A quick part of the suite on every supported Python found here (no extras, no torch).

    Not in the default sessions: each version installs the package and the
    test group anew. An interpreter that is not on PATH is skipped with a
    message (with pyenv, list them all in ``PYENV_VERSION``). Arguments
    replace the subset: ``nox -s tests-versions -- tests/core``.
    """
    session.install("-e", ".", *_group("test"))
    session.run("pytest", "-x", *(session.posargs or VERSIONS_SUBSET))


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Sphinx + MyST with the furo theme, nitpicky, warnings as errors."""
    session.install("-e", ".", *_group("docs"))
    session.run(
        "sphinx-build", "-n", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html"
    )


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """The sdist and wheel, checked as PyPI would (``twine check --strict``)."""
    session.install("build", "twine")
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("twine", "check", "--strict", *sorted(glob.glob("dist/*")))


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks, side by side against the standard library and loky."""
    session.install("-e", ".", *_group("test"))
    for script in ("bench/overhead.py", "bench/sensor_overhead.py"):
        session.run("python", script, *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: ``gpupool demo`` (the incident on the simulated host without a GPU)."""
    session.install("-e", ".[plot,progress]")
    session.run("gpupool", "demo", *session.posargs)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """Real-card tests and the device check; needs an NVIDIA GPU (and the CUDA torch)."""
    session.install("-e", ".", *_group("test"), "torch")
    session.run("pytest", "-m", "gpu", "--run-gpu", *session.posargs)
