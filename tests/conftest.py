"""Shared test configuration: the ``gpu`` marker runs only with ``--run-gpu`` and a real card."""

from __future__ import annotations

import sys
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
