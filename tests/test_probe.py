"""The child-side probe: device OOM recognition, and one task's peak measured honestly."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import standin_torch

sys.path.insert(0, str(Path(__file__).parent / "sensors"))
from fake_pynvml import FakePynvml, h100

from gpupool import GpuPoolExecutor
from gpupool._core.units import GiB, MiB
from gpupool._probe import (
    CONTEXT_ALLOWANCE_BYTES,
    Probe,
    allocator_cap_message,
    allocator_cap_state,
    apply_allocator_cap,
    is_device_oom,
    read_allocator_cap_message,
    release_caches,
    requested_bytes_of,
)
from gpupool._sensors.base import DeviceInfo
from gpupool._sensors.nvml import NvmlSensor
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
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (the nox tests session installs the CPU wheel)"
    )
    assert is_device_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB"))
    with SimulatedHost([SimulatedDevice("16GiB")], context="0MiB") as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        probe = Probe(host.sensor(), info, 0, os.getpid())
        probe.start()
        torch.ones(4).sum()
        report = probe.stop()
    assert report.device_source == "simulator"
    assert not torch.cuda.is_initialized()


# -- item 4: every framework's out-of-memory, and wrapped ones ------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 15.65G. "
        "That was not possible. There are 2.10G free.",
        "Resource exhausted: Failed to allocate request for 32.00MiB (33554432B) on device 0",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`",
        "NCCL WARN Cuda failure 'out of memory'",
        "NCCL error: unhandled cuda error, NCCL version 2.18.1 Cuda failure 2 'out of memory'",
        "cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/THCCachingAllocator.cpp",
        "OOM when allocating tensor with shape[8192,8192] and type float on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
    ],
    ids=["pjrt", "xla", "cudnn", "cusolver", "nccl", "nccl-code", "old-torch", "tensorflow"],
)
def test_every_frameworks_oom_is_recognised(message):
    """JAX/PJRT, XLA, cuDNN, cuSOLVER, NCCL, torch 0.x and TensorFlow OOMs are device OOMs."""
    assert is_device_oom(RuntimeError(message))


def test_a_quota_resource_exhausted_is_not_an_oom():
    """RESOURCE_EXHAUSTED that is about a quota, not an allocation, is not a device OOM."""
    assert not is_device_oom(RuntimeError("RESOURCE_EXHAUSTED: quota exceeded for requests"))


def _raise_wrapped(how: str) -> BaseException:
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        try:
            raise oom
        except RuntimeError as inner:
            if how == "cause":
                raise ValueError("the batch did not fit") from inner
            if how == "context":
                raise KeyError("cleanup failed")  # noqa: B904 (raised while handling the OOM)
            raise ExceptionGroup("tasks failed", [ValueError("other"), inner])  # noqa: B904, F821
    except BaseException as outer:
        return outer
    raise AssertionError("unreachable")


@pytest.mark.parametrize("how", ["cause", "context", "group"])
def test_a_wrapped_oom_is_followed_through_the_chain(how):
    """An OOM raised from, raised while handling, or grouped, is found, with its size."""
    if how == "group" and sys.version_info < (3, 11):
        pytest.skip("exception groups are built in from Python 3.11")
    exc = _raise_wrapped(how)
    assert is_device_oom(exc)
    assert requested_bytes_of(exc) == 2 * GiB


def test_a_chain_that_loops_ends():
    """An exception chain with a cycle is searched once, without looping."""
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert not is_device_oom(a)


def test_requested_bytes_of_xla_and_cupy_messages():
    """XLA's binary "15.65G", "request for 32.00MiB" and CuPy's "1,024 bytes" are read."""
    assert (
        requested_bytes_of(
            RuntimeError(
                "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 2G."
            )
        )
        == 2 * GiB
    )
    assert (
        requested_bytes_of(
            RuntimeError("Resource exhausted: Failed to allocate request for 32.00MiB")
        )
        == 32 * MiB
    )
    assert (
        requested_bytes_of(
            RuntimeError("cudaErrorMemoryAllocation: Out of memory allocating 1,024 bytes")
        )
        == 1024
    )


# -- items 1, 2, 3: peaks that never under-report -------------------------------------------


def _nvml_probe(monkeypatch, card, torch_module=None):
    """A probe over NvmlSensor on a fake pynvml card, with an optional stand-in torch."""
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml([card]))
    if torch_module is not None:
        monkeypatch.setitem(sys.modules, "torch", torch_module)
    else:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    sensor = NvmlSensor()
    info = sensor.read_devices()[0]
    return Probe(sensor, info, 0, os.getpid())


def test_first_task_spike_counts_the_context_it_created(monkeypatch):
    """A first task that creates the context, spikes 8 GiB and frees it, reports 8 GiB + context."""
    pid = os.getpid()
    card = h100(0)  # no row for us: this worker has no context yet
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    context = 500 * MiB

    def rows(cuda):  # the driver's row: the context plus torch's reserved bytes
        card.compute = [(pid, context + cuda.reserved_bytes)]
        card.free = card.total - card.reserved - context - cuda.reserved_bytes

    torch.cuda.on_change = rows
    probe = _nvml_probe(monkeypatch, card, torch)
    probe.start()
    torch.cuda.allocate(8 * GiB)  # a spike shorter than the sampling interval...
    torch.cuda.free(8 * GiB)
    torch.cuda.empty_cache()  # ...freed by the task itself
    report = probe.stop()
    assert report.device_peak_bytes == 8 * GiB + context
    assert report.device_source == "torch+context"


def test_hidden_rows_fall_back_to_the_context_allowance(monkeypatch):
    """Where the driver lists no rows (MIG, containers), torch's peak gets the context allowance."""
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), torch)
    probe.start()
    torch.cuda.allocate(8 * GiB)
    report = probe.stop()
    assert report.device_peak_bytes == 8 * GiB + CONTEXT_ALLOWANCE_BYTES
    assert report.device_source == "torch+context-allowance"


