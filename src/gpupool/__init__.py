"""gpupool: a ``concurrent.futures`` process pool that packs GPU work onto cards by measured memory.

::

    from gpupool import GpuPoolExecutor

    with GpuPoolExecutor(task_peak="6GiB") as ex:
        results = list(ex.map(compile_entry, entries))

Heavy modules (the pool, which imports loky; the sensors, which import
pynvml) load on first use, so ``import gpupool`` stays cheap and never
touches a driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpupool._core.units import format_size, parse_size
from gpupool._errors import (
    ConfigurationError,
    DeviceOutOfMemoryError,
    DeviceUnreadableError,
    GpuPoolError,
    InvalidSizeError,
    NoDriverError,
    SensorError,
    WidthError,
    WorkerLostError,
)

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor, PoolStatistics, TaskOptions

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "DeviceOutOfMemoryError",
    "DeviceUnreadableError",
    "GpuPoolError",
    "GpuPoolExecutor",
    "InvalidSizeError",
    "NoDriverError",
    "PoolStatistics",
    "SensorError",
    "TaskOptions",
    "WidthError",
    "WorkerLostError",
    "__version__",
    "format_size",
    "parse_size",
]

_LAZY = {
    "GpuPoolExecutor": "gpupool._pool.executor",
    "PoolStatistics": "gpupool._pool.executor",
    "TaskOptions": "gpupool._pool.executor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpupool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
