"""The device check's worker side: the tasks its pools run, and the card read without the
library's rows.

``bench/gpu_check.py`` is the command; this module holds what runs in the pool's
workers (and the readings and helper processes the parent shares with them). The
workers import it by name: the command puts ``bench/`` on their ``PYTHONPATH``
(gpupool pickles a task by reference when the parent can import its module, so
the workers must be able to import it too). It imports gpupool only inside its
functions, so it imports before ``src/`` is on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2

#: One task or one helper process waits at most this long.
WAIT_S = 120.0
SIMULATOR_ENV = "GPUPOOL_SIMULATOR"
#: The source tree's tests: the dry run's stand-in torch (``standin_torch.py``) and NVML double.
TESTS = Path(__file__).resolve().parent.parent / "tests"
#: How long the allocator-cap task waits for the probe to see its child (the sampler reads
#: the tree every 10 ms).
CAP_WAIT_S = 5.0

# -- the card, read without the library's rows (tasks and the parent) ----------------------


def card_reading(uuid: str) -> dict[str, int]:
    """The card's total, free and used bytes (NVML device-level, or the simulated card's)."""
    if os.environ.get(SIMULATOR_ENV):
        from gpupool._sensors.simulated_sensor import SimulatedSensor

        sensor = SimulatedSensor(os.environ[SIMULATOR_ENV])
        device = next(d for d in sensor.read_devices() if d.uuid == uuid)
        memory = sensor.read_memory(device)
        return {"total": memory.total_bytes, "free": memory.free_bytes, "used": memory.used_bytes}
    import pynvml

    pynvml.nvmlInit()
    info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    return {"total": int(info.total), "free": int(info.free), "used": int(info.used)}


def _own_row_bytes() -> int | None:
    """This process's row on its card (NVML's per-process figure), ``None`` when missing."""
    uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if os.environ.get(SIMULATOR_ENV):
        from gpupool._sensors.simulated_sensor import SimulatedSensor

        sensor = SimulatedSensor(os.environ[SIMULATOR_ENV])
        device = next(d for d in sensor.read_devices() if d.uuid == uuid)
        return sensor.read_process_bytes(device, os.getpid())
    import pynvml

    pynvml.nvmlInit()
    rows = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    return next((r.usedGpuMemory for r in rows if r.pid == os.getpid()), None)


#: A process that holds device memory until its stdin closes (a co-tenant, a task's child,
#: the context probe). argv: bytes, "conv" (run a matmul and a convolution first) or "plain".
_HOLDER = r"""
import json, os, sys
nbytes, conv = int(sys.argv[1]), sys.argv[2] == "conv"
uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "")
if os.environ.get("GPUPOOL_SIMULATOR"):
    import gpupool.testing as gt
    from gpupool._sensors.simulated_sensor import SimulatedSensor
    reserved = max(nbytes, 16 << 20)  # the stand-in for torch's reserved bytes
    gt.hold(reserved).__enter__()  # held until this process exits
    sensor = SimulatedSensor(os.environ["GPUPOOL_SIMULATOR"])
    device = next(d for d in sensor.read_devices() if d.uuid == uuid)
    row = sensor.read_process_bytes(device, os.getpid())
else:
    import torch
    kept = []
    if conv:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        img = torch.randn(16, 64, 128, 128, device="cuda", dtype=torch.float16)
        w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16)
        kept += [a @ a, torch.nn.functional.conv2d(img, w, padding=1)]
    if nbytes:
        kept.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1))
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    import pynvml
    pynvml.nvmlInit()
    rows = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    row = next((r.usedGpuMemory for r in rows if r.pid == os.getpid()), None)
print(json.dumps({"reserved_bytes": reserved, "row_bytes": row, "pid": os.getpid()}), flush=True)
sys.stdin.read()
"""


def start_holder(
    nbytes: int, how: str, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a :data:`_HOLDER`; return it and its report once it holds (bounded)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(nbytes), how],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    try:
        return proc, dict(json.loads(line))
    except ValueError:
        stop_holder(proc)
        raise RuntimeError(
            f"a process holding {nbytes} bytes did not start ({line!r:.200})"
        ) from None


def stop_holder(proc: subprocess.Popen[str]) -> None:
    """Close a holder's stdin and wait for it; kill it when it does not exit (bounded)."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


# -- tasks (run in the pool's workers; stand-ins allocate on the simulated card) ------------


def _figures(held: dict[str, int], nbytes: int, settle: bool = True, **more: Any) -> dict[str, Any]:
    """What a task reports: the card's used bytes while it held and once it let go (``settle``:
    a free may land a moment late, so wait up to 2 s for half of it)."""
    uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    end = time.monotonic() + (2.0 if settle else 0.0)
    released = card_reading(uuid)["used"]
    while held["used"] - released < nbytes // 2 and time.monotonic() < end:
        time.sleep(0.05)
        released = card_reading(uuid)["used"]
    return {
        "held_used_bytes": held["used"],
        "released_used_bytes": released,
        "allocated_bytes": nbytes,
        "pid": os.getpid(),
        **more,
    }