def test_a_zero_reading_is_not_a_measured_peak(monkeypatch):
    """A driver that reports 0 bytes for our row (containers, 535.113-560) measures nothing."""
    probe = _nvml_probe(monkeypatch, h100(0, compute=[(os.getpid(), 0)]))
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert report.device_source == "none"
    assert report.baseline_bytes is None


def test_zero_readings_with_torch_use_the_allowance(monkeypatch):
    """With 0-byte rows and torch in use, the peak is torch's plus the allowance, never 0."""
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    probe = _nvml_probe(monkeypatch, h100(0, compute=[(os.getpid(), 0)]), torch)
    probe.start()
    torch.cuda.allocate(GiB)
    report = probe.stop()
    assert report.device_peak_bytes == GiB + CONTEXT_ALLOWANCE_BYTES


def test_a_small_task_after_a_large_one_reports_its_own_peak(monkeypatch):
    """Peaks reset after empty_cache: a 1 GiB task after a 40 GiB one reports about 1 GiB."""
    pid = os.getpid()
    card = h100(0)
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    context = 500 * MiB

    def rows(cuda):  # the card's used bytes follow the row (nothing else is on it)
        card.compute = [(pid, context + cuda.reserved_bytes)]
        card.free = card.total - card.reserved - context - cuda.reserved_bytes

    torch.cuda.on_change = rows
    probe = _nvml_probe(monkeypatch, card, torch)
    probe.start()
    torch.cuda.allocate(40 * GiB)
    torch.cuda.free(40 * GiB)  # cached, not given back, until the probe releases it
    first = probe.stop()
    probe.start()
    torch.cuda.allocate(GiB)
    torch.cuda.free(GiB)
    second = probe.stop()
    assert first.device_peak_bytes == 40 * GiB + context
    assert second.device_peak_bytes == GiB + context
    calls = torch.cuda.calls
    last_empty = len(calls) - 1 - calls[::-1].index("empty_cache")
    assert calls[last_empty + 1] == "reset_peak_memory_stats"


def test_the_probe_never_initialises_cuda_itself(monkeypatch):
    """With torch imported but CUDA never initialised, the probe asks torch for nothing."""
    torch = standin_torch.make_torch()
    probe = _nvml_probe(monkeypatch, h100(0), torch)
    probe.start()
    report = probe.stop()
    assert not torch.cuda.is_initialized()
    assert torch.cuda.contexts_created == 0
    assert torch.cuda.calls == []
    assert report.device_source == "none"


# -- item 10: every allocator's cache is given back ------------------------------------------


