"""A prepared check of GpuPoolExecutor on a real NVIDIA card, against torch's and NVML's counters.

What it does, on card ``--device`` (NVML index, default 0):

1. measures the CUDA context: a throwaway process creates one with torch and
   reads its own NVML bytes against torch's reserved bytes;
2. starts a co-tenant: a plain ``subprocess`` that allocates ``--co-tenant-gib``
   with torch and holds it until this check ends;
3. runs ``--tasks`` torch tasks in a :class:`gpupool.GpuPoolExecutor`, each
   allocating and touching a ``--task-gib`` tensor for ``--sleep`` seconds;
   every task reports torch's peak counters and, where the driver lists the
   process, its NVML bytes;
4. prints the census, the widths the pool ran at, the measured peaks next to
   torch's and NVML's, the context, and the out-of-memory count; the decision
   log is written to ``--log`` (JSON Lines).

The oracle width is ``floor((total - co-tenant - own - reserve) / true peak)``
with the census's co-tenant and own bytes, the pool's reserve, and the true
peak of a task measured by NVML (tensor, allocator rounding and context); where
NVML does not list the workers (some containers) the tensor plus the measured
context stands in for it.

Exit status: ``0`` the check passed, or it was skipped because there is no
NVIDIA card, no NVML or no torch (a clear message says which; pass
``--require-gpu`` to make a skip exit ``3``); ``1`` the check failed (an
out-of-memory, a lost task, or a width past the oracle's); ``2`` the setup
failed (the co-tenant or the context probe could not start).

On the device, in an environment where gpupool is installed::

    pip install torch            # the CUDA build is the default wheel on Linux x86_64
    python bench/gpu_check.py    # about a minute on one card; always under five

The parent process never imports torch and never creates a CUDA context, as
gpupool's own parent does not: the census must see only the co-tenant.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

GiB = 1024**3
MiB = 1024**2

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SETUP = 2
EXIT_SKIPPED_REQUIRED = 3

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
import pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByUUID(os.environ["CUDA_VISIBLE_DEVICES"])
rows = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
mine = [r.usedGpuMemory for r in rows if r.pid == os.getpid()]
print(json.dumps({"nvml_bytes": mine[0] if mine else None,
                  "torch_reserved": torch.cuda.memory_reserved()}))
"""


def _nvml_process_bytes(uuid: str, pid: int) -> int | None:
    """This device's NVML bytes for ``pid``, or ``None`` where the driver does not list it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        for row in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if row.pid == pid:
                return int(row.usedGpuMemory) if row.usedGpuMemory is not None else None
    except Exception:
        return None
    return None


def torch_task(i: int, nbytes: int, sleep_s: float) -> dict[str, Any]:
    """The task: allocate and touch ``nbytes`` on the pinned card, hold it, report the counters."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    time.sleep(sleep_s)
    nvml = _nvml_process_bytes(os.environ.get("CUDA_VISIBLE_DEVICES", ""), os.getpid())
    report = {
        "i": i,
        "pid": os.getpid(),
        "torch_max_allocated": torch.cuda.max_memory_allocated(),
        "torch_max_reserved": torch.cuda.max_memory_reserved(),
        "nvml_bytes": nvml,
        "ok": bool(x[-1].item() == 1),
    }
    del x
    torch.cuda.reset_peak_memory_stats()
    return report


def _skip(message: str, require: bool) -> int:
    print(f"gpu_check: SKIPPED: {message}")
    if require:
        print("gpu_check: --require-gpu was given, so a skip is a failure (exit 3)")
        return EXIT_SKIPPED_REQUIRED
    print("gpu_check: nothing was checked (exit 0); run it on a machine with an NVIDIA card")
    return EXIT_OK


