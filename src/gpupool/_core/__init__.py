"""The pure core: numbers in, decisions out.

Nothing in this package reads a device, a file, the clock or the
environment; ``tests/test_layering.py`` enforces it. Everything that asks
the world for a number lives in :mod:`gpupool._sensors` or is passed in.

Its modules load on first use (``from gpupool._core import Policy`` works as
before): a worker imports the few it needs, not the planner's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpupool._core.bound import (
        AskBasis,
        Bound,
        Ceiling,
        WidthDecision,
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
    "derive_bound",
    "derive_ceiling",
    "format_size",
    "live_gate_admits",
    "parse_size",
]

#: Each exported name's module (tests/test_layering.py: no importlib in the core).
_HOME = {
    "AskBasis": "bound",
    "Bound": "bound",
    "Ceiling": "bound",
    "WidthDecision": "bound",
    "derive_bound": "bound",
    "derive_ceiling": "bound",
    "live_gate_admits": "bound",
    "CardCensus": "census",
    "Census": "census",
    "HostCensus": "census",
    "EVENTS": "events",
    "SCHEMA_VERSION": "events",
    "Decision": "events",
    "PeakReport": "peak",
    "DEFAULT_MARGIN_BYTES": "policy",
    "DEFAULT_MARGIN_FRACTION": "policy",
    "DEFAULT_RESERVE_BYTES": "policy",
    "Ask": "policy",
    "AskTable": "policy",
    "Policy": "policy",
    "GiB": "units",
    "KiB": "units",
    "MiB": "units",
    "format_size": "units",
    "parse_size": "units",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'gpupool._core' has no attribute {name!r}")
    if home == "bound":
        from gpupool._core import bound

        return _keep(name, bound)
    if home == "census":
        from gpupool._core import census

        return _keep(name, census)
    if home == "events":
        from gpupool._core import events

        return _keep(name, events)
    if home == "peak":
        from gpupool._core import peak

        return _keep(name, peak)
    if home == "policy":
        from gpupool._core import policy

        return _keep(name, policy)
    from gpupool._core import units

    return _keep(name, units)


def _keep(name: str, module: object) -> Any:
    value = getattr(module, name)
    globals()[name] = value
    return value
