"""Child side: measure one task's device and host peaks, and classify device out-of-memory errors.

Runs inside every worker. It never creates a CUDA context: it looks at
torch only when the task has already initialised CUDA in this process.
Sources of the device peak, best first:

1. the sensor's exact per-process high-water window (the simulator's ledger);
2. NVML accounting's lifetime maximum of the process, when accounting is on
   and that maximum rose during the task (it cannot be reset, so a task that
   stayed below an earlier one falls through to the next source);
3. the sensor's per-process reading (NVML), sampled on a thread while the
   task runs, which includes the context and non-PyTorch allocations;
4. torch's ``max_memory_reserved`` plus the bytes the process held before
   the task (its context), when CUDA was initialised by the task, if larger.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import TYPE_CHECKING

from gpupool._core.peak import PeakReport
from gpupool._core.units import parse_size
from gpupool._sensors.base import Sensor
from gpupool._sensors.process import read_rss_high_water

if TYPE_CHECKING:
    from gpupool._sensors.base import DeviceInfo

__all__ = ["Probe", "is_device_oom", "requested_bytes_of"]

#: Interval of the sampling thread, when the sensor has no exact high-water.
#: 10 ms catches allocations that live as long as a kernel launch sequence;
#: a spike shorter than that is what the margin is for.
SAMPLE_INTERVAL_S = 0.010

# Messages of device out-of-memory errors, by library (see
# shared/reference/nvml-and-cuda-memory.md, section 6.4).
_OOM_PATTERNS = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY"
    r"|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|RESOURCE_EXHAUSTED: Out of memory"
    r"|device \d+ out of memory|HIP out of memory|out of memory on device",
    re.IGNORECASE,
)
_OOM_TYPES = {
    ("torch", "OutOfMemoryError"),
    ("torch.cuda", "OutOfMemoryError"),
    ("cupy.cuda.memory", "OutOfMemoryError"),
    ("cuda.core.experimental", "CUDAOutOfMemoryError"),
    ("cuda.core", "CUDAOutOfMemoryError"),
    ("gpupool.testing", "SimulatedOutOfMemory"),
}
_TRIED = re.compile(r"[Tt]ried to allocate ([0-9.]+\s*[KMGT]i?B)")


def is_device_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a device out-of-memory error (torch, CuPy, JAX, numba, CUDA, simulator).

    A host :class:`MemoryError` without a device message is not one.
    """
    for cls in type(exc).__mro__:
        if (cls.__module__, cls.__name__) in _OOM_TYPES:
            return True
    return bool(_OOM_PATTERNS.search(_text(exc)))


def _text(exc: BaseException) -> str:
    """``str(exc)``, or ``""`` when the exception's own ``__str__`` raises."""
    try:
        return str(exc)
    except Exception:
        return ""


def requested_bytes_of(exc: BaseException) -> int | None:
    """The size of the allocation that failed, when the error says it."""
    value = getattr(exc, "requested_bytes", None)
    if isinstance(value, int):
        return value
    match = _TRIED.search(_text(exc))
    if match:
        try:
            return parse_size(match.group(1))
        except ValueError:
            return None
    return None


class Probe:
    """Measures one task at a time in a worker pinned to ``device``.

    Args:
        sensor: the worker's sensor (simulator or NVML), or ``None`` for a
            worker without a device.
        device: the device the worker is pinned to.
        device_index: the pool's index of that device.
        pid: this process's PID.
    """

    def __init__(
        self, sensor: Sensor | None, device: DeviceInfo | None, device_index: int | None, pid: int
    ) -> None:
        self._sensor = sensor
        self._device = device
        self._device_index = device_index
        self._pid = pid
        self._baseline_bytes: int | None = None
        self._max_at_start: int | None = None
        self._sampled_peak_bytes: int | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._exact = True

    def start(self) -> None:
        """Open the measuring window for one task."""
        sensor, device = self._sensor, self._device
        if sensor is None or device is None:
            return
        try:
            self._baseline_bytes = sensor.start_peak_window(device, self._pid)
        except Exception:
            self._baseline_bytes = None
        try:
            self._max_at_start = sensor.read_process_max_bytes(device, self._pid)
        except Exception:
            self._max_at_start = None
        self._sampled_peak_bytes = self._baseline_bytes
        self._exact = type(sensor).read_process_peak_bytes is not Sensor.read_process_peak_bytes
        if not self._exact:
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, name="gpupool-probe", daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        sensor, device = self._sensor, self._device
        assert sensor is not None and device is not None
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            try:
                now = sensor.read_process_bytes(device, self._pid)
            except Exception:
                continue
            if now is not None and (
                self._sampled_peak_bytes is None or now > self._sampled_peak_bytes
            ):
                self._sampled_peak_bytes = now

    def stop(self, *, oom: BaseException | None = None) -> PeakReport:
        """Close the window; return the task's peaks and how each was measured."""
        peak: int | None = None
        source = "none"
        sensor, device = self._sensor, self._device
        if sensor is None or device is None:
            _torch_peak_bytes(
                None
            )  # still give cached blocks back: an idle worker keeps its context only
        else:
            if self._exact:
                try:
                    peak = sensor.read_process_peak_bytes(device, self._pid)
                except Exception:
                    peak = None
                source = "simulator" if sensor.name == "simulator" else f"{sensor.name}-exact"
            else:
                self._stop.set()
                if self._sampler is not None:
                    self._sampler.join()
                    self._sampler = None
                try:
                    now = sensor.read_process_bytes(device, self._pid)
                except Exception:
                    now = None
                peak = max(
                    (v for v in (self._sampled_peak_bytes, now) if v is not None), default=None
                )
                source = f"{sensor.name}-sampled"
                try:
                    lifetime_max = sensor.read_process_max_bytes(device, self._pid)
                except Exception:
                    lifetime_max = None
                if lifetime_max is not None and lifetime_max > (self._max_at_start or 0):
                    # The driver's own maximum rose during this task: it is this
                    # task's peak, and it misses no spike.
                    peak, source = lifetime_max, f"{sensor.name}-accounting"
            torch_peak = _torch_peak_bytes(self._baseline_bytes)
            if torch_peak is not None and (peak is None or torch_peak > peak):
                peak, source = torch_peak, "torch+baseline"
        requested = requested_bytes_of(oom) if oom is not None else None
        rss = read_rss_high_water()
        return PeakReport(
            device=self._device_index,
            device_peak_bytes=peak,
            device_source=source if peak is not None else "none",
            baseline_bytes=self._baseline_bytes,
            rss_peak_bytes=rss,
            rss_source="vmhwm" if rss is not None else "none",
            oom=oom is not None,
            oom_requested_bytes=requested,
        )


def _torch_peak_bytes(baseline_bytes: int | None) -> int | None:
    """torch's reserved peak plus the pre-task baseline, then reset and return cached blocks.

    Only when the task initialised CUDA itself: the probe never creates a context.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        peak = int(cuda.max_memory_reserved())
        cuda.reset_peak_memory_stats()
        cuda.empty_cache()
    except Exception:
        return None
    return peak + (baseline_bytes or 0)
