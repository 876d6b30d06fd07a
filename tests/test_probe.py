"""The child-side probe: device OOM recognition, and one task's peak measured honestly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import standin_cupy
import standin_jax
import standin_torch

sys.path.insert(0, str(Path(__file__).parent / "sensors"))
from fake_pynvml import FakePynvml, h100

from gpupool import GpuPoolExecutor
from gpupool._child.probe import (
    CONTEXT_ESTIMATE_BYTES,
    Probe,
    allocator_cap_message,
    allocator_cap_state,
    apply_allocator_cap,
    is_device_oom,
    read_allocator_cap_message,
    release_caches,
    requested_bytes_of,
)
from gpupool._core.units import GiB, MiB
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
    # The host RSS is still measured: this process's, plus that of any process alive under
    # it (the test process may have children left by earlier tests, a resource tracker).
    assert report.rss_source in ("vmhwm", "vmhwm+descendants")


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


def _nvml_probe(monkeypatch, card, torch_module=None, *, cupy_module=None, jax_module=None):
    """A probe over NvmlSensor on a fake pynvml card, with optional stand-in frameworks."""
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml([card]))
    for name, module in (("torch", torch_module), ("cupy", cupy_module)):
        if module is not None:
            monkeypatch.setitem(sys.modules, name, module)
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    for name in ("jax", "jax._src", "jax._src.xla_bridge"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    if jax_module is not None:
        standin_jax.install(_Setter(monkeypatch), jax_module)
    sensor = NvmlSensor()
    info = sensor.read_devices()[0]
    return Probe(sensor, info, 0, os.getpid())


class _Setter:
    """``sys.modules[name] = module`` through monkeypatch, so the test undoes it."""

    def __init__(self, monkeypatch):
        self._monkeypatch = monkeypatch

    def __setitem__(self, name, module):
        self._monkeypatch.setitem(sys.modules, name, module)


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
    assert (report.context_bytes, report.context_source) == (context, "process-row")


def test_hidden_rows_price_an_estimated_context_and_say_so(monkeypatch):
    """Where the driver lists no rows (MIG, containers), torch's peak gets the context estimate,
    and the report says the context was estimated, with the figure."""
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), torch)
    probe.start()
    torch.cuda.allocate(8 * GiB)
    report = probe.stop()
    assert report.device_peak_bytes == 8 * GiB + CONTEXT_ESTIMATE_BYTES
    assert report.device_source == "torch+context-estimated"
    assert (report.context_bytes, report.context_source) == (
        CONTEXT_ESTIMATE_BYTES,
        "estimated (default)",
    )


def test_a_zero_reading_is_not_a_measured_peak(monkeypatch):
    """A driver that reports 0 bytes for our row (containers, 535.113-560) measures nothing."""
    probe = _nvml_probe(monkeypatch, h100(0, compute=[(os.getpid(), 0)]))
    probe.start()
    report = probe.stop()
    assert report.device_peak_bytes is None
    assert report.device_source == "none"
    assert report.baseline_bytes is None


def test_zero_readings_with_torch_use_the_estimate(monkeypatch):
    """With 0-byte rows and torch in use, the peak is torch's plus the estimate, never 0."""
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    probe = _nvml_probe(monkeypatch, h100(0, compute=[(os.getpid(), 0)]), torch)
    probe.start()
    torch.cuda.allocate(GiB)
    report = probe.stop()
    assert report.device_peak_bytes == GiB + CONTEXT_ESTIMATE_BYTES
    assert report.context_source == "estimated (default)"


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
    import gpupool._child.probe as probe_module

    monkeypatch.setattr(probe_module, "_CAP", probe_module._CapState())
    return probe_module


def test_cap_is_set_at_cuda_initialisation_and_creates_no_context(monkeypatch, fresh_cap):
    """(ask - context)/total is set inside torch's lazy initialisation, never before, creating
    no context (the context not measured yet: its estimate)."""
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    apply_allocator_cap(4 * GiB)
    assert torch.cuda.fractions == []  # CUDA is not initialised: nothing is set yet
    assert torch.cuda.contexts_created == 0
    assert not torch.cuda.is_initialized()
    torch.cuda._lazy_init()  # the task's first CUDA call
    assert torch.cuda.fractions == [_fraction(4 * GiB, 16 * GiB, "initializing")]
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
    expected = [(ask - CONTEXT_ESTIMATE_BYTES) / (16 * GiB) for ask in (4 * GiB, 8 * GiB)]
    assert [f for f, _, _ in torch.cuda.fractions] == [*expected, 1.0]


