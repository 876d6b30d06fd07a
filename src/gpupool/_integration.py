"""What the cluster integrations (``gpupool.dask``, ``gpupool.ray``) share: one pool per node.

Each integration builds one :class:`~gpupool.GpuPoolExecutor` per node of a
cluster from keywords checked on the client, and reports on it as a JSON-able
dict. Neither imports its framework from here.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpupool._errors import ConfigurationError

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor
    from gpupool.testing import SimulatedHost

__all__ = ["check_pool_keywords", "jsonable", "pool_parameters", "pool_report"]


def pool_parameters() -> frozenset[str]:
    """The names of :class:`~gpupool.GpuPoolExecutor`'s parameters."""
    from gpupool._pool.executor import GpuPoolExecutor

    parameters = inspect.signature(GpuPoolExecutor.__init__).parameters
    return frozenset(name for name in parameters if name != "self")


def check_pool_keywords(keywords: Mapping[str, Any]) -> None:
    """Refuse a keyword that is not a parameter of ``GpuPoolExecutor``, naming those it takes.

    Raises:
        ConfigurationError: a keyword is not a parameter of ``GpuPoolExecutor``.
    """
    unknown = sorted(set(keywords) - pool_parameters())
    if unknown:
        raise ConfigurationError(
            f"{', '.join(unknown)}: not a parameter of GpuPoolExecutor "
            f"(it takes {', '.join(sorted(pool_parameters()))})."
        )


def jsonable(value: Any) -> Any:
    """``value`` with dataclasses, records (named tuples and the sensor's readings: their
    ``_asdict``) and mappings turned into dicts, tuples into lists."""
    if isinstance(value, type):
        return value
    if dataclasses.is_dataclass(value):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "_asdict", None)):
        return jsonable(value._asdict())
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def pool_report(pool: GpuPoolExecutor, host: SimulatedHost | None) -> dict[str, Any]:
    """One node's pool as a JSON-able dict: ``width``, ``census``, ``decisions``,
    ``statistics``, and ``simulated`` (each card's total and peak, every out-of-memory
    event) when the pool runs on a simulated host, else ``None``."""
    census = jsonable(pool.census)
    for card, measured in zip(census["cards"], pool.census.cards, strict=True):
        card["co_tenant_bytes"] = measured.co_tenant_bytes
    simulated: dict[str, Any] | None = None
    if host is not None:
        simulated = {
            "devices": [
                {"total_bytes": device.total_bytes, "peak_bytes": host.device_peak(i)}
                for i, device in enumerate(host.devices)
            ],
            "out_of_memory_events": [jsonable(e) for e in host.out_of_memory_events],
        }
    return {
        "width": pool.width,
        "census": census,
        "decisions": [decision.to_dict() for decision in pool.decisions],
        "statistics": jsonable(pool.statistics()),
        "simulated": simulated,
    }
