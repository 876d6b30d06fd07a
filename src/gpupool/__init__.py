"""gpupool: a ``concurrent.futures`` process pool that packs GPU work onto cards by measured memory.

::

    from gpupool import GpuPoolExecutor

    with GpuPoolExecutor(task_peak="6GiB") as ex:
        results = list(ex.map(render, scenes))

Heavy modules (the pool, which imports multiprocessing; the sensors, which import
pynvml) load on first use, so ``import gpupool`` stays cheap and never
touches a driver. So do the records only the pool's parent side uses (the
census, the bound, the decisions, the asks, the progress helper), the two
errors that are also a ``BrokenProcessPool``, and the sensor interface and its
records: a worker, which imports this package first, does not load them (one
without a device never loads :mod:`dataclasses`).

The records the pool returns (:class:`Census`, :class:`CardCensus`,
:class:`HostCensus`, :class:`Decision`, :class:`Bound`, :class:`Ceiling`,
:class:`Ask`) and the sensor interface (:class:`Sensor` and its readings)
are public here; they are defined in private modules, and carry this
package as their ``__module__`` so that documentation, reprs and pickles
name the public path.
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
    TaskTimeoutError,
    WidthError,
)

if TYPE_CHECKING:
    from gpupool._broken import InitializerError, WorkerLostError, WorkerProtocolError
    from gpupool._core.bound import Bound, Ceiling
    from gpupool._core.census import CardCensus, Census, HostCensus
    from gpupool._core.events import (  # noqa: F401 (hints)
        EVENTS,
        Decision,
        EventName,
        JsonValue,
        TaskIdentity,
    )
    from gpupool._core.policy import Ask
    from gpupool._observe.progress import track
    from gpupool._pool.executor import GpuPoolExecutor, PoolStatistics, TaskOptions
    from gpupool._sensors.base import Sensor
    from gpupool._sensors.readings import DeviceInfo, MemoryReading, ProcessReading

__version__ = "0.1.0"

__all__ = [
    "Ask",
    "Bound",
    "CardCensus",
    "Ceiling",
    "Census",
    "ConfigurationError",
    "Decision",
    "DeviceInfo",
    "DeviceOutOfMemoryError",
    "DeviceUnreadableError",
    "EVENTS",
    "GpuPoolError",
    "GpuPoolExecutor",
    "HostCensus",
    "InitializerError",
    "InvalidSizeError",
    "MemoryReading",
    "NoDriverError",
    "PoolStatistics",
    "ProcessReading",
    "Sensor",
    "SensorError",
    "TaskIdentity",
    "TaskOptions",
    "TaskTimeoutError",
    "WidthError",
    "WorkerLostError",
    "WorkerProtocolError",
    "__version__",
    "forget_peaks",
    "format_size",
    "parse_size",
    "track",
]

_LAZY = {
    "Ask": "gpupool._core.policy",
    "Bound": "gpupool._core.bound",
    "CardCensus": "gpupool._core.census",
    "Census": "gpupool._core.census",
    "HostCensus": "gpupool._core.census",
    "Ceiling": "gpupool._core.bound",
    "Decision": "gpupool._core.events",
    "EVENTS": "gpupool._core.events",
    "EventName": "gpupool._core.events",
    "JsonValue": "gpupool._core.events",
    "TaskIdentity": "gpupool._core.events",
    "track": "gpupool._observe.progress",
    "forget_peaks": "gpupool._pool.memory",
    "GpuPoolExecutor": "gpupool._pool.executor",
    "PoolStatistics": "gpupool._pool.executor",
    "TaskOptions": "gpupool._pool.executor",
    # A sensor's interface and records: a worker without a device loads neither.
    "DeviceInfo": "gpupool._sensors.readings",
    "MemoryReading": "gpupool._sensors.readings",
    "ProcessReading": "gpupool._sensors.readings",
    "Sensor": "gpupool._sensors.base",
    # Also BrokenProcessPool: their base's module is loaded with them, not by a worker.
    "InitializerError": "gpupool._broken",
    "WorkerLostError": "gpupool._broken",
    "WorkerProtocolError": "gpupool._broken",
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