def test_cap_waits_for_torch_to_be_imported(monkeypatch, fresh_cap):
    """An ask that arrives before the task imports torch is armed when the task starts."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    apply_allocator_cap(2 * GiB)
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)  # the task's module imported torch
    Probe(None, None, None, os.getpid()).start()
    torch.cuda._lazy_init()
    assert torch.cuda.fractions == [_fraction(2 * GiB, 16 * GiB, "initializing")]


def test_cap_messages_round_trip_and_are_not_tasks():
    """The parent's cap message carries the ask; a pickled task is never read as one."""
    assert read_allocator_cap_message(allocator_cap_message(123456)) == 123456
    import pickle

    assert read_allocator_cap_message(pickle.dumps((print, (), {}))) is None
    assert read_allocator_cap_message(b"gpupool-allocator-cap:12x") is None


def _fraction(ask_bytes, total_bytes, when, context_bytes=CONTEXT_ESTIMATE_BYTES):
    return ((ask_bytes - context_bytes) / total_bytes, 0, when)


def test_pool_caps_each_worker_at_its_booked_ask_less_its_context(tmp_path):
    """Through a real pool, a worker's torch allocator is capped at its task's ask less its
    context (estimated at the first task, measured from its row after), and the decision log
    names the context a peak was priced with and says the cap binds torch's allocator only."""
    import json

    log = tmp_path / "log.jsonl"
    with SimulatedHost([SimulatedDevice("16GiB")], context="1GiB"):
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="4GiB",
            cap_allocator=True,
            log_path=log,
            initializer=standin_torch.install_in_worker,
            initargs=(16 * GiB, True),
        ) as ex:
            first = ex.submit(standin_torch.capped_task, GiB).result(timeout=60)
            overrun = ex.submit(standin_torch.capped_task, 6 * GiB).result(timeout=60)
    assert first["fractions_before"] == []  # nothing set before the task initialised CUDA
    assert first["fractions"][0] == _fraction(4 * GiB, 16 * GiB, "initializing")
    assert first["outcome"] == "ok"
    state = overrun["state"]
    assert (state["outside_bytes"], state["outside_source"]) == (GiB, "process-row")
    assert state["fraction"] == (state["ask_bytes"] - GiB) / (16 * GiB)
    assert overrun["outcome"] == "oom-inside"  # the overrun failed inside its own process
    records = [json.loads(line) for line in log.read_text().splitlines()]
    notes = [r.get("allocator_cap") for r in records if r["event"] == "constructed"]
    assert notes and all("binds torch's allocator only" in (note or "") for note in notes)
    measured = [r for r in records if r.get("peak_source") == "simulator"]
    assert measured and measured[0]["context_bytes"] == GiB
    assert measured[0]["context_source"] == "process-row"


def test_cap_allocator_must_be_a_bool():
    """cap_allocator='yes' is refused with a message naming the value."""
    from gpupool import ConfigurationError

    with SimulatedHost([SimulatedDevice("16GiB")]):
        with pytest.raises(ConfigurationError, match=r"^cap_allocator='yes': pass True or False"):
            GpuPoolExecutor(cap_allocator="yes")


# -- out-of-memory texts whose type was lost -------------------------------------------------


@pytest.mark.parametrize(
    ("message", "requested"),
    [
        ("CUDA driver error: out of memory", None),
        ("INTERNAL: Failed to allocate 1073741824 bytes for new constant", GiB),
        (
            "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,073,741,824 bytes "
            "(allocated so far: 2,147,483,648 bytes).",
            GiB,
        ),
        ("Out of memory allocating 512 bytes (allocated so far: 0 bytes).", 512),
    ],
    ids=["torch-driver", "xla-constant", "cupy-text", "cupy-bare"],
)
def test_oom_texts_are_recognised_with_their_size(message, requested):
    """torch's driver OOM, XLA's constant allocation and CuPy's text are device OOMs by their
    words alone (a plain RuntimeError), with the failed allocation's size where they give it."""
    exc = RuntimeError(message)
    assert is_device_oom(exc)
    assert requested_bytes_of(exc) == requested


