"""The child-side probe: device OOM recognition, and one task's peak measured honestly."""

from __future__ import annotations

import os

import pytest

from gpupool._core.units import GiB, MiB
from gpupool._probe import Probe, is_device_oom, requested_bytes_of
from gpupool._sensors.base import DeviceInfo
from gpupool.testing import SimulatedDevice, SimulatedHost, SimulatedOutOfMemory, hold


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 44.39 GiB total capacity)",
        "CUDA error: out of memory",
        "CudaAPIError: [2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY",
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6461325312 bytes.",
        "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cudaErrorMemoryAllocation: out of memory",
    ],
    ids=["torch", "torch-raw", "numba", "jax", "cublas", "cupy-runtime"],
)
def test_device_oom_messages_are_recognised(message):
    """The messages of torch, numba, JAX, cuBLAS and CUDA runtime OOMs are device OOMs."""
    assert is_device_oom(RuntimeError(message))


def test_oom_types_are_recognised_by_module_and_name():
    """An exception class named like CuPy's OutOfMemoryError is a device OOM, whatever it says."""
    cupy_oom = type("OutOfMemoryError", (MemoryError,), {"__module__": "cupy.cuda.memory"})
    assert is_device_oom(cupy_oom("Out of memory allocating 1,024 bytes"))
    assert is_device_oom(
        SimulatedOutOfMemory(device=0, requested_bytes=1, used_bytes=2, total_bytes=2)
    )


@pytest.mark.parametrize(
    "exc",
    [MemoryError(), ValueError("index out of range"), RuntimeError("out of patience")],
    ids=["host-memory", "value", "unrelated"],
)
def test_other_errors_are_not_device_ooms(exc):
    """A host MemoryError and unrelated errors are not device OOMs."""
    assert not is_device_oom(exc)


def test_requested_bytes_come_from_the_message_or_the_attribute():
    """The failed allocation's size is read from torch's message or the simulator's attribute."""
    assert requested_bytes_of(RuntimeError("Tried to allocate 2.00 GiB")) == 2 * GiB
    assert requested_bytes_of(RuntimeError("Tried to allocate 512.00 MiB")) == 512 * MiB
    sim = SimulatedOutOfMemory(device=0, requested_bytes=123, used_bytes=1, total_bytes=2)
    assert requested_bytes_of(sim) == 123
    assert requested_bytes_of(RuntimeError("out of memory")) is None


def test_probe_measures_a_task_window_on_the_simulator():
    """The probe reports the task's own high-water, the context included, from the ledger."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        sensor = host.sensor()
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        with hold("1GiB"):
            pass  # the context stays charged, as a real one does
        probe = Probe(sensor, info, 0, os.getpid())
        probe.start()
        with hold("3GiB"):
            pass
        report = probe.stop()
    assert report.device_peak_bytes == 3 * GiB + 300 * MiB
    assert report.baseline_bytes == 300 * MiB
    assert report.device_source == "simulator"
    assert report.rss_peak_bytes is not None and report.rss_peak_bytes > 0
    assert report.oom is False


def test_probe_without_a_device_reports_only_the_host():
    """A worker without a device reports no device peak, and says so."""
    probe = Probe(None, None, None, os.getpid())
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert report.device_source == "none"
    assert report.rss_source == "vmhwm"


def test_torch_oom_is_recognised_and_the_probe_creates_no_context():
    """torch's OutOfMemoryError is a device OOM, and the probe never initialises CUDA itself."""
    torch = pytest.importorskip("torch", reason="the torch extra (CPU wheel) is not installed")
    assert is_device_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB"))
    with SimulatedHost([SimulatedDevice("16GiB")], context="0MiB") as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        probe = Probe(host.sensor(), info, 0, os.getpid())
        probe.start()
        torch.ones(4).sum()
        report = probe.stop()
    assert report.device_source == "simulator"
    assert not torch.cuda.is_initialized()


def test_torch_peak_counts_when_the_task_initialised_cuda(monkeypatch):
    """With CUDA initialised by the task, torch's reserved peak plus the baseline is reported,
    and the cached blocks are returned afterwards."""
    import sys
    import types

    calls: list[str] = []
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        max_memory_reserved=lambda: 5 * GiB,
        reset_peak_memory_stats=lambda: calls.append("reset"),
        empty_cache=lambda: calls.append("empty_cache"),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        with hold("1GiB"):
            pass  # the context is charged: the baseline
        probe = Probe(host.sensor(), info, 0, os.getpid())
        probe.start()
        report = probe.stop()
    assert report.device_source == "torch+baseline"
    assert report.device_peak_bytes == 5 * GiB + 300 * MiB
    assert calls == ["reset", "empty_cache"]
