"""What ``track`` reads of a pool (its ``statistics()``), for the progress tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeAsk:
    ask_bytes: int
    basis: str


@dataclass
class FakeStats:
    asks: dict[str, Any] = field(default_factory=dict)
    width: int = 2


class FakePool:
    """A pool as ``track`` sees it: one key measured at 6.94 GiB, width 2."""

    def statistics(self) -> FakeStats:
        return FakeStats({"mod.entry": FakeAsk(7_456_348_438, "measured")})
