"""Developer sessions: ``nox`` runs the CPU gate (lint, typecheck, tests, docs).

Every session but ``tests-versions`` runs on the Python that runs nox (``python3 -m
nox`` with a 3.13: the gate on 3.13); one below the package's ``requires-python``
fails the session. ``tests-minimal``, ``tests-versions``, ``bench``, ``demo``,
``gpu`` and ``build`` are opt-in: ``nox -s build``. The tools come from
``[dependency-groups]`` in pyproject.toml (never from the published extras).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "docs"]
nox.options.reuse_existing_virtualenvs = True
# A session whose interpreter is missing fails: a skipped gate is not a passed one.
nox.options.error_on_missing_interpreters = True

#: The sessions' Python: ``None`` is the interpreter nox runs on.
PYTHON = None
#: Every Python the package supports (its classifiers).
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
#: The oldest Python the package supports (``requires-python``).
OLDEST = (3, 10)
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


def _runs(python: str) -> bool:
    """Whether ``python<version>`` on PATH starts (a pyenv shim of a version not
    active is on PATH but does not)."""
    found = shutil.which(f"python{python}")
    if found is None:
        return False
    done = subprocess.run([found, "-c", ""], capture_output=True, check=False)
    return done.returncode == 0


#: The supported Pythons on PATH, for ``tests-versions`` (none: the Python that runs nox).
INSTALLED = [python for python in PYTHONS if _runs(python)]


def _check_supported(session: nox.Session) -> None:
    """Fail the session, naming the fix, on a Python older than the package supports."""
    if sys.version_info[:2] < OLDEST:
        session.error(
            f"nox runs on Python {sys.version_info.major}.{sys.version_info.minor}; gpupool "
            f"needs {OLDEST[0]}.{OLDEST[1]} or newer: run nox with one (python3.13 -m nox)."
        )


def _test_workers() -> str:
    """pytest-xdist's worker count for the whole suite: the usable CPUs (at least 2:
    the tests spend most of their time waiting on the pools' child processes; at most
    8: each worker starts pools of its own)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return str(min(max(usable or 1, 2), 8))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff format --check and ruff check."""
    _check_supported(session)
    session.install(*_group("lint"))
    session.run("ruff", "format", "--check", "src", "tests", "bench", "docs", "noxfile.py")
    session.run("ruff", "check", "src", "tests", "bench", "docs", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src."""
    _check_supported(session)
    session.install("-e", ".[dask,joblib,top,ray]", *_group("typing"))
    session.run("mypy", "--strict", "src/gpupool")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on the simulated host (the gpu marker skips without a card),
    in parallel test processes (pytest-xdist), a test module (a CPython test class) to
    each at a time, so that a module's shared pool is built once: ``nox -s tests --
    -n 0`` runs it in one process, ``-- tests/core`` a part of it.

    Hypothesis draws its examples from a fixed seed here, so the gate gives the same
    verdict on every run; a bare ``pytest`` draws new ones each time, which is where new
    counterexamples are found (add each one found as an ``@example``)."""
    _check_supported(session)
    session.install("-e", ".[plot,progress,dask,joblib,top,ray]", *_group("test"), TORCH)
    session.run(
        "pytest",
        "-n",
        _test_workers(),
        "--dist",
        "loadscope",
        "--hypothesis-seed=0",
        *session.posargs,
    )


@nox.session(name="tests-minimal", python=PYTHON)
def tests_minimal(session: nox.Session) -> None:
    """The suite without the optional extras: proves they are optional."""
    _check_supported(session)
    session.install("-e", ".", *_group("test"))
    session.run("pytest", *session.posargs)


@nox.session(name="tests-versions", python=INSTALLED or [PYTHON])
def tests_versions(session: nox.Session) -> None:
    """A quick part of the suite on every supported Python found on PATH (no extras, no torch).

    Not in the default sessions: each version installs the package and the
    test group anew. With none of them on PATH as ``python3.N``, it runs on
    the Python that runs nox (with pyenv, list the versions in
    ``PYENV_VERSION``); on an unsupported one it fails. Arguments replace the
    subset: ``nox -s tests-versions -- tests/core``.
    """
    if session.python is None:
        _check_supported(session)
    session.install("-e", ".", *_group("test"))
    session.run("pytest", "-x", *(session.posargs or VERSIONS_SUBSET))


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Sphinx + MyST with the furo theme, nitpicky, warnings as errors."""
    _check_supported(session)
    # The joblib extra: the API page documents gpupool.joblib's functions from the module.
    session.install("-e", ".[joblib]", *_group("docs"))
    session.run(
        "sphinx-build", "-n", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html"
    )


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """The sdist and wheel, checked as PyPI would (``twine check --strict``)."""
    session.install("build", "twine")
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("twine", "check", "--strict", *sorted(glob.glob("dist/*")))
    # The wheel carries the documentation: installed, `gpupool docs` reads it from the package.
    session.install("--force-reinstall", *sorted(glob.glob("dist/*.whl")))
    page = session.run("gpupool", "docs", "demo", "--path", silent=True) or ""
    if "site-packages" not in page or not page.strip().endswith("gpupool/_docs/demo.md"):
        session.error(f"gpupool docs read {page.strip()!r}, not the installed package's page")


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
