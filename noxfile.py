"""Developer sessions: ``nox`` runs the CPU gate (lint, typecheck, tests, docs).

``bench``, ``demo`` and ``gpu`` are opt-in: ``nox -s bench``.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "docs"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

PYTHON = "3.11"
# The CPU wheel; an unpinned torch pulls a CUDA build of several GB.
TORCH = "torch==2.13.0"
# Pinned: a newer ruff may format differently and fail the gate on unchanged code.
RUFF = "ruff==0.17.6"


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff format --check and ruff check."""
    session.install(RUFF)
    session.run("ruff", "format", "--check", "src", "tests", "bench", "docs", "noxfile.py")
    session.run("ruff", "check", "src", "tests", "bench", "docs", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src."""
    session.install("-e", ".[typing,dask]")
    session.run("mypy", "--strict", "src/gpupool")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on the simulated host (the gpu marker skips without a card)."""
    session.install("-e", ".[test,plot,progress,dask]", TORCH, "numpy")
    session.run("pytest", *session.posargs)


@nox.session(name="tests-minimal", python=PYTHON)
def tests_minimal(session: nox.Session) -> None:
    """The suite with only the test extra: proves the optional extras are optional."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Sphinx + MyST, nitpicky, warnings as errors."""
    session.install("-e", ".[docs]")
    session.run(
        "sphinx-build", "-n", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html"
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks, side by side against the standard library and loky."""
    session.install("-e", ".[test]")
    for script in ("bench/overhead.py", "bench/sensor_overhead.py"):
        session.run("python", script, *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: ``gpupool demo`` (the incident on the simulated host without a GPU)."""
    session.install("-e", ".[plot,progress]")
    session.run("gpupool", "demo", *session.posargs)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """Real-card tests and the device check; needs an NVIDIA GPU."""
    session.install("-e", ".[test]", TORCH)
    session.run("pytest", "-m", "gpu", "--run-gpu", *session.posargs)
