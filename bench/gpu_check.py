"""The device check: gpupool on a real NVIDIA card, against nvidia-smi, torch, CuPy and JAX.

One command, from the root of the source tree, on the machine with the card::

    python3 bench/gpu_check.py --require-gpu --out gpu-check-results

It needs no network and no installed gpupool: it puts ``src/`` on ``sys.path``
(as ``PYTHONPATH=src`` would, and passes that on to the pool's workers). It
needs torch with CUDA, nvidia-ml-py, cloudpickle and psutil; CuPy and JAX are
checked where installed. loky (a pure-Python wheel) may be brought along:
on a machine with network, ``pip download loky --no-deps -d wheels`` in the
source tree; the check puts every ``wheels/*.whl`` on ``sys.path`` itself (a
pure-Python wheel imports as a zip). ``pip install --no-index --no-deps
wheels/loky-*.whl`` works as well.

What it checks, each step with a timeout, all within five minutes:

1. **census**: gpupool's census of card ``--device`` against ``nvidia-smi
   --query-gpu=memory.total,memory.used,memory.free`` and against
   ``torch.cuda.mem_get_info`` read in a throwaway process (the check's own
   process never creates a CUDA context);
2. **context**: a throwaway process creates a context and reads its own NVML
   row (the measured context, ``row - torch reserved``);
3. **peaks**: tasks through ``GpuPoolExecutor`` that allocate with torch (the
   worker's first task creates the context; another spikes 2 GiB for under
   10 ms and frees it with ``empty_cache``), CuPy and JAX; for each, the peak
   the pool recorded must be at least the bytes the task allocated (torch:
   its reserved peak) plus the measured context;
4. **out-of-memory**: a task per framework that allocates more than the card,
   beside a small companion task, must be classified as an out-of-memory,
   retried alone, and reach its future as that framework's error;
5. **co-tenant**: a plain process holds ``--co-tenant-gib``; the pool's widths
   must never pass the oracle ``floor((total - used - reserve) / true peak)``
   computed from nvidia-smi's own figures, and every task must succeed.

It writes ``gpu_check.json`` (every figure) and ``gpu_check.txt`` (the
summary) into ``--out`` (default: the current directory).

Exit status: ``0`` every check passed, or there is no card and
``--require-gpu`` was not given (it then says it checked nothing); ``1`` a
check failed; ``2`` setup failed (a helper process did not start);
``3`` no card, NVML or torch with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SETUP = 2
EXIT_SKIPPED_REQUIRED = 3

#: The whole check must end within this; each step gets what is left, at most its own limit.
TOTAL_BUDGET_S = 280.0
STEP_TIMEOUT_S = 90.0

ROOT = Path(__file__).resolve().parent.parent


def _use_source_tree() -> None:
    """Put ``src/`` and ``wheels/*.whl`` on ``sys.path`` and on the workers' ``PYTHONPATH``."""
    paths = [str(ROOT / "src"), *sorted(glob.glob(str(ROOT / "wheels" / "*.whl")))]
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    existing = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([existing] if existing else [])])


_CO_TENANT = r"""
import sys, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()  # hold until the check closes our stdin
"""

_CONTEXT_PROBE = r"""
import json, os, torch
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
import pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByUUID(os.environ["CUDA_VISIBLE_DEVICES"])
rows = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
mine = [r.usedGpuMemory for r in rows if r.pid == os.getpid()]
print(json.dumps({"nvml_bytes": mine[0] if mine else None,
                  "torch_reserved": torch.cuda.memory_reserved(),
                  "mem_get_info_free": free, "mem_get_info_total": total}))
"""


class Deadline:
    """The check's time budget: every wait takes its timeout from here."""

    def __init__(self, total_s: float) -> None:
        self.end_s = time.monotonic() + total_s

    def timeout(self, limit_s: float = STEP_TIMEOUT_S) -> float:
        left = self.end_s - time.monotonic()
        if left <= 1:
            raise TimeoutError("the check's five-minute budget is spent")
        return min(limit_s, left)


# -- tasks (run in the pool's workers) ----------------------------------------------------


def torch_task(nbytes: int, spike: bool) -> dict[str, Any]:
    """Allocate ``nbytes`` with torch; ``spike``: free it at once and give it back (< 10 ms)."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    reserved_peak = torch.cuda.max_memory_reserved()
    ok = bool(x[-1].item() == 1)
    del x
    if spike:
        torch.cuda.empty_cache()
    else:
        time.sleep(1.0)
    return {"ok": ok, "torch_reserved_peak": reserved_peak, "pid": os.getpid()}


def cupy_task(nbytes: int) -> dict[str, Any]:
    """Allocate ``nbytes`` with CuPy and touch it."""
    import cupy

    x = cupy.ones(nbytes, dtype=cupy.uint8)
    ok = int(x[-1]) == 1
    del x
    return {"ok": ok, "pid": os.getpid()}


def jax_task(nbytes: int) -> dict[str, Any]:
    """Allocate ``nbytes`` with JAX and wait for it."""
    import jax.numpy as jnp

    x = jnp.ones((nbytes,), dtype=jnp.uint8).block_until_ready()
    ok = int(x[-1]) == 1
    del x
    return {"ok": ok, "pid": os.getpid()}


def sleeper(seconds: float) -> int:
    """A companion task, so the out-of-memory task does not run alone at first."""
    time.sleep(seconds)
    return os.getpid()


# -- helpers in the parent (never a CUDA context here) ------------------------------------


def _smi(index: int, deadline: Deadline) -> dict[str, int] | None:
    """nvidia-smi's total, used and free bytes of card ``index`` (it reports MiB)."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={index}",
                "--query-gpu=memory.total,memory.used,memory.free",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=deadline.timeout(30),
            check=True,
        ).stdout
        total, used, free = (int(v.strip()) * MiB for v in out.strip().split(","))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return {"total_bytes": total, "used_bytes": used, "free_bytes": free}


def _child_env(uuid: str) -> dict[str, str]:
    return dict(os.environ, CUDA_VISIBLE_DEVICES=uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")


def _context_probe(uuid: str, deadline: Deadline) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CONTEXT_PROBE],
        env=_child_env(uuid),
        capture_output=True,
        text=True,
        timeout=deadline.timeout(120),
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _start_co_tenant(uuid: str, gib: float, deadline: Deadline) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CO_TENANT, str(gib)],
        env=_child_env(uuid),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], deadline.timeout(120))
    if not ready or proc.stdout.readline().strip() != "ready":
        _stop(proc)
        raise RuntimeError(f"the co-tenant holding {gib} GiB did not start")
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def _card(index: int) -> dict[str, Any] | str:
    """Card ``index``'s UUID, name and total from NVML, or why there is none."""
    if importlib.util.find_spec("pynvml") is None:
        return "NVML's Python binding (nvidia-ml-py, module pynvml) is not installed"
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if index >= count:
            return f"NVML lists {count} device(s); there is no device {index}"
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception as exc:
        return f"NVML could not be read ({type(exc).__name__}: {exc}): no NVIDIA driver or card"
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    name = name.decode() if isinstance(name, bytes) else str(name)
    return {"uuid": uuid, "name": name}


def _peaks_by_key(log: Path) -> dict[str, int]:
    """The largest peak the pool recorded for each task key, from its decision log."""
    peaks: dict[str, int] = {}
    with open(log, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            key, peak = record.get("key"), record.get("peak_bytes")
            if isinstance(key, str) and isinstance(peak, int):
                peaks[key] = max(peak, peaks.get(key, 0))
    return peaks


# -- the checks ----------------------------------------------------------------------------


def check_census(index: int, uuid: str, result: dict[str, Any], deadline: Deadline) -> list[str]:
    from gpupool._sensors.census import read_census
    from gpupool._sensors.nvml import NvmlSensor

    sensor = NvmlSensor()
    try:
        census, _ = read_census(sensor, devices=[uuid], visible_devices=None)
    finally:
        sensor.close()
    card = census.cards[0]
    smi = _smi(index, deadline)
    probe = _context_probe(uuid, deadline)
    result["census"] = {
        "total_bytes": card.total_bytes,
        "free_bytes": card.free_bytes,
        "reserved_bytes": card.reserved_bytes,
        "own_bytes": card.own_bytes,
        "source": card.source,
        "nvidia_smi": smi,
        "mem_get_info": probe,
    }
    failures = []
    if card.total_bytes is None or card.free_bytes is None:
        return [f"census: card unreadable ({card.reason})"]
    if smi is not None:
        # nvidia-smi rounds to MiB; v2's free and nvidia-smi's agree to a few MiB.
        if abs(card.total_bytes - smi["total_bytes"]) > 2 * MiB:
            failures.append(f"census total {card.total_bytes} != nvidia-smi {smi['total_bytes']}")
        if abs(card.free_bytes - smi["free_bytes"]) > 256 * MiB:
            failures.append(f"census free {card.free_bytes} vs nvidia-smi {smi['free_bytes']}")
    if card.own_bytes != 0:
        failures.append(f"the check's parent holds {card.own_bytes} bytes: it must hold none")
    return failures


def check_peaks(
    uuid: str, context_bytes: int, total_bytes: int, result: dict[str, Any], deadline: Deadline
) -> list[str]:
    from gpupool import GpuPoolExecutor

    out = Path(result["out_dir"])
    log = out / "gpu_check_peaks.jsonl"
    log.unlink(missing_ok=True)
    nbytes = min(2 * GiB, total_bytes // 20)
    failures: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    with GpuPoolExecutor(max_workers=1, devices=[uuid], task_peak="6GiB", log_path=log) as ex:
        jobs = {
            "torch-first": ex.options(key="torch-first").submit(torch_task, nbytes, False),
            "torch-spike": ex.options(key="torch-spike").submit(torch_task, nbytes, True),
        }
        if importlib.util.find_spec("cupy") is not None:
            jobs["cupy"] = ex.options(key="cupy").submit(cupy_task, nbytes)
        if importlib.util.find_spec("jax") is not None:
            jobs["jax"] = ex.options(key="jax").submit(jax_task, nbytes)
        for name, future in jobs.items():
            runs[name] = future.result(timeout=deadline.timeout())
    peaks = _peaks_by_key(log)
    for name, run in runs.items():
        allocated = int(run.get("torch_reserved_peak") or nbytes)
        floor = allocated + context_bytes
        peak = peaks.get(name)
        run.update(recorded_peak_bytes=peak, floor_bytes=floor)
        if not run["ok"]:
            failures.append(f"peaks: {name} read back wrong data")
        if peak is None or peak < floor:
            failures.append(
                f"peaks: {name} recorded {peak} bytes, below allocated {allocated} + context "
                f"{context_bytes}"
            )
    result["peaks"] = runs
    return failures


def check_ooms(
    uuid: str, total_bytes: int, result: dict[str, Any], deadline: Deadline
) -> list[str]:
    from gpupool import GpuPoolExecutor
    from gpupool._probe import is_device_oom

    huge = int(total_bytes * 1.5)
    kinds: dict[str, Any] = {"torch": (torch_task, (huge, True))}
    if importlib.util.find_spec("cupy") is not None:
        kinds["cupy"] = (cupy_task, (huge,))
    if importlib.util.find_spec("jax") is not None:
        kinds["jax"] = (jax_task, (huge,))
    failures: list[str] = []
    outcome: dict[str, Any] = {}
    for name, (fn, args) in kinds.items():
        with GpuPoolExecutor(max_workers=2, devices=[uuid], task_peak="1GiB") as ex:
            companion = ex.submit(sleeper, 3.0)
            doomed = ex.options(key=f"oom-{name}").submit(fn, *args)
            error = doomed.exception(timeout=deadline.timeout())
            companion.result(timeout=deadline.timeout())
            stats = ex.statistics()
        outcome[name] = {
            "error": f"{type(error).__name__}: {error}"[:300] if error else None,
            "out_of_memory": stats.out_of_memory,
            "retries": stats.retries,
        }
        if error is None or not is_device_oom(error):
            failures.append(f"oom: {name}'s error was not a device out-of-memory: {error!r:.200}")
        if stats.out_of_memory < 1:
            failures.append(f"oom: {name}'s out-of-memory was not classified")
        if stats.retries < 1:
            failures.append(f"oom: {name}'s out-of-memory was not retried")
    result["ooms"] = outcome
    return failures


def check_co_tenant(
    index: int,
    uuid: str,
    gib: float,
    context_bytes: int,
    total_bytes: int,
    result: dict[str, Any],
    deadline: Deadline,
) -> list[str]:
    from gpupool import GpuPoolExecutor

    co_tenant = _start_co_tenant(uuid, gib, deadline)
    try:
        smi = _smi(index, deadline)
        nbytes = min(4 * GiB, total_bytes // 12)
        reserve = 256 * MiB
        estimate = nbytes + context_bytes + 512 * MiB
        with GpuPoolExecutor(
            max_workers=8, devices=[uuid], task_peak=estimate, reserve=reserve
        ) as ex:
            futures = [ex.submit(torch_task, nbytes, False) for _ in range(16)]
            runs = [f.result(timeout=deadline.timeout()) for f in futures]
            stats = ex.statistics()
    finally:
        _stop(co_tenant)
    widths = [w for _, w in stats.widths]
    failures = []
    if smi is None:
        failures.append("co-tenant: nvidia-smi gave no figures for the oracle")
        oracle = None
    else:
        true_peak = max(r["torch_reserved_peak"] for r in runs) + context_bytes
        oracle = math.floor((smi["total_bytes"] - smi["used_bytes"] - reserve) / true_peak)
        if widths and max(widths) > max(oracle, 1):
            failures.append(f"co-tenant: width {max(widths)} past the oracle's {oracle}")
    if stats.out_of_memory or not all(r["ok"] for r in runs):
        failures.append(f"co-tenant: {stats.out_of_memory} out-of-memory, or a bad result")
    result["co_tenant"] = {
        "gib": gib,
        "nvidia_smi": smi,
        "widths": widths,
        "oracle_width": oracle,
        "out_of_memory": stats.out_of_memory,
    }
    return failures


# -- the command ---------------------------------------------------------------------------


def _write(out: Path, result: dict[str, Any], lines: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    for line in lines:
        print(line)


def _nothing_checked(out: Path, why: str, require: bool) -> int:
    status = EXIT_SKIPPED_REQUIRED if require else EXIT_OK
    lines = [f"gpu_check: checked nothing: {why}"]
    if require:
        lines.append("gpu_check: FAILED: --require-gpu was given and there is no usable card")
    else:
        lines.append("gpu_check: nothing was checked (exit 0); pass --require-gpu to fail here")
    _write(out, {"checked": False, "reason": why, "require_gpu": require, "exit": status}, lines)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_check.py",
        description="Check gpupool on a real NVIDIA card. Run from the source tree: "
        "python3 bench/gpu_check.py --require-gpu --out gpu-check-results",
    )
    parser.add_argument("--require-gpu", action="store_true", help="fail (exit 3) without a card")
    parser.add_argument("--out", default=".", help="directory for gpu_check.json and .txt")
    parser.add_argument("--device", type=int, default=0, help="NVML index of the card (0)")
    parser.add_argument("--co-tenant-gib", type=float, default=None, help="default: 15%% of it")
    args = parser.parse_args(argv)
    out = Path(args.out)
    _use_source_tree()

    card = _card(args.device)
    if isinstance(card, str):
        return _nothing_checked(out, card, args.require_gpu)
    if importlib.util.find_spec("torch") is None:
        return _nothing_checked(out, "torch is not installed", args.require_gpu)
    deadline = Deadline(TOTAL_BUDGET_S)
    started = time.monotonic()
    result: dict[str, Any] = {"checked": True, "card": card, "out_dir": str(out.resolve())}
    out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    lines = [f"gpu_check: card {args.device} {card['name']} {card['uuid']}"]
    try:
        context = _context_probe(card["uuid"], deadline)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        _write(out, {**result, "setup_error": repr(exc)}, [f"gpu_check: SETUP FAILED: {exc!r}"])
        return EXIT_SETUP
    context_bytes = max(0, int(context["nvml_bytes"] or 0) - int(context["torch_reserved"]))
    total_bytes = int(context["mem_get_info_total"])
    result["context"] = {**context, "context_bytes": context_bytes}
    lines.append(f"context: {context_bytes / MiB:.0f} MiB measured (NVML row - torch reserved)")
    gib = args.co_tenant_gib if args.co_tenant_gib is not None else total_bytes * 0.15 / GiB
    steps = [
        ("census", lambda: check_census(args.device, card["uuid"], result, deadline)),
        ("peaks", lambda: check_peaks(card["uuid"], context_bytes, total_bytes, result, deadline)),
        ("ooms", lambda: check_ooms(card["uuid"], total_bytes, result, deadline)),
        (
            "co-tenant",
            lambda: check_co_tenant(
                args.device, card["uuid"], gib, context_bytes, total_bytes, result, deadline
            ),
        ),
    ]
    for name, step in steps:
        try:
            found = step()
        except Exception as exc:
            found = [f"{name}: raised {type(exc).__name__}: {exc}"[:500]]
        failures.extend(found)
        lines.append(f"{name}: {'ok' if not found else 'FAILED: ' + '; '.join(found)}")
    result["failures"] = failures
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    lines.append(f"elapsed {result['elapsed_s']} s")
    lines.append("gpu_check: PASSED" if not failures else "gpu_check: FAILED")
    result["exit"] = EXIT_OK if not failures else EXIT_FAILED
    _write(out, result, lines)
    return int(result["exit"])


if __name__ == "__main__":
    sys.exit(main())