def _standin_cuda() -> Any | None:
    """The dry run's stand-in ``torch.cuda`` (:func:`dry_run_worker`), where it is installed."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return cuda if hasattr(cuda, "allocate") else None


def _ledger() -> Any:
    """The simulated host's ledger (the dry run's stand-ins charge the card through it)."""
    from gpupool._sensors.simulated import ledger_at

    return ledger_at(os.environ[SIMULATOR_ENV])


def _charged(held: Callable[[], int]) -> Callable[[], None]:
    """A call that charges this process, on the simulated card (device 0), what ``held()``
    says a stand-in framework holds now (more, or back), as a driver would see it."""
    charged = [0]

    def sync() -> None:
        delta = held() - charged[0]
        if delta > 0:
            refusal = _ledger().allocate(0, os.getpid(), delta)
            if refusal is not None:
                raise MemoryError(f"out of memory allocating {delta:,} bytes (simulated card)")
        elif delta < 0:
            _ledger().release(0, os.getpid(), -delta)
        charged[0] += delta

    return sync


def _standin(name: str) -> Any | None:
    """The dry run's stand-in ``name`` module (:func:`dry_run_worker`), where installed."""
    module = sys.modules.get(name)
    return module if getattr(module, "gpu_check_standin", False) else None


def _standin_torch_task(cuda: Any, nbytes: int, mode: str, hold_s: float) -> dict[str, Any]:
    """:func:`torch_task` on the stand-in torch: its reserved bytes are charged on the simulated
    card, and its peak counters are what the probe reads (as torch's, on a card)."""
    total = nbytes + (32 * MiB if mode == "conv" else 0)
    cuda.allocate(total)
    held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    time.sleep(hold_s)
    reserved_peak = int(cuda.max_memory_reserved())
    cuda.free(total)
    if mode == "spike":
        cuda.empty_cache()
    return _figures(
        held,
        nbytes,
        settle=mode == "spike",
        ok=True,
        row_bytes=row,
        torch_reserved_peak=reserved_peak,
        framework="standin-torch",
    )


def _simulated_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """The stand-in for every framework: hold ``nbytes`` on the simulated card, then free it."""
    import gpupool.testing as gt

    with gt.hold(nbytes):
        held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        row = _own_row_bytes()
        time.sleep(hold_s)
    return _figures(held, nbytes, ok=True, row_bytes=row, framework="simulated")


def torch_task(nbytes: int, mode: str, hold_s: float) -> dict[str, Any]:
    """torch: ``hold`` keeps ``nbytes``; ``spike`` frees them at once with ``empty_cache``;
    ``conv`` runs a matmul and a convolution too (the context grows as modules load)."""
    if os.environ.get(SIMULATOR_ENV):
        cuda = _standin_cuda()
        if cuda is not None:
            return _standin_torch_task(cuda, nbytes, mode, hold_s)
        return _simulated_task(nbytes + (32 * MiB if mode == "conv" else 0), hold_s)
    import torch

    kept = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)]
    if mode == "conv":
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        img = torch.randn(16, 64, 128, 128, device="cuda", dtype=torch.float16)
        w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16)
        kept += [a @ a, torch.nn.functional.conv2d(img, w, padding=1)]
    torch.cuda.synchronize()
    held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    ok = bool(kept[0][-1].item() == 1)
    time.sleep(hold_s)
    reserved_peak = int(torch.cuda.max_memory_reserved())
    del kept
    if mode == "spike":
        torch.cuda.empty_cache()
    return _figures(
        held,
        nbytes,
        settle=mode == "spike",  # a hold keeps torch's cache: nothing to wait for
        ok=ok,
        row_bytes=row,
        torch_reserved_peak=reserved_peak,
    )