def test_cupy_requested_bytes_are_not_the_allocated_so_far():
    """CuPy's "allocated so far: M bytes" is not the failed allocation's size."""
    exc = RuntimeError("Out of memory allocating 2,048 bytes (allocated so far: 4,096 bytes).")
    assert requested_bytes_of(exc) == 2048


# -- a measured context, every framework's counters -------------------------------------------


def test_the_context_is_measured_from_the_process_row_on_the_simulator(monkeypatch):
    """A 900 MiB context, more than any constant allowance, is measured from the process's own
    row once CUDA is up (row less torch's reserved bytes), and the report names it."""
    with SimulatedHost([SimulatedDevice("80GiB")], context="900MiB") as host:
        torch = standin_torch.make_torch(total_bytes=80 * GiB)
        standin_torch.mirror_to_simulator(torch.cuda)
        monkeypatch.setitem(sys.modules, "torch", torch)
        monkeypatch.delitem(sys.modules, "cupy", raising=False)
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        probe = Probe(host.sensor(), info, 0, os.getpid())
        probe.start()
        torch.cuda.allocate(2 * GiB)
        report = probe.stop()
    assert report.device_peak_bytes == 2 * GiB + 900 * MiB
    assert (report.context_bytes, report.context_source) == (900 * MiB, "process-row")


def test_a_task_that_resets_torchs_peak_still_reports_it(monkeypatch):
    """torch.cuda.reset_peak_memory_stats() called by the task itself does not lose its peak."""
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), torch)
    probe.start()
    torch.cuda.allocate(8 * GiB)
    torch.cuda.free(8 * GiB)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the task's own, between two of its phases
    torch.cuda.allocate(GiB)
    report = probe.stop()
    assert report.device_peak_bytes == 8 * GiB + CONTEXT_ESTIMATE_BYTES
    second = probe.start(), probe.stop()  # the next task starts afresh
    assert second[1].device_peak_bytes == GiB + CONTEXT_ESTIMATE_BYTES


def test_cupy_pool_bytes_are_a_peak_source(monkeypatch):
    """CuPy's pool (what it holds from the driver, cached blocks included) prices the peak
    where no row does, and the source names CuPy."""
    cupy = standin_cupy.make_cupy()
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), cupy_module=cupy)
    pool = cupy.get_default_memory_pool()
    probe.start()
    pool.malloc(3 * GiB)
    pool.free(3 * GiB)  # cached in the pool until the probe releases it
    report = probe.stop()
    assert report.device_peak_bytes == 3 * GiB + CONTEXT_ESTIMATE_BYTES
    assert report.device_source == "cupy+context-estimated"
    assert pool.freed == 1 and pool.total == 0


def test_jax_peak_counts_once_its_gpu_backend_is_up(monkeypatch):
    """JAX's device peak (peak_bytes_in_use / peak_pool_bytes) prices the peak, named jax."""
    jax = standin_jax.make_jax()
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), jax_module=jax)
    probe.start()
    device = standin_jax.initialise(jax)  # the task's first JAX call
    device.allocate(5 * GiB)
    device.free(5 * GiB)
    report = probe.stop()
    assert report.device_peak_bytes == 5 * GiB + CONTEXT_ESTIMATE_BYTES
    assert report.device_source == "jax+context-estimated"


def test_jax_imported_without_a_backend_is_never_initialised(monkeypatch):
    """With jax imported but no backend started, the probe asks JAX for nothing."""
    jax = standin_jax.make_jax()
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), jax_module=jax)
    probe.start()
    report = probe.stop()
    assert jax.contexts_created == 0
    assert jax.standin_device.stats_calls == 0
    assert report.device_source == "none"


def test_frameworks_used_together_are_summed(monkeypatch):
    """torch and CuPy in one task: both allocators' peaks plus the context, both named."""
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    cupy = standin_cupy.make_cupy()
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), torch, cupy_module=cupy)
    probe.start()
    torch.cuda.allocate(2 * GiB)
    cupy.get_default_memory_pool().malloc(3 * GiB)
    report = probe.stop()
    assert report.device_peak_bytes == 5 * GiB + CONTEXT_ESTIMATE_BYTES
    assert report.device_source == "torch+cupy+context-estimated"