def test_release_caches_frees_torch_and_cupy_pools(monkeypatch):
    """After a task the probe empties torch's cache and CuPy's device and pinned pools."""
    torch, cupy = standin_torch.make_torch(), standin_torch.make_cupy()
    torch.cuda.allocate(GiB)
    torch.cuda.free(GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    release_caches()
    assert torch.cuda.reserved_bytes == 0
    assert cupy.get_default_memory_pool().freed == 1
    assert cupy.get_default_pinned_memory_pool().freed == 1


# -- the allocator cap -----------------------------------------------------------------------


@pytest.fixture
def fresh_cap(monkeypatch):
    """The cap's process-wide state, reset for one test."""
    import gpupool._probe as probe_module

    monkeypatch.setattr(probe_module, "_CAP", probe_module._CapState())
    return probe_module


def test_cap_is_set_at_cuda_initialisation_and_creates_no_context(monkeypatch, fresh_cap):
    """ask/total is set inside torch's lazy initialisation, never before, creating no context."""
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    apply_allocator_cap(4 * GiB)
    assert torch.cuda.fractions == []  # CUDA is not initialised: nothing is set yet
    assert torch.cuda.contexts_created == 0
    assert not torch.cuda.is_initialized()
    torch.cuda._lazy_init()  # the task's first CUDA call
    assert torch.cuda.fractions == [(0.25, 0, "initializing")]
    assert torch.cuda.contexts_created == 0
    assert allocator_cap_state()["error"] is None


def test_cap_is_reset_when_the_ask_changes(monkeypatch, fresh_cap):
    """Once CUDA is up, a new ask sets a new fraction; the same ask sets nothing again."""
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    apply_allocator_cap(4 * GiB)
    torch.cuda.allocate(MiB)
    apply_allocator_cap(8 * GiB)
    apply_allocator_cap(8 * GiB)
    apply_allocator_cap(32 * GiB)  # more than the card: capped at the whole card
    assert [f for f, _, _ in torch.cuda.fractions] == [0.25, 0.5, 1.0]


def test_cap_waits_for_torch_to_be_imported(monkeypatch, fresh_cap):
    """An ask that arrives before the task imports torch is armed when the task starts."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    apply_allocator_cap(2 * GiB)
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)  # the task's module imported torch
    Probe(None, None, None, os.getpid()).start()
    torch.cuda._lazy_init()
    assert torch.cuda.fractions == [(0.125, 0, "initializing")]


def test_cap_messages_round_trip_and_are_not_tasks():
    """The parent's cap message carries the ask; a pickled task is never read as one."""
    assert read_allocator_cap_message(allocator_cap_message(123456)) == 123456
    import pickle

    assert read_allocator_cap_message(pickle.dumps((print, (), {}))) is None
    assert read_allocator_cap_message(b"gpupool-allocator-cap:12x") is None


def test_pool_caps_each_worker_at_its_booked_ask(tmp_path):
    """Through a real pool, a worker's torch allocator is capped at its task's ask / total,
    and the decision log says the cap covers torch's allocator only."""
    import json

    log = tmp_path / "log.jsonl"
    with SimulatedHost([SimulatedDevice("16GiB")], context="0MiB"):
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="4GiB",
            cap_allocator=True,
            log_path=log,
            initializer=standin_torch.install_in_worker,
            initargs=(16 * GiB,),
        ) as ex:
            first = ex.submit(standin_torch.capped_task, GiB).result(timeout=60)
            overrun = ex.submit(standin_torch.capped_task, 6 * GiB).result(timeout=60)
    assert first["fractions_before"] == []  # nothing set before the task initialised CUDA
    assert first["fractions"][0] == (0.25, 0, "initializing")
    assert first["outcome"] == "ok"
    fraction = overrun["state"]["fraction"]
    assert fraction is not None and fraction <= 0.25
    assert overrun["outcome"] == "oom-inside"  # the overrun failed inside its own process
    records = [json.loads(line) for line in log.read_text().splitlines()]
    notes = [r.get("allocator_cap") for r in records if r["event"] == "constructed"]
    assert notes and all("torch's allocator only" in (note or "") for note in notes)


def test_cap_allocator_must_be_a_bool():
    """cap_allocator='yes' is refused with a message naming the value."""
    from gpupool import ConfigurationError

    with SimulatedHost([SimulatedDevice("16GiB")]):
        with pytest.raises(ConfigurationError, match=r"^cap_allocator='yes': pass True or False"):
            GpuPoolExecutor(cap_allocator="yes")