def cupy_spike_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """CuPy: allocate, touch, hold ``hold_s``, free and ``free_all_blocks`` before returning."""
    if os.environ.get(SIMULATOR_ENV):
        standin = _standin("cupy")
        if standin is None:
            return _simulated_task(nbytes, hold_s)
        pool = standin.get_default_memory_pool()  # charged on the card as it changes
        pool.malloc(nbytes)
        held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        row = _own_row_bytes()
        time.sleep(hold_s)
        pool.free(nbytes)
        pool.free_all_blocks()
        return _figures(held, nbytes, ok=True, row_bytes=row, framework="standin-cupy")
    import cupy

    x = cupy.ones(nbytes, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    ok = int(x[-1]) == 1
    time.sleep(hold_s)
    del x
    cupy.get_default_memory_pool().free_all_blocks()
    return _figures(held, nbytes, ok=ok, row_bytes=row)


def jax_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """JAX: asserted on the GPU before it allocates; the array is deleted before returning."""
    if os.environ.get(SIMULATOR_ENV):
        jax = _standin("jax")
        if jax is None:
            return _simulated_task(nbytes, hold_s)
        device = jax.standin_initialise(jax)  # the task's first JAX call starts its backend
        device.allocate(nbytes)
        jax.standin_charge()
        held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        row = _own_row_bytes()
        time.sleep(hold_s)
        device.free(nbytes)
        device.pool = device.in_use  # XLA_PYTHON_CLIENT_ALLOCATOR=platform: given back
        jax.standin_charge()
        return _figures(held, nbytes, ok=True, row_bytes=row, framework="standin-jax")
    import jax
    import jax.numpy as jnp

    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(f"JAX runs on {backend!r}, not the GPU: install a CUDA build of jaxlib")
    x = jnp.ones((nbytes,), dtype=jnp.uint8).block_until_ready()
    held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    ok = int(x[-1]) == 1
    time.sleep(hold_s)
    x.delete()
    del x
    return _figures(held, nbytes, ok=ok, row_bytes=row, backend=backend)


def managed_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """CuPy managed memory (``cudaMallocManaged``), touched on the device."""
    if os.environ.get(SIMULATOR_ENV):
        # Memory the card's used bytes show and no process row does, as managed memory.
        name = f"gpu-check-managed-{os.getpid()}"
        _ledger().grow_tenant(0, name, nbytes, listed=False)
        try:
            held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
            row = _own_row_bytes()
            time.sleep(hold_s)
        finally:
            _ledger().shrink_tenant(0, name, nbytes)
        return _figures(held, nbytes, ok=True, row_bytes=row, framework="simulated-managed")
    import cupy

    memory = cupy.cuda.memory.malloc_managed(nbytes)
    x = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=memory)
    x.fill(1)
    cupy.cuda.runtime.deviceSynchronize()
    held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    time.sleep(hold_s)
    ok = int(x[-1]) == 1
    del x, memory
    return _figures(held, nbytes, ok=ok, row_bytes=row)


def subprocess_task(nbytes: int, hold_s: float, timeout_s: float) -> dict[str, Any]:
    """Start a child that holds ``nbytes`` (torch, or the simulated card); hold; stop it."""
    proc, child = start_holder(nbytes, "plain", timeout_s)
    try:
        held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        time.sleep(hold_s)
    finally:
        stop_holder(proc)
    return _figures(held, nbytes, ok=True, row_bytes=_own_row_bytes(), child=child)


#: A launcher that double-forks :data:`_HOLDER`: it forks, exits at once, and its child
#: execs the holder, an orphan (a daemon) that shares the launcher's stdin and stdout.
_DOUBLE_FORK = r"""
import os, sys
if os.fork():
    os._exit(0)
os.setsid()
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
"""