def test_cupy_held_bytes_are_not_taken_for_context(monkeypatch):
    """With a row, what CuPy's pool holds is CuPy's, not context: context = row - every pool."""
    pid = os.getpid()
    card = h100(0)
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    cupy = standin_cupy.make_cupy()
    pool = cupy.get_default_memory_pool()
    context = 400 * MiB

    def rows(_):
        held = context + torch.cuda.reserved_bytes + pool.total
        card.compute = [(pid, held)]
        card.free = card.total - card.reserved - held  # the card's used bytes hold the row

    torch.cuda.on_change = rows
    pool.on_change = rows
    probe = _nvml_probe(monkeypatch, card, torch, cupy_module=cupy)
    probe.start()
    torch.cuda.allocate(GiB)
    pool.malloc(2 * GiB)
    report = probe.stop()
    assert report.context_bytes == context
    assert report.device_peak_bytes == 3 * GiB + context


@contextlib.contextmanager
def _a_child() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this process that lives until the block ends (it reads its stdin to the end)."""
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as child:
        assert child.stdin is not None
        yield child
        child.stdin.close()


def test_a_childs_bytes_are_the_tasks_peak_never_the_workers_context(monkeypatch, fresh_cap):
    """A child holding 4 GiB beside a worker with a 500 MiB context: the task's peak counts the
    child, the context is the worker's own row less torch's (500 MiB, not 4.5 GiB), and the
    next task's cap leaves out only that."""
    pid = os.getpid()
    card = h100(0)
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    context = 500 * MiB
    with _a_child() as child:

        def rows(cuda):
            held = context + cuda.reserved_bytes
            card.compute = [(pid, held), (child.pid, 4 * GiB)]
            card.free = card.total - card.reserved - held - 4 * GiB

        torch.cuda.on_change = rows
        probe = _nvml_probe(monkeypatch, card, torch)
        probe.start()
        torch.cuda.allocate(GiB)
        report = probe.stop()
    assert report.device_peak_bytes == 5 * GiB + context
    assert (report.context_bytes, report.context_source) == (context, "process-row")
    apply_allocator_cap(8 * GiB)
    assert allocator_cap_state()["outside_bytes"] == context
    assert torch.cuda.fractions[-1][0] == (8 * GiB - context) / (80 * GiB)


def _child_holding_rows(card, pid, child_pid, context, child_bytes):
    """The driver's rows: the worker at its context only (a spike sampling missed), a child."""
    card.compute = [(pid, context), (child_pid, child_bytes)]
    card.free = card.total - card.reserved - context - child_bytes


def test_a_workers_counted_spike_is_added_to_its_childs_bytes(monkeypatch):
    """torch's 8 GiB spike (missed by sampling, kept by torch's counter) beside a child's 4 GiB:
    the peak is both with the context, 12.5 GiB, not the worker's 8.5 GiB alone."""
    pid = os.getpid()
    card = h100(0)
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    context = 500 * MiB
    with _a_child() as child:
        _child_holding_rows(card, pid, child.pid, context, 4 * GiB)
        probe = _nvml_probe(monkeypatch, card, torch)
        probe.start()
        torch.cuda.allocate(8 * GiB)
        torch.cuda.free(8 * GiB)
        torch.cuda.empty_cache()
        report = probe.stop()
    assert report.device_peak_bytes == 12 * GiB + context
    assert report.device_source == "torch+context+descendants"


def test_the_workers_accounting_maximum_is_added_to_its_childs_bytes(monkeypatch):
    """NVML accounting's maximum is the worker's own: a child's 4 GiB are added to it."""
    pid = os.getpid()
    context = 500 * MiB
    card = h100(0, accounting={pid: context})
    with _a_child() as child:
        _child_holding_rows(card, pid, child.pid, context, 4 * GiB)
        probe = _nvml_probe(monkeypatch, card)
        probe.start()
        card.accounting = {pid: 8 * GiB + context}  # a spike the driver kept, sampling missed
        report = probe.stop()
    assert report.device_peak_bytes == 12 * GiB + context
    assert report.device_source == "nvml-accounting+descendants"


