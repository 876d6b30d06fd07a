"""Shared test configuration: ``gpu`` tests run only with ``--run-gpu``; pools book privately."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# ``import support`` from every test folder: the builders the suite shares.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-gpu",
        action="store_true",
        default=False,
        help="run tests marked gpu (they need a real NVIDIA card and driver)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA card: run with --run-gpu on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _no_memory_between_tests() -> Iterator[None]:
    """Pools under test remember no peaks between runs (the user's cache is not theirs to
    read or write); the tests of that memory name a file of their own."""
    saved = os.environ.get("GPUPOOL_MEMORY")
    os.environ["GPUPOOL_MEMORY"] = "off"
    yield
    if saved is None:
        os.environ.pop("GPUPOOL_MEMORY", None)
    else:
        os.environ["GPUPOOL_MEMORY"] = saved


@pytest.fixture(autouse=True, scope="session")
def _session_booking_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Pools under test (and the scripts they start) book in a directory of this session's own.

    Fake sensors' cards would otherwise book in the host's real table, where
    another test run on the same machine, with the same fake UUIDs, would see them.
    """
    directory = tmp_path_factory.mktemp("bookings")
    saved = os.environ.get("GPUPOOL_BOOKINGS")
    os.environ["GPUPOOL_BOOKINGS"] = str(directory)
    yield
    if saved is None:
        os.environ.pop("GPUPOOL_BOOKINGS", None)
    else:
        os.environ["GPUPOOL_BOOKINGS"] = saved
