"""The device check: gpupool on a real NVIDIA card, against an oracle the library does not read.

One command, from the root of the source tree, on the machine with the card::

    python3 bench/gpu_check.py --require-gpu --out "$OUT"

It needs no network and no installed gpupool: it puts ``src/`` and any
``wheels/*.whl`` (loky, a pure-Python wheel, imports as a zip) on ``sys.path``
and on the workers' ``PYTHONPATH``. It needs torch with CUDA, nvidia-ml-py,
cloudpickle and psutil; CuPy and JAX tasks run where those are installed.
Without ``--out`` it writes into a new temporary directory (never into the
source tree) and prints its path. It rewrites ``gpu_check.json`` (every
figure) and ``gpu_check.txt`` (one line per check) after every check, and
prints each line as it goes, so a run that is cut short leaves what it found.

**The oracle.** The card must be otherwise idle. A task's true footprint is
the card's used bytes (NVML's device-level memory info, the figure
``nvidia-smi`` shows, never a per-process row) read inside the task while it
holds its memory, minus the used bytes read before its pool started. Pools
that measure run one worker, so the delta is that worker's alone.

Steps (each check is named in the output; ``report`` checks never fail):

1. **environment**: driver version, CUDA driver version, whether this runs in
   a container (and on what signals), package versions.
2. **census**: gpupool's census against ``nvidia-smi`` (total, free, used,
   reserved); missing ``nvidia-smi`` fails.
3. **context**: a throwaway process runs a matmul and a convolution, with
   lazy and with eager module loading (``CUDA_MODULE_LOADING=EAGER``); its
   context is the card's used delta minus torch's reserved bytes, compared
   with the probe's fixed figure (``CONTEXT_ALLOWANCE_BYTES``, where the probe
   has one). Its own NVML row must be there and above 0 on a bare-metal card.
4. **peaks**: tasks in a one-worker pool: torch (hold; a spike freed with
   ``empty_cache``; a matmul and a convolution), a CuPy spike freed with
   ``free_all_blocks`` before the task returns, JAX (asserted on the GPU,
   ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` so it gives memory back), a
   subprocess that holds memory (the task's process tree), a managed
   allocation (``report``: it is expected to be invisible), and the
   matmul-and-convolution task again in a pool with eager loading. Each
   peak the pool recorded must reach the oracle less ``--tolerance-mib``; its
   source must be a measurement (not ``none``, not an allowance or estimate);
   the freed tasks must have given their memory back (else the check has no
   teeth); each worker's row must be there on a bare-metal card.
5. **ooms**: per framework, a task that asks for 55 % of the free bytes
   beside a companion holding as much runs out, is counted, and is retried
   alone, where it succeeds; a task larger than the card is counted and
   reaches its future as a device out-of-memory.
6. **co-tenant**: a process holds enough that the oracle width
   ``floor((free - reserve) / true peak)`` (free read with the co-tenant
   there, so driver-reserved bytes are never room) is below ``max_workers``;
   the pool's width must never pass it, and every task must succeed.

Every wait has a timeout, pool shutdowns included (the workers are killed
when one does not end); a watchdog ends the whole run past its budget.

``--dry-run`` runs every step's logic on gpupool's simulated host (no card:
simulated stand-ins allocate for the frameworks), so the script is known to
work before a card is lent. ``--break-probe`` (dry run only) makes every
worker's probe report a quarter of the device peak; the summary names the
checks that caught it, and any check that guards peaks and did not fire.

Exit status: ``0`` every check passed, or there is no card and
``--require-gpu`` was not given (it says it checked nothing); ``1`` a check
failed; ``2`` setup failed; ``3`` no card, NVML or torch with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2

EXIT_OK, EXIT_FAILED, EXIT_SETUP, EXIT_SKIPPED_REQUIRED = 0, 1, 2, 3

#: The whole run must end within this (expected: 3-4 minutes), so that a second run fits
#: in a lent machine's 15 minutes; the watchdog ends it ``WATCHDOG_GRACE_S`` later.
TOTAL_BUDGET_S = 330.0
WATCHDOG_GRACE_S = 30.0
DRY_RUN_BUDGET_S = 240.0
#: One task, one helper process or one shutdown waits at most this long.
WAIT_S = 120.0
SHUTDOWN_S = 30.0
#: A CuPy spike lives this long: five of the probe's 10 ms sampling intervals.
SPIKE_HOLD_S = 0.05
#: The card is idle again when its used bytes are within this of the baseline.
IDLE_SLACK_BYTES = 64 * MiB
#: The co-tenant step's pool, and the oracle width its co-tenant is sized for.
CO_TENANT_WORKERS = 8
CO_TENANT_ORACLE_WIDTH = 4
RESERVE_BYTES = 256 * MiB
#: Workers give JAX's memory back on release, and do not preallocate.
JAX_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
SIMULATOR_ENV = "GPUPOOL_SIMULATOR"
#: A peak source that is not a measurement.
FALLBACK_WORDS = ("allowance", "estimated")

ROOT = Path(__file__).resolve().parent.parent


def _use_source_tree() -> None:
    """Put ``src/`` and ``wheels/*.whl`` on ``sys.path`` and on the workers' ``PYTHONPATH``."""
    paths = [str(ROOT / "src"), *sorted(glob.glob(str(ROOT / "wheels" / "*.whl")))]
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    existing = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([existing] if existing else [])])


# -- the card, read without the library's rows (tasks and the parent) ----------------------


def _card_reading(uuid: str) -> dict[str, int]:
    """The card's total, free and used bytes (NVML device-level, or the simulated card's)."""
    if os.environ.get(SIMULATOR_ENV):
        from gpupool._sensors.simulated import SimulatedSensor

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
        from gpupool._sensors.simulated import SimulatedSensor

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
    from gpupool._sensors.simulated import SimulatedSensor
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


def _start_holder(
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
        _stop(proc)
        raise RuntimeError(
            f"a process holding {nbytes} bytes did not start ({line!r:.200})"
        ) from None


def _stop(proc: subprocess.Popen[str]) -> None:
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
    released = _card_reading(uuid)["used"]
    while held["used"] - released < nbytes // 2 and time.monotonic() < end:
        time.sleep(0.05)
        released = _card_reading(uuid)["used"]
    return {
        "held_used_bytes": held["used"],
        "released_used_bytes": released,
        "allocated_bytes": nbytes,
        "pid": os.getpid(),
        **more,
    }


def _simulated_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """The stand-in for every framework: hold ``nbytes`` on the simulated card, then free it."""
    import gpupool.testing as gt

    with gt.hold(nbytes):
        held = _card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        row = _own_row_bytes()
        time.sleep(hold_s)
    return _figures(held, nbytes, ok=True, row_bytes=row, framework="simulated")


def torch_task(nbytes: int, mode: str, hold_s: float) -> dict[str, Any]:
    """torch: ``hold`` keeps ``nbytes``; ``spike`` frees them at once with ``empty_cache``;
    ``conv`` runs a matmul and a convolution too (the context grows as modules load)."""
    if os.environ.get(SIMULATOR_ENV):
        return _simulated_task(nbytes + (32 * MiB if mode == "conv" else 0), hold_s)
    import torch

    kept = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)]
    if mode == "conv":
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        img = torch.randn(16, 64, 128, 128, device="cuda", dtype=torch.float16)
        w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16)
        kept += [a @ a, torch.nn.functional.conv2d(img, w, padding=1)]
    torch.cuda.synchronize()
    held = _card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
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
        return _simulated_task(nbytes, hold_s)
    import cupy

    x = cupy.ones(nbytes, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    held = _card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    ok = int(x[-1]) == 1
    time.sleep(hold_s)
    del x
    cupy.get_default_memory_pool().free_all_blocks()
    return _figures(held, nbytes, ok=ok, row_bytes=row)


def jax_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """JAX: asserted on the GPU before it allocates; the array is deleted before returning."""
    if os.environ.get(SIMULATOR_ENV):
        return _simulated_task(nbytes, hold_s)
    import jax
    import jax.numpy as jnp

    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(f"JAX runs on {backend!r}, not the GPU: install a CUDA build of jaxlib")
    x = jnp.ones((nbytes,), dtype=jnp.uint8).block_until_ready()
    held = _card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    ok = int(x[-1]) == 1
    time.sleep(hold_s)
    x.delete()
    del x
    return _figures(held, nbytes, ok=ok, row_bytes=row, backend=backend)


def managed_task(nbytes: int, hold_s: float) -> dict[str, Any]:
    """CuPy managed memory (``cudaMallocManaged``), touched on the device."""
    if os.environ.get(SIMULATOR_ENV):
        return _simulated_task(nbytes, hold_s)
    import cupy

    memory = cupy.cuda.memory.malloc_managed(nbytes)
    x = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=memory)
    x.fill(1)
    cupy.cuda.runtime.deviceSynchronize()
    held = _card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
    row = _own_row_bytes()
    time.sleep(hold_s)
    ok = int(x[-1]) == 1
    del x, memory
    return _figures(held, nbytes, ok=ok, row_bytes=row)


def subprocess_task(nbytes: int, hold_s: float, timeout_s: float) -> dict[str, Any]:
    """Start a child that holds ``nbytes`` (torch, or the simulated card); hold; stop it."""
    proc, child = _start_holder(nbytes, "plain", timeout_s)
    try:
        held = _card_reading(os.environ["CUDA_VISIBLE_DEVICES"])
        time.sleep(hold_s)
    finally:
        _stop(proc)
    return _figures(held, nbytes, ok=True, row_bytes=_own_row_bytes(), child=child)


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


def break_probe() -> None:
    """Worker initializer (``--break-probe``): the probe reports a quarter of each device peak."""
    from gpupool import _probe

    original = _probe.Probe.stop

    def stop(self: Any, *, oom: BaseException | None = None) -> Any:
        report = original(self, oom=oom)
        if report.device_peak_bytes is None:
            return report
        return dataclasses.replace(report, device_peak_bytes=report.device_peak_bytes // 4)

    _probe.Probe.stop = stop  # type: ignore[method-assign]


# -- the run: its budget, its report, its pools ----------------------------------------------


class Deadline:
    """The run's time budget: every wait takes its timeout from here."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.end_s = time.monotonic() + total_s

    def timeout(self, limit_s: float = WAIT_S) -> float:
        left = self.end_s - time.monotonic()
        if left <= 1:
            raise TimeoutError(f"the run's {self.total_s:.0f} s budget is spent")
        return min(limit_s, left)


def check(
    name: str, ok: bool, detail: str, *, guards_peaks: bool = False, report: bool = False
) -> dict[str, Any]:
    """One check's outcome; ``report`` checks are recorded and never fail the run."""
    return {
        "name": name,
        "ok": bool(ok),
        "detail": detail,
        "guards_peaks": guards_peaks,
        "report": report,
    }


@dataclasses.dataclass
class Run:
    """What every step needs: where to write, the card, the budget, the mode."""

    out: Path
    deadline: Deadline
    dry_run: bool
    broken: bool
    tolerance_bytes: int
    index: int = 0
    uuid: str = ""
    total_bytes: int = 0
    hold_s: float = 1.0
    container: bool = False
    context_bytes: int = 0
    oracles: dict[str, int] = dataclasses.field(default_factory=dict)
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    lines: list[str] = dataclasses.field(default_factory=list)

    @property
    def task_bytes(self) -> int:
        return min(4 * GiB, self.total_bytes // 32)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)
        self.write()

    def write(self) -> None:
        """Rewrite both files: a run cut short leaves everything found so far."""
        self.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.result, indent=1, default=str) + "\n"
        (self.out / "gpu_check.json.tmp").write_text(text)
        os.replace(self.out / "gpu_check.json.tmp", self.out / "gpu_check.json")
        (self.out / "gpu_check.txt").write_text("\n".join(self.lines) + "\n")

    def add(self, step: str, checks: list[dict[str, Any]], **data: Any) -> None:
        """Record a step's checks and figures; print one line per check; rewrite the files."""
        entry = self.result.setdefault("steps", {}).setdefault(step, {"checks": []})
        entry["checks"].extend(checks)
        entry.update(data)
        self.result.setdefault("checks", []).extend({**c, "step": step} for c in checks)
        for c in checks:
            state = "ok" if c["ok"] else ("REPORT" if c["report"] else "FAILED")
            self.say(f"{step}: {c['name']}: {state}: {c['detail']}")

    def card(self) -> dict[str, int]:
        return _card_reading(self.uuid)

    def child_env(self, **extra: str) -> dict[str, str]:
        return dict(
            os.environ, CUDA_VISIBLE_DEVICES=self.uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID", **extra
        )


def _close(ex: Any, timeout_s: float) -> str | None:
    """Shut a pool down within ``timeout_s``, else kill its workers; why it failed, if it did."""
    closer = threading.Thread(
        target=ex.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True
    )
    closer.start()
    closer.join(timeout_s)
    if not closer.is_alive():
        return None
    ex.kill_workers()
    closer.join(SHUTDOWN_S)
    return f"shutdown did not end within {timeout_s:.0f} s: workers killed" + (
        "" if not closer.is_alive() else "; the pool still did not stop"
    )


@contextlib.contextmanager
def pool(run: Run, checks: list[dict[str, Any]], **kwargs: Any) -> Iterator[Any]:
    """A ``GpuPoolExecutor`` on the run's card; its shutdown is bounded (a check when it is not)."""
    from gpupool import GpuPoolExecutor

    ex = GpuPoolExecutor(
        devices=[run.uuid], initializer=break_probe if run.broken else None, **kwargs
    )
    try:
        yield ex
    except BaseException:
        ex.kill_workers()  # a stuck or failed step: nothing left to wait for
        raise
    finally:
        try:
            timeout_s = run.deadline.timeout(SHUTDOWN_S)
        except TimeoutError:
            timeout_s = 5.0  # the budget is spent: stop it quickly all the same
        problem = _close(ex, timeout_s)
        if problem is not None:
            checks.append(check("shutdown", False, problem))


def _wait_idle(run: Run, baseline_used: int, name: str = "idle") -> dict[str, Any]:
    """Wait (bounded) until the card's used bytes are back at the baseline: the oracle's premise."""
    end = time.monotonic() + run.deadline.timeout(20)
    while True:
        used = run.card()["used"]
        if used - baseline_used <= IDLE_SLACK_BYTES or time.monotonic() > end:
            return check(
                name,
                used - baseline_used <= IDLE_SLACK_BYTES,
                f"card used {used / MiB:.0f} MiB after, {baseline_used / MiB:.0f} MiB before "
                "(the oracle needs an otherwise idle card)",
            )
        time.sleep(0.2)


# -- step 1: environment --------------------------------------------------------------------


def _container_signals() -> dict[str, Any]:
    """Why this might be a container (any signal counts)."""
    cgroup = ""
    with contextlib.suppress(OSError):
        cgroup = Path("/proc/1/cgroup").read_text()
    markers = [m for m in ("docker", "kubepods", "containerd", "lxc", "libpod") if m in cgroup]
    return {
        "dockerenv": os.path.exists("/.dockerenv"),
        "containerenv": os.path.exists("/run/.containerenv"),
        "cgroup_markers": markers,
        "container_variable": os.environ.get("container"),  # noqa: SIM112 (systemd's name),
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_environment(run: Run) -> None:
    signals = _container_signals()
    driver: dict[str, Any] = {"driver_version": "simulated", "cuda_driver_version": None}
    if not run.dry_run:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        driver["driver_version"] = version.decode() if isinstance(version, bytes) else version
        with contextlib.suppress(Exception):
            driver["cuda_driver_version"] = pynvml.nvmlSystemGetCudaDriverVersion()
    in_container = bool(
        signals["dockerenv"]
        or signals["containerenv"]
        or signals["cgroup_markers"]
        or signals["container_variable"]
    )
    # A dry run simulates a bare-metal card wherever it runs.
    run.container = in_container and not run.dry_run
    packages = ["torch", "cupy-cuda12x", "cupy", "jax", "jaxlib", "numba", "nvidia-ml-py"]
    run.add(
        "environment",
        [
            check(
                "driver",
                True,
                f"driver {driver['driver_version']}, CUDA driver {driver['cuda_driver_version']}, "
                f"{'container' if run.container else 'bare metal'}"
                f"{' (simulated)' if run.dry_run else ''}; this host's signals {signals}",
                report=True,
            )
        ],
        **driver,
        container=run.container,
        container_signals=signals,
        python=sys.version.split()[0],
        packages={p: _version(p) for p in packages},
        cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING"),
    )


# -- step 2: census ---------------------------------------------------------------------------


def _smi(run: Run) -> dict[str, int] | str:
    """nvidia-smi's total, used, free and reserved bytes (MiB, as it reports), or why not."""
    if run.dry_run:
        reading = run.card()  # the simulated card stands in for nvidia-smi
        return {"total": reading["total"], "used": reading["used"], "free": reading["free"]}
    fields = ["memory.total", "memory.used", "memory.free", "memory.reserved"]
    for query in (fields, fields[:3]):  # memory.reserved needs a recent nvidia-smi
        try:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    f"--id={run.index}",
                    f"--query-gpu={','.join(query)}",
                    "--format=csv,noheader,nounits",
                ],
                capture_output=True,
                text=True,
                timeout=run.deadline.timeout(30),
                check=True,
            ).stdout
            values = [int(v.strip()) * MiB for v in out.strip().split(",")]
        except FileNotFoundError:
            return "nvidia-smi is not installed"
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            why = f"nvidia-smi failed: {exc!r:.200}"
            continue
        return dict(zip(["total", "used", "free", "reserved"], values, strict=False))
    return why


def step_census(run: Run) -> None:
    from gpupool._sensors.census import read_census
    from gpupool._sensors.select import default_sensor

    sensor = default_sensor()
    try:
        census, _ = read_census(sensor, devices=[run.uuid], visible_devices=None)
    finally:
        sensor.close()
    card = census.cards[0]
    smi = _smi(run)
    figures = {k: getattr(card, k) for k in ("total_bytes", "free_bytes", "reserved_bytes")}
    figures.update(used_bytes=card.used_bytes, own_bytes=card.own_bytes, source=card.source)
    checks = [check("readable", card.readable, f"source {card.source}, reason {card.reason}")]
    if isinstance(smi, str):
        checks.append(check("nvidia-smi", False, f"{smi}: the census cannot be checked"))
    elif card.readable:
        # nvidia-smi's used leaves out what it lists as reserved; the census's includes it.
        used = card.used_bytes
        if used is not None and "reserved" in smi:
            used -= card.reserved_bytes or 0
        pairs = [("total", card.total_bytes, 2 * MiB), ("free", card.free_bytes, 64 * MiB)]
        pairs.append(("used", used, 64 * MiB))
        if "reserved" in smi:
            pairs.append(("reserved", card.reserved_bytes, 2 * MiB))
        for name, ours, slack in pairs:
            gap = None if ours is None else abs(ours - smi[name])
            checks.append(
                check(
                    name,
                    gap is not None and gap <= slack,
                    f"census {ours} vs nvidia-smi {smi[name]} bytes (allowed {slack // MiB} MiB)",
                )
            )
    checks.append(check("own", card.own_bytes in (0, None), f"the check's own {card.own_bytes}"))
    run.add("census", checks, census=figures, nvidia_smi=smi)


# -- step 3: context --------------------------------------------------------------------------


def _row_check(name: str, row: int | None, container: bool, report: bool = False) -> dict[str, Any]:
    """A child's own NVML row: there and above 0 on bare metal; in a container, only reported."""
    ok = row is not None and row > 0
    where = "in a container (drivers 535.113 to 560 list 0 there)" if container else "bare metal"
    detail = f"the process's own row: {row} bytes, {where}"
    return check(name, ok, detail, report=container or report)


def step_context(run: Run) -> None:
    from gpupool import _probe

    figure = getattr(_probe, "CONTEXT_ALLOWANCE_BYTES", None)
    checks: list[dict[str, Any]] = []
    figures: dict[str, Any] = {}
    for mode in ("lazy", "eager"):
        baseline = run.card()["used"]
        env = run.child_env(CUDA_MODULE_LOADING=mode.upper())
        proc, child = _start_holder(0, "conv", run.deadline.timeout(), env)
        try:
            used = run.card()["used"]
        finally:
            _stop(proc)
        context = used - baseline - int(child["reserved_bytes"])
        figures[mode] = {**child, "device_delta_bytes": used - baseline, "context_bytes": context}
        checks.append(_wait_idle(run, baseline, f"idle.{mode}"))
        checks.append(_row_check(f"row.{mode}", child["row_bytes"], run.container))
        if child["row_bytes"]:
            # How far the driver's row falls short of the card's delta: the floor's tolerance.
            gap = used - baseline - int(child["row_bytes"])
            detail = f"card used delta - own row = {gap / MiB:.1f} MiB"
            checks.append(check(f"row-gap.{mode}", True, detail, report=True))
        detail = f"{mode} loading: context after a matmul and a convolution {context / MiB:.0f} MiB"
        if figure is None:
            checks.append(check(f"figure.{mode}", True, f"{detail}; no fixed figure", report=True))
        else:
            # Eager loading is opt-in: its context is reported against the figure, not judged.
            checks.append(
                check(
                    f"figure.{mode}",
                    figure >= context,
                    f"{detail}; the probe's fixed figure {figure / MiB:.0f} MiB",
                    report=mode == "eager",
                )
            )
        if mode == "lazy":
            run.context_bytes = context
    run.add("context", checks, probe_figure_bytes=figure, **figures)


# -- step 4: peaks ----------------------------------------------------------------------------


def _have(run: Run, module: str) -> bool:
    return run.dry_run or importlib.util.find_spec(module) is not None


def _peak_jobs(run: Run) -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    n, h = run.task_bytes, run.hold_s
    jobs: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
        ("torch-first", torch_task, (n, "hold", h)),
        ("torch-spike", torch_task, (n, "spike", 0.0)),
        ("torch-conv", torch_task, (64 * MiB, "conv", h)),
    ]
    if _have(run, "cupy"):
        jobs.append(("cupy-spike", cupy_spike_task, (n, SPIKE_HOLD_S)))
    if _have(run, "jax"):
        jobs.append(("jax", jax_task, (n, h)))
    jobs.append(("subprocess", subprocess_task, (n, h, WAIT_S / 2)))
    if _have(run, "cupy"):
        jobs.append(("managed", managed_task, (n, h)))
    missing = [m for m in ("cupy", "jax") if not _have(run, m)]
    run.add("peaks", [check(m, True, "not installed: not checked", report=True) for m in missing])
    return jobs


#: Tasks that free what they allocated before returning: the peak must be caught while held.
_RELEASING = ("torch-spike", "cupy-spike", "jax", "subprocess")


def _measured(ex: Any, key: str) -> tuple[int | None, str, str | None]:
    """The peak the pool recorded for ``key``, its source, and the key's ask basis."""
    peak, source = None, "no measurement record"
    for decision in ex.decisions:
        if decision.key == key and "peak_bytes" in decision.extra:
            peak, source = decision.extra["peak_bytes"], str(decision.extra.get("peak_source"))
            break
    ask = ex.statistics().asks.get(key)
    return peak, source, None if ask is None else ask.basis


def _peak_checks(
    run: Run, key: str, out: dict[str, Any], measured: tuple[int | None, str, str | None]
) -> list[dict[str, Any]]:
    peak, source, basis = measured
    oracle = int(out["held_used_bytes"]) - int(out["baseline_used_bytes"])
    run.oracles[key] = oracle
    floor = oracle - run.tolerance_bytes
    managed = key == "managed"  # expected invisible to the driver's rows: reported
    out.update(oracle_bytes=oracle, recorded_peak_bytes=peak, peak_source=source, basis=basis)
    fallback = source == "none" or any(word in source for word in FALLBACK_WORDS)
    checks = [
        check(f"{key}.ran", bool(out.get("ok")), "the task read back what it wrote"),
        check(
            f"{key}.floor",
            peak is not None and peak >= floor,
            f"recorded {peak} bytes; oracle (card used delta) {oracle} - tolerance "
            f"{run.tolerance_bytes // MiB} MiB = {floor}",
            guards_peaks=not managed,
            report=managed,
        ),
        check(
            f"{key}.source",
            not fallback and basis == "measured",
            f"peak source {source!r}, ask basis {basis!r}",
            report=managed,
        ),
        _row_check(f"{key}.row", out.get("row_bytes"), run.container, report=managed),
    ]
    if key in _RELEASING:
        given_back = int(out["held_used_bytes"]) - int(out["released_used_bytes"])
        checks.append(
            check(
                f"{key}.released",
                given_back >= int(out["allocated_bytes"]) // 2,
                f"{given_back} bytes given back before the task returned (else the probe's "
                "end-of-task reading sees them and the floor proves nothing)",
            )
        )
    return checks


def step_peaks(
    run: Run, step: str, jobs: list[tuple[str, Callable[..., Any], tuple[Any, ...]]], **env: str
) -> None:
    checks: list[dict[str, Any]] = []
    baseline = run.card()["used"]
    log = run.out / f"{step}.jsonl"
    log.unlink(missing_ok=True)
    with pool(run, checks, max_workers=1, env={**JAX_ENV, **env}, log_path=log) as ex:
        for key, fn, args in jobs:
            estimate = (args[0] if isinstance(args[0], int) else 0) + 2 * GiB
            future = ex.options(key=key, task_peak=estimate).submit(fn, *args)
            try:
                out = dict(future.result(timeout=run.deadline.timeout()))
            except TimeoutError:
                ex.kill_workers()
                run.add(step, [check(f"{key}.ran", False, "no result in time: workers killed")])
                break
            except Exception as exc:
                run.add(step, [check(f"{key}.ran", False, f"{type(exc).__name__}: {exc!s:.300}")])
                continue
            out["baseline_used_bytes"] = baseline
            run.add(step, _peak_checks(run, key, out, _measured(ex, key)), **{key: out})
    checks.append(_wait_idle(run, baseline))
    run.add(step, checks)


# -- step 5: out-of-memory --------------------------------------------------------------------


def _oom_pair(run: Run, ex: Any, framework: str, markers: Path) -> list[dict[str, Any]]:
    """Beside a companion that holds 55 % of the free bytes, a task asks for as much: it runs
    out, is counted, and is retried alone, where it fits."""
    share = int(0.55 * run.card()["free"])
    held, tried = str(markers / f"{framework}-held"), str(markers / f"{framework}-tried")
    ex.options(key="oom-companion", task_peak=share + GiB).submit(
        companion, share, held, tried, 1.0
    )
    doomed = ex.options(key=f"oom-beside-{framework}", task_peak="1GiB").submit(
        oom_task, framework, share, held, tried
    )
    error = doomed.exception(timeout=run.deadline.timeout())
    stats = ex.statistics()
    said = f"{type(error).__name__}: {error!s:.200}" if error else "it succeeded"
    return [
        check(
            f"{framework}.beside.counted", stats.out_of_memory >= 1, f"{stats.out_of_memory} oom"
        ),
        check(
            f"{framework}.beside.retried",
            stats.retries >= 1 and error is None,
            f"{stats.retries} retries; on its retry alone {said}",
        ),
    ]


def step_ooms(run: Run) -> None:
    from gpupool._probe import is_device_oom

    markers = Path(tempfile.mkdtemp(prefix="gpu-check-oom-"))
    for framework in ("torch", "cupy", "jax"):
        if not _have(run, framework):
            run.add("ooms", [check(framework, True, "not installed: not checked", report=True)])
            continue
        checks: list[dict[str, Any]] = []
        with pool(run, checks, max_workers=2, env=JAX_ENV) as ex:
            checks += _oom_pair(run, ex, framework, markers)
            before = ex.statistics().out_of_memory
            larger = ex.options(key=f"oom-larger-{framework}", task_peak="1GiB").submit(
                oom_task, framework, int(run.total_bytes * 1.5), None, None
            )
            error = larger.exception(timeout=run.deadline.timeout())
            counted = ex.statistics().out_of_memory - before
        said = f"{type(error).__name__}: {error!s:.200}" if error else "no error"
        checks += [
            check(
                f"{framework}.larger.classified",
                error is not None and is_device_oom(error),
                f"a task larger than the card: {said}",
            ),
            check(f"{framework}.larger.counted", counted >= 1, f"{counted} oom"),
        ]
        run.add("ooms", checks)
    shutil.rmtree(markers, ignore_errors=True)


# -- step 6: co-tenant ------------------------------------------------------------------------


def step_co_tenant(run: Run) -> None:
    n = run.task_bytes
    # The true footprint of one task: the oracle of the same task in the peaks step.
    true_peak = run.oracles.get("torch-first") or n + run.context_bytes
    idle = run.card()
    target = (CO_TENANT_ORACLE_WIDTH + 0.5) * true_peak
    co_bytes = max(0, int(idle["free"] - RESERVE_BYTES - target - run.context_bytes))
    checks: list[dict[str, Any]] = []
    proc, _ = _start_holder(co_bytes, "plain", run.deadline.timeout(), run.child_env())
    try:
        free = run.card()["free"]  # free, not total - used: driver-reserved bytes are no room
        oracle = math.floor((free - RESERVE_BYTES) / true_peak)
        checks.append(
            check(
                "sizing",
                1 <= oracle < CO_TENANT_WORKERS,
                f"co-tenant {co_bytes / GiB:.1f} GiB leaves {free / GiB:.2f} GiB free: oracle "
                f"width {oracle} at {true_peak / GiB:.2f} GiB a task, below max_workers "
                f"{CO_TENANT_WORKERS}",
            )
        )
        with pool(
            run,
            checks,
            max_workers=CO_TENANT_WORKERS,
            task_peak=int(true_peak * 1.1),
            reserve=RESERVE_BYTES,
            log_path=run.out / "co-tenant.jsonl",
        ) as ex:
            census_free = ex.census.cards[0].free_bytes
            view = ex.options(key="co-tenant")
            futures = [view.submit(torch_task, n, "hold", run.hold_s) for _ in range(16)]
            outs = [f.result(timeout=run.deadline.timeout()) for f in futures]
            stats = ex.statistics()
    finally:
        _stop(proc)
    widths = [w for _, w in stats.widths]
    gap = abs((census_free or 0) - free)
    checks += [
        check(
            "width",
            bool(widths) and max(widths) <= oracle,
            f"widths {widths}, oracle {oracle}",
            guards_peaks=True,
        ),
        check("census", gap <= 64 * MiB, f"pool census free {census_free} vs {free} bytes"),
        check(
            "tasks",
            stats.out_of_memory == 0 and all(o["ok"] for o in outs),
            f"{len(outs)} tasks, {stats.out_of_memory} out-of-memory",
        ),
        _wait_idle(run, idle["used"]),
    ]
    run.add("co-tenant", checks, co_tenant_bytes=co_bytes, free_bytes=free, oracle_width=oracle)


# -- the command ------------------------------------------------------------------------------


def _summary(run: Run) -> int:
    checks = run.result.get("checks", [])
    failed = [f"{c['step']}.{c['name']}" for c in checks if not c["ok"] and not c["report"]]
    if run.broken:
        guards = [c for c in checks if c["guards_peaks"]]
        caught = [f"{c['step']}.{c['name']}" for c in guards if not c["ok"]]
        missed = [f"{c['step']}.{c['name']}" for c in guards if c["ok"]]
        run.result.update(break_probe_caught_by=caught, break_probe_missed_by=missed)
        run.say(f"break-probe: caught by {len(caught)}: {', '.join(caught) or 'none'}")
        run.say(f"break-probe: NOT caught by {len(missed)}: {', '.join(missed) or 'none'}")
        if not caught:
            failed.append("break-probe: no check caught the broken probe")
    run.result.update(failures=failed, exit=EXIT_FAILED if failed else EXIT_OK)
    run.say(f"gpu_check: {len(checks)} checks, {len(failed)} failed: {', '.join(failed)}")
    run.say("gpu_check: PASSED" if not failed else "gpu_check: FAILED")
    return int(run.result["exit"])


def _watchdog(run: Run) -> threading.Timer:
    """Past the budget (and ``WATCHDOG_GRACE_S``) write what was found and end the process."""

    def fire() -> None:
        try:
            run.result.update(exit=EXIT_FAILED, watchdog="the run passed its budget and was ended")
            run.say("gpu_check: FAILED: the run passed its budget; ended by the watchdog")
            sys.stdout.flush()
        finally:
            os._exit(EXIT_FAILED)

    timer = threading.Timer(run.deadline.total_s + WATCHDOG_GRACE_S, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_steps(run: Run) -> int:
    try:
        run.total_bytes = run.card()["total"]
    except Exception as exc:
        run.result.update(exit=EXIT_SETUP, setup_error=f"{type(exc).__name__}: {exc}")
        run.say(f"gpu_check: SETUP FAILED: the card's memory could not be read: {exc!r:.300}")
        return EXIT_SETUP
    run.result.update(
        checked=True,
        dry_run=run.dry_run,
        broken_probe=run.broken,
        out_dir=str(run.out.resolve()),
        total_bytes=run.total_bytes,
        task_bytes=run.task_bytes,
        tolerance_bytes=run.tolerance_bytes,
    )
    run.say(
        f"gpu_check: card {run.index} {run.uuid}, {run.total_bytes / GiB:.1f} GiB, out {run.out}"
    )
    timer = _watchdog(run)
    eager = [("torch-conv-eager", torch_task, (64 * MiB, "conv", run.hold_s))]
    steps: list[tuple[str, Callable[[], None]]] = [
        ("environment", lambda: step_environment(run)),
        ("census", lambda: step_census(run)),
        ("context", lambda: step_context(run)),
        ("peaks", lambda: step_peaks(run, "peaks", _peak_jobs(run), CUDA_MODULE_LOADING="LAZY")),
        ("peaks-eager", lambda: step_peaks(run, "peaks-eager", eager, CUDA_MODULE_LOADING="EAGER")),
        ("ooms", lambda: step_ooms(run)),
        ("co-tenant", lambda: step_co_tenant(run)),
    ]
    started = time.monotonic()
    for name, step in steps:
        try:
            step()
        except Exception as exc:
            run.add(name, [check("raised", False, f"{type(exc).__name__}: {exc!s:.400}")])
        run.result["elapsed_s"] = round(time.monotonic() - started, 1)
    timer.cancel()
    return _summary(run)


def _card(index: int) -> dict[str, Any] | str:
    """Card ``index``'s UUID and name from NVML, or why there is none."""
    if importlib.util.find_spec("pynvml") is None:
        return "NVML's Python binding (nvidia-ml-py, module pynvml) is not installed"
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if index >= count:
            return f"NVML lists {count} device(s); there is no device {index}"
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid, name = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle)
    except Exception as exc:
        return f"NVML could not be read ({type(exc).__name__}: {exc}): no NVIDIA driver or card"
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return {"uuid": uuid, "name": name.decode() if isinstance(name, bytes) else str(name)}


def _nothing_checked(out: Path, why: str, require: bool) -> int:
    status = EXIT_SKIPPED_REQUIRED if require else EXIT_OK
    run = Run(out=out, deadline=Deadline(60), dry_run=False, broken=False, tolerance_bytes=0)
    run.result = {"checked": False, "reason": why, "require_gpu": require, "exit": status}
    run.say(f"gpu_check: checked nothing: {why}; results in {out}")
    if require:
        run.say("gpu_check: FAILED: --require-gpu was given and there is no usable card")
    else:
        run.say("gpu_check: nothing was checked (exit 0); pass --require-gpu to fail here")
    return status


def _dry_run(args: argparse.Namespace, out: Path) -> int:
    """Every step on a simulated card as large as an H200 (16 CPUs, 128 GiB of RAM, as lent)."""
    from gpupool.testing import SimulatedDevice, SimulatedHost

    host = SimulatedHost([SimulatedDevice("140GiB")], context="300MiB", cpus=16, host_ram="128GiB")
    with host:
        run = Run(
            out=out,
            deadline=Deadline(DRY_RUN_BUDGET_S),
            dry_run=True,
            broken=args.break_probe,
            tolerance_bytes=args.tolerance_mib * MiB,
            uuid=host.device_uuid(0),
            hold_s=0.2,
        )
        return run_steps(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_check.py",
        description="Check gpupool on a real NVIDIA card. Run from the source tree: "
        'python3 bench/gpu_check.py --require-gpu --out "$OUT"',
    )
    parser.add_argument("--require-gpu", action="store_true", help="fail (exit 3) without a card")
    parser.add_argument("--out", help="directory for the results (default: a new temporary one)")
    parser.add_argument("--device", type=int, default=0, help="NVML index of the card (0)")
    parser.add_argument("--tolerance-mib", type=int, default=8, help="slack on the peaks floor")
    parser.add_argument("--dry-run", action="store_true", help="run on a simulated card")
    parser.add_argument(
        "--break-probe", action="store_true", help="dry run only: the probe reports peak / 4"
    )
    args = parser.parse_args(argv)
    if args.break_probe and not args.dry_run:
        parser.error("--break-probe is meant only for the dry run: add --dry-run")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    _use_source_tree()
    if args.dry_run:
        return _dry_run(args, out)
    os.environ.pop(SIMULATOR_ENV, None)  # never the simulated card on a real run
    card = _card(args.device)
    if isinstance(card, str):
        return _nothing_checked(out, card, args.require_gpu)
    if importlib.util.find_spec("torch") is None:
        return _nothing_checked(out, "torch is not installed", args.require_gpu)
    run = Run(
        out=out,
        deadline=Deadline(TOTAL_BUDGET_S),
        dry_run=False,
        broken=False,
        tolerance_bytes=args.tolerance_mib * MiB,
        index=args.device,
        uuid=card["uuid"],
    )
    run.result["card"] = card
    return run_steps(run)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a pool that could not be stopped must not hold the exit