# -- the cap leaves room for what torch does not hold -----------------------------------------


def test_cap_is_the_ask_less_what_the_process_holds_outside_torch(monkeypatch, fresh_cap):
    """A 4 GiB ask caps torch at 4 GiB less the context: the estimate before one was measured,
    the measured 1 GiB after, so torch plus the context never passes the booking."""
    pid = os.getpid()
    card = h100(0)
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    context = GiB

    def rows(cuda):
        card.compute = [(pid, context + cuda.reserved_bytes)]
        card.free = card.total - card.reserved - context - cuda.reserved_bytes

    torch.cuda.on_change = rows
    probe = _nvml_probe(monkeypatch, card, torch)
    apply_allocator_cap(4 * GiB)
    probe.start()
    torch.cuda.allocate(MiB)  # the task's first CUDA call: the cap is set at initialisation
    probe.stop()
    assert torch.cuda.fractions[0][0] == (4 * GiB - CONTEXT_ESTIMATE_BYTES) / (16 * GiB)
    apply_allocator_cap(4 * GiB)  # the next task, with the same ask
    assert torch.cuda.fractions[-1][0] == 3 * GiB / (16 * GiB)
    state = allocator_cap_state()
    assert (state["outside_bytes"], state["outside_source"]) == (GiB, "process-row")


def test_cap_subtracts_the_other_frameworks_pools(monkeypatch, fresh_cap):
    """What CuPy's pool holds when the cap is set is outside torch too: it is left out of it."""
    torch = standin_torch.make_torch(total_bytes=16 * GiB)
    cupy = standin_cupy.make_cupy()
    cupy.get_default_memory_pool().malloc(GiB)  # a live CuPy array the task keeps
    probe = _nvml_probe(monkeypatch, h100(0, processes_supported=False), torch, cupy_module=cupy)
    torch.cuda.allocate(MiB)  # CUDA is up
    apply_allocator_cap(4 * GiB)
    probe.start()
    probe.stop()
    expected = (4 * GiB - GiB - CONTEXT_ESTIMATE_BYTES) / (16 * GiB)
    assert torch.cuda.fractions[-1][0] == expected