def double_fork_task(nbytes: int, hold_s: float, timeout_s: float) -> dict[str, Any]:
    """A double-forked daemon holds ``nbytes`` (orphaned before it allocates): the worker, a
    child subreaper, keeps it in its tree; hold; stop it (its stdin closes)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _DOUBLE_FORK, _HOLDER, str(nbytes), "plain"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        child = dict(json.loads(proc.stdout.readline() if ready else "{}"))
        held = card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        time.sleep(hold_s)
    finally:
        stop_holder(proc)  # the launcher exited at once; closing stdin ends the daemon
    return _figures(held, nbytes, ok=bool(child), row_bytes=_own_row_bytes(), child=child)


def torch_child_task(nbytes: int, hold_s: float, timeout_s: float) -> dict[str, Any]:
    """torch holds ``nbytes`` in the worker while a child holds as much: the tree's peak is
    both (the worker's own figures, its counters or its row, are only half)."""
    if os.environ.get(SIMULATOR_ENV):
        cuda = _standin_cuda()
        if cuda is not None:  # freed by the probe's empty_cache at the task's end, as torch's
            cuda.allocate(nbytes)
            try:
                return subprocess_task(nbytes, hold_s, timeout_s)
            finally:
                cuda.free(nbytes)
        import gpupool.testing as gt

        with gt.hold(nbytes):
            return subprocess_task(nbytes, hold_s, timeout_s)
    import torch

    kept = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    torch.cuda.synchronize()
    try:
        return subprocess_task(nbytes, hold_s, timeout_s)
    finally:
        del kept


def cap_child_task(nbytes: int, timeout_s: float) -> dict[str, Any]:
    """With the allocator cap on: torch starts (the cap is set), then a child holds ``nbytes``;
    wait (bounded) until the cap takes the child's bytes out, and report the cap's state and
    what the child added to the card's used bytes."""
    from gpupool._child.probe import allocator_cap_state

    uuid = os.environ["CUDA_VISIBLE_DEVICES"]
    cuda = _standin_cuda() if os.environ.get(SIMULATOR_ENV) else None
    if cuda is not None:
        cuda.allocate(16 * MiB)
        kept: Any = None
    else:
        import torch

        kept = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda").fill_(1)
        torch.cuda.synchronize()
    before = card_reading(uuid)["used"]
    proc, child = start_holder(nbytes, "plain", timeout_s)
    try:
        held = card_reading(uuid)["used"]
        end = time.monotonic() + CAP_WAIT_S
        while allocator_cap_state()["descendant_bytes"] < nbytes and time.monotonic() < end:
            time.sleep(0.02)
        state = allocator_cap_state()
    finally:
        stop_holder(proc)
    if cuda is not None:
        cuda.free(16 * MiB)
    del kept
    return {"ok": True, "state": state, "child_used_bytes": held - before, "child": child}


def _wait_for(path: str, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def oom_task(framework: str, nbytes: int, held: str | None, tried: str | None) -> dict[str, Any]:
    """Allocate ``nbytes`` with ``framework``: after its context, once the companion ``held``
    its bytes, saying it ``tried`` (a marker file each; ``None``: no companion)."""
    simulated = bool(os.environ.get(SIMULATOR_ENV))
    if simulated:
        run_it: Callable[[], dict[str, Any]] = lambda: _simulated_task(nbytes, 0.0)  # noqa: E731
    elif framework == "torch":
        import torch

        torch.zeros(1, device="cuda")
        run_it = lambda: torch_task(nbytes, "spike", 0.0)  # noqa: E731
    elif framework == "cupy":
        import cupy

        cupy.zeros(1)
        run_it = lambda: cupy_spike_task(nbytes, 0.0)  # noqa: E731
    else:
        import jax

        if jax.default_backend() != "gpu":  # never a host allocation of this size
            raise RuntimeError(f"JAX runs on {jax.default_backend()!r}, not the GPU")
        run_it = lambda: jax_task(nbytes, 0.0)  # noqa: E731
    if held is not None and tried is not None:
        _wait_for(held, WAIT_S / 2)
        Path(tried).touch()
    return run_it()


def companion(nbytes: int, held: str, tried: str, after_s: float) -> int:
    """Hold ``nbytes`` (torch, or the simulated card) until the other task ``tried``, and
    ``after_s`` more; ``held`` says it holds them."""
    if os.environ.get(SIMULATOR_ENV):
        import gpupool.testing as gt

        holding: Any = gt.hold(nbytes)
        holding.__enter__()
    else:
        import torch

        holding = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
        torch.cuda.synchronize()
    Path(held).touch()
    _wait_for(tried, WAIT_S / 2)
    time.sleep(after_s)
    if os.environ.get(SIMULATOR_ENV):
        holding.__exit__(None, None, None)
    del holding
    return os.getpid()


def _load_test_module(name: str) -> Any:
    """``tests/<name>.py`` of the source tree, imported as ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"the dry run needs {TESTS / name}.py (the source tree)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dry_run_worker(total_bytes: int, broken: bool) -> None:
    """Worker initializer of the dry run: ``import torch``, ``cupy`` and ``jax`` find the
    stand-ins of ``tests/`` (``standin_torch.py``, ``standin_cupy.py``, ``standin_jax.py``),
    whose bytes are charged on the simulated card and whose counters the probe reads, as it
    reads the frameworks'; then :func:`break_probe` with ``--break-probe``."""
    _load_test_module("standin_torch").install_in_worker(total_bytes, mirror=True)
    cupy = _load_test_module("standin_cupy").make_cupy()
    pool = cupy.get_default_memory_pool()
    charge_cupy = _charged(pool.total_bytes)
    pool.on_change = lambda _pool: charge_cupy()
    cupy.gpu_check_standin = True
    sys.modules["cupy"] = cupy
    standin_jax = _load_test_module("standin_jax")
    jax = standin_jax.make_jax()
    jax.standin_initialise = standin_jax.initialise
    jax.standin_charge = _charged(lambda: jax.standin_device.pool)
    jax.gpu_check_standin = True
    standin_jax.install(sys.modules, jax)
    if broken:
        break_probe()


def break_probe() -> None:
    """Worker initializer (``--break-probe``): the probe reports a quarter of each device peak."""
    from gpupool._child import probe as _probe

    original = _probe.Probe.stop

    def stop(self: Any, **kwargs: Any) -> Any:
        report = original(self, **kwargs)
        if report.device_peak_bytes is None:
            return report
        return report._replace(device_peak_bytes=report.device_peak_bytes // 4)

    _probe.Probe.stop = stop  # type: ignore[method-assign]
