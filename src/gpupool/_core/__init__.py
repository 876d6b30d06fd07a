"""The pure core: numbers in, decisions out.

Nothing in this package reads a device, a file, the clock or the
environment; ``tests/test_layering.py`` enforces it. Everything that asks
the world for a number lives in :mod:`gpupool._sensors` or is passed in.
"""

from __future__ import annotations

from gpupool._core.bound import (
    AskBasis,
    Bound,
    Ceiling,
    WidthDecision,
    admits,
    decide_width,
    decide_widths,
    derive_bound,
    derive_ceiling,
    live_gate_admits,
)
from gpupool._core.census import CardCensus, Census, HostCensus
from gpupool._core.events import EVENTS, SCHEMA_VERSION, Decision
from gpupool._core.peak import PeakReport
from gpupool._core.policy import (
    DEFAULT_MARGIN_BYTES,
    DEFAULT_MARGIN_FRACTION,
    DEFAULT_RESERVE_BYTES,
    Ask,
    AskTable,
    Policy,
)
from gpupool._core.units import GiB, KiB, MiB, format_size, parse_size

__all__ = [
    "DEFAULT_MARGIN_BYTES",
    "DEFAULT_MARGIN_FRACTION",
    "DEFAULT_RESERVE_BYTES",
    "EVENTS",
    "SCHEMA_VERSION",
    "Ask",
    "AskBasis",
    "AskTable",
    "Bound",
    "CardCensus",
    "Census",
    "Ceiling",
    "Decision",
    "GiB",
    "HostCensus",
    "KiB",
    "MiB",
    "PeakReport",
    "Policy",
    "WidthDecision",
    "admits",
    "decide_width",
    "decide_widths",
    "derive_bound",
    "derive_ceiling",
    "format_size",
    "live_gate_admits",
    "parse_size",
]