def test_a_framework_the_task_loads_during_its_window_is_measured(monkeypatch):
    """No framework is loaded when the window opens (the probe then asks none); the task
    imports torch and allocates: its peak and the estimated context are the report's."""
    for name in ("torch", "cupy", "jax", "jax._src", "jax._src.xla_bridge"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    probe = Probe(None, None, None, os.getpid())
    probe.start()
    monkeypatch.setitem(sys.modules, "torch", torch)  # the task's import
    torch.cuda.allocate(2 * GiB)
    report = probe.stop()
    assert report.device_peak_bytes == 2 * GiB + CONTEXT_ESTIMATE_BYTES
    assert report.device_source == "torch+context-estimated"


def test_a_window_without_any_framework_reports_no_device_peak(monkeypatch):
    """No framework before, during or after the window, no device: nothing on the device."""
    for name in ("torch", "cupy", "jax", "jax._src", "jax._src.xla_bridge"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    probe = Probe(None, None, None, os.getpid())
    probe.start()
    report = probe.stop()
    assert (report.device_peak_bytes, report.device_source) == (None, "none")
    assert (report.context_bytes, report.context_source) == (None, "none")


def test_a_rejected_reading_of_an_unchanged_card_is_named_in_every_window():
    """The card's reading is the same object from window to window (nothing changed on the
    simulated card), and its row is rejected (a 1 MiB context, below any real one): each
    window's report still says why, and neither takes the row as a measurement."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="1MiB") as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        with hold(0):
            pass  # the context alone stays charged: this process's row is 1 MiB
        probe = Probe(host.sensor(), info, 0, os.getpid())
        reports = []
        for _ in range(2):
            probe.start()
            reports.append(probe.stop())
    for report in reports:
        assert any("context" in reason for reason in report.rejected_readings), report
        assert report.context_bytes is None  # the row was never read as the context


def test_cap_takes_out_what_the_workers_descendants_hold_and_follows_them(monkeypatch, fresh_cap):
    """Booked 6 GiB, a 700 MiB context and a child holding 3 GiB: torch is capped at what is
    left (2.3 GiB, not 5.3 GiB), set again when the child grows to 5 GiB (0.3 GiB left), and
    the child's bytes leave the cap once it has gone."""
    pid = os.getpid()
    card = h100(0)
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    context = 700 * MiB
    child_bytes = [3 * GiB]
    with _a_child() as child:

        def rows(cuda=None):
            held = context + torch.cuda.reserved_bytes
            card.compute = [(pid, held), (child.pid, child_bytes[0])]
            card.free = card.total - card.reserved - held - child_bytes[0]

        rows()
        torch.cuda.on_change = rows
        probe = _nvml_probe(monkeypatch, card, torch)
        torch.cuda.allocate(0)  # the worker's CUDA initialised: its row is its context
        probe.start()
        probe.stop()  # the first task measures the context from the worker's row
        apply_allocator_cap(6 * GiB)
        probe.start()  # the tree's first reading sees the child
        state = allocator_cap_state()
        assert state["descendant_bytes"] == 3 * GiB
        assert state["outside_bytes"] == context + 3 * GiB
        assert torch.cuda.fractions[-1][0] == (6 * GiB - context - 3 * GiB) / (80 * GiB)
        child_bytes[0] = 5 * GiB
        rows()
        probe._sample(frozenset({pid, child.pid}))  # the sampler's next reading
        assert allocator_cap_state()["descendant_bytes"] == 5 * GiB
        assert torch.cuda.fractions[-1][0] == (6 * GiB - context - 5 * GiB) / (80 * GiB)
        child_bytes[0] = 0
        card.compute = [(pid, context)]
        probe.stop()
    assert allocator_cap_state()["descendant_bytes"] == 0


def test_a_co_tenant_under_the_workers_pid_is_refused_not_taken_for_its_context(
    monkeypatch, fresh_cap
):
    """In a container the driver lists host PIDs: a co-tenant's 9 GiB under the PID this worker
    has in its namespace, beside torch's 768 MiB, is not an 8.25 GiB context (nor a cap of
    almost 0): the row is refused as implausible, with the reason, and the context estimated."""
    from gpupool._child.probe import CONTEXT_PLAUSIBLE_MAX_BYTES

    pid = os.getpid()
    card = h100(0)
    card.compute = [(pid, 9 * GiB)]  # another namespace's process, under this worker's PID
    card.free = card.total - card.reserved - 9 * GiB
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    probe = _nvml_probe(monkeypatch, card, torch)
    torch.cuda.allocate(0)
    probe.start()
    torch.cuda.allocate(768 * MiB)
    report = probe.stop()
    assert 9 * GiB - 768 * MiB > CONTEXT_PLAUSIBLE_MAX_BYTES
    assert (report.context_bytes, report.context_source) == (
        CONTEXT_ESTIMATE_BYTES,
        "estimated (default)",
    )
    assert report.device_peak_bytes == 768 * MiB + CONTEXT_ESTIMATE_BYTES
    assert any("another PID namespace" in reason for reason in report.rejected_readings)
    apply_allocator_cap(4 * GiB)
    assert allocator_cap_state()["outside_bytes"] == CONTEXT_ESTIMATE_BYTES


def test_a_co_tenant_under_the_workers_pid_within_a_plausible_context_is_taken_for_it(
    monkeypatch, fresh_cap
):
    """The limit of the PID-collision check: a co-tenant's 5 GiB under this worker's PID (read
    while torch holds nothing) is within what a context could be (6 GiB): nothing tells it from
    the worker's context, and it is taken as one (docs/readings.md)."""
    from gpupool._child.probe import CONTEXT_PLAUSIBLE_MAX_BYTES

    pid = os.getpid()
    card = h100(0)
    card.compute = [(pid, 5 * GiB)]
    card.free = card.total - card.reserved - 5 * GiB
    torch = standin_torch.make_torch(total_bytes=80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    probe = _nvml_probe(monkeypatch, card, torch)
    torch.cuda.allocate(0)
    probe.start()
    torch.cuda.allocate(768 * MiB)
    report = probe.stop()
    assert 5 * GiB <= CONTEXT_PLAUSIBLE_MAX_BYTES
    assert (report.context_bytes, report.context_source) == (5 * GiB, "process-row")
    assert not any("another PID namespace" in reason for reason in report.rejected_readings)