def _card(index: int) -> tuple[str, str, int] | str:
    """``(uuid, name, total)`` of NVML device ``index``, or why it cannot be read."""
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
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception as exc:
        return f"NVML could not be read ({type(exc).__name__}: {exc}): no NVIDIA driver or card"
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    name = name.decode() if isinstance(name, bytes) else name
    return uuid, name, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0, help="NVML index of the card")
    parser.add_argument("--co-tenant-gib", type=float, default=None, help="default: 12%% of it")
    parser.add_argument("--task-gib", type=float, default=None, help="default: room / 5")
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--sleep", type=float, default=2.0, help="seconds each task holds")
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--log", default=None, help="decision log (JSON Lines)")
    parser.add_argument("--require-gpu", action="store_true", help="a skip exits 3, not 0")
    args = parser.parse_args(argv)

    card = _card(args.device)
    if isinstance(card, str):
        return _skip(card, args.require_gpu)
    if importlib.util.find_spec("torch") is None:
        return _skip("torch is not installed (on the device: pip install torch)", args.require_gpu)
    uuid, name, total = card
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    started = time.monotonic()
    print(f"card {args.device}: {name} {uuid}, {total / GiB:.2f} GiB total")

    # 1. The context, measured in a throwaway process.
    probe = subprocess.run(
        [sys.executable, "-c", _CONTEXT_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        print(f"gpu_check: the context probe failed:\n{probe.stderr}")
        return EXIT_SETUP
    ctx = json.loads(probe.stdout.strip().splitlines()[-1])
    context = ctx["nvml_bytes"] - ctx["torch_reserved"] if ctx["nvml_bytes"] is not None else None
    print(
        f"context: {context / MiB:.0f} MiB (NVML {ctx['nvml_bytes']} B - torch reserved "
        f"{ctx['torch_reserved']} B)"
        if context is not None
        else "context: NVML does not list this process here; unknown"
    )

    # 2. The co-tenant.
    co_gib = args.co_tenant_gib if args.co_tenant_gib is not None else round(0.12 * total / GiB)
    tenant = subprocess.Popen(
        [sys.executable, "-c", _CO_TENANT, str(co_gib)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert tenant.stdout is not None
        line = tenant.stdout.readline().strip()
        if line != "ready":
            print(f"gpu_check: the co-tenant ({co_gib} GiB) did not start (exit {tenant.poll()})")
            return EXIT_SETUP
        print(f"co-tenant: pid {tenant.pid} holds {co_gib} GiB")
        return _check(args, uuid, total, context, co_gib, started)
    finally:
        if tenant.stdin is not None:
            tenant.stdin.close()
        try:
            tenant.wait(timeout=30)
        except subprocess.TimeoutExpired:
            tenant.kill()


def _check(
    args: argparse.Namespace,
    uuid: str,
    total: int,
    context: int | None,
    co_gib: float,
    started: float,
) -> int:
    from gpupool import GpuPoolExecutor
    from gpupool._core.units import format_size

    log = args.log or os.path.join(tempfile.mkdtemp(prefix="gpupool-gpu-check-"), "log.jsonl")
    reserve = 256 * MiB
    room_guess = total - int(co_gib * GiB) - reserve
    task_gib = args.task_gib if args.task_gib is not None else max(1, int(room_guess / 5 / GiB))
    nbytes = int(task_gib * GiB)
    estimate = nbytes + (context or 512 * MiB) + 256 * MiB
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    with GpuPoolExecutor(
        args.max_workers,
        task_peak=estimate,
        reserve=reserve,
        devices=[uuid],
        log_path=log,
    ) as ex:
        c = ex.census.cards[0]
        own = c.own_bytes or 0
        co_tenant = (c.total_bytes or 0) - (c.free_bytes or 0) - own
        print(
            f"census: total {format_size(c.total_bytes or 0)}, "
            f"free {format_size(c.free_bytes or 0)}, own {format_size(own)}, "
            f"co-tenant {format_size(co_tenant)} (source {c.source}, "
            f"reserved {c.reserved_bytes})"
        )
        print(f"tasks: {args.tasks} x {task_gib} GiB tensors, estimate {format_size(estimate)}")
        futures = [ex.submit(torch_task, i, nbytes, args.sleep) for i in range(args.tasks)]
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:
                errors.append(exc)
        stats = ex.statistics()
    with open(log, encoding="utf-8") as fh:
        decisions = [json.loads(line) for line in fh]
    pool_peaks = [d["peak_bytes"] for d in decisions if d.get("peak_bytes")]
    nvml = [r["nvml_bytes"] for r in results if r.get("nvml_bytes")]
    torch_res = [r["torch_max_reserved"] for r in results]
    true_peak = max(nvml) if nvml else nbytes + (context or 0)
    oracle = math.floor((total - co_tenant - own - reserve) / true_peak)
    widths = [w for _, w in stats.widths]
    ooms = stats.out_of_memory
    print(f"widths over time: {widths}; oracle width {oracle} (true peak {format_size(true_peak)})")
    print(
        f"peaks: pool measured {format_size(max(pool_peaks)) if pool_peaks else 'none'}"
        f"; torch max reserved {format_size(max(torch_res)) if torch_res else 'none'}"
        f"; NVML per process {format_size(max(nvml)) if nvml else 'not listed'}"
        f"; context {format_size(context) if context is not None else 'unknown'}"
    )
    print(f"asks: { {k: a.describe() for k, a in stats.asks.items()} }")
    print(
        f"out-of-memory: {ooms}, retries {stats.retries}, failed {len(errors)}, "
        f"bad results {sum(1 for r in results if not r['ok'])}; decision log {log}"
    )
    print(f"elapsed {time.monotonic() - started:.0f}s")
    failed = []
    if ooms or errors or any(not r["ok"] for r in results):
        failed.append("an out-of-memory or a lost task")
    if widths and max(widths) > oracle:
        failed.append(f"width {max(widths)} past the oracle's {oracle}")
    if failed:
        print(f"gpu_check: FAILED: {'; '.join(failed)}")
        return EXIT_FAILED
    print("gpu_check: PASSED")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
