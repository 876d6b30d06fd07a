"""The device check: gpupool on a real NVIDIA card, against an oracle the library does not read.

One command, from the root of the source tree, on the machine with the card::

    python3 bench/gpu_check.py --require-gpu --out "$OUT"

It needs no network and no installed gpupool: it puts ``src/``, any
``wheels/*.whl`` (pure-Python wheels import as zips) and ``bench/`` on
``sys.path`` and on the workers' ``PYTHONPATH``. This module is the command
(its arguments, the order of the steps, the summary); the steps are in
``bench/gpu_check_steps.py`` and the tasks the pools run in
``bench/gpu_check_tasks.py``, which the workers import by name. It needs
torch with CUDA, nvidia-ml-py, cloudpickle and psutil; CuPy and JAX tasks run
where those are installed.
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
   with the probe's estimate (``CONTEXT_ESTIMATE_BYTES``, what a context is
   priced at where no row of the worker can be read). ``nvidia-smi
   --query-compute-apps`` is read while the throwaway process runs: whether
   this machine lists per-process rows at all (a report). Its own NVML row
   must be there and above 0 on a bare-metal card.
4. **peaks**: tasks in a one-worker pool: torch (hold; a spike freed with
   ``empty_cache``; a matmul and a convolution), a CuPy spike freed with
   ``free_all_blocks`` before the task returns, JAX (asserted on the GPU,
   ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` so it gives memory back), a
   subprocess that holds memory (the task's process tree), a double-forked
   daemon that holds memory (the worker is a child subreaper), torch in the
   worker beside a child that holds as much, a managed
   allocation (``report``: it is expected to be invisible), and the
   matmul-and-convolution task again in a pool with eager loading. Each
   peak the pool recorded must reach the oracle less ``--tolerance-mib``; its
   source must be a measurement (not ``none``, not an allowance or estimate);
   the freed tasks must have given their memory back (else the check has no
   teeth); each worker's row must be there on a bare-metal card; the context
   the probe priced the worker at must be measured from its row and reach the
   context step's (a check in the dry run, a report on a card).
4b. **cap**: with ``cap_allocator=True``, torch in the worker and then a child
   that holds the task's bytes: torch's allowance plus the child's bytes on the
   card must stay within the booked ask.
4c. **hidden-rows**: torch in the worker beside a child that holds as much, on a
   card that does not give the rows (the dry run: a container, rows of 0, rows
   without a figure, a MIG instance; a card: the card as it is): the peak must
   reach the oracle or be flagged incomplete, and the key's ask must not fall
   below the oracle.
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

``--dry-run`` runs every step's logic on gpupool's simulated host (no card), so
the script is known to work before a card is lent. Its pools read the card
through gpupool's real NVML sensor (the tree sensor, the probe's sampled path)
over the ``pynvml`` double in ``tests/sensors/nvml_double`` that the simulated
host feeds (rows listed, hidden, 0 or without a figure, as that host says), and
their workers' torch is the stand-in of ``tests/standin_torch.py``, charged on
the simulated card: a defect in the sensor code fails the dry run
(``tests/test_gpu_check_defects.py``). It needs the source tree's ``tests/``.
``--steps`` runs some steps only. No run reads or writes the peaks pools
remember between runs. ``--break-probe`` (dry run only) makes every
worker's probe report a quarter of the device peak; the summary names the
checks that caught it, and any check that guards peaks and did not fire.

Exit status: ``0`` every check passed, or there is no card and
``--require-gpu`` was not given (it says it checked nothing); ``1`` a check
failed; ``2`` setup failed; ``3`` no card, NVML or torch with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``bench/``: the check's other modules, imported here and, by name, in the pool's workers.
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gpu_check_steps import (  # noqa: E402
    DRY_RUN_CONTEXT,
    Deadline,
    Run,
    check,
    peak_jobs,
    step_cap,
    step_census,
    step_co_tenant,
    step_context,
    step_environment,
    step_hidden_rows,
    step_ooms,
    step_peaks,
)
from gpu_check_tasks import SIMULATOR_ENV, GiB, MiB, torch_task  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_SETUP, EXIT_SKIPPED_REQUIRED = 0, 1, 2, 3

#: The steps, in the order they run (``--steps`` picks some of them).
STEPS = (
    "environment",
    "census",
    "context",
    "peaks",
    "peaks-eager",
    "cap",
    "hidden-rows",
    "ooms",
    "co-tenant",
)

#: The whole run must end within this (expected: 3-4 minutes), so that a second run fits
#: in a lent machine's 15 minutes; the watchdog ends it ``WATCHDOG_GRACE_S`` later.
TOTAL_BUDGET_S = 330.0
WATCHDOG_GRACE_S = 30.0
DRY_RUN_BUDGET_S = 240.0

ROOT = BENCH.parent


#: The dry run's ``pynvml``: the simulator-fed NVML double (``nvml_double/pynvml.py``, and
#: the modules it imports beside it), first on every process's path in a dry run only.
NVML_DOUBLE = (ROOT / "tests" / "sensors" / "nvml_double", ROOT / "tests" / "sensors")


def _use_source_tree(dry_run: bool = False) -> None:
    """Put ``src/``, ``wheels/*.whl`` and ``bench/`` on ``sys.path`` and on the workers'
    ``PYTHONPATH``; for a dry run the NVML double first."""
    paths = [str(p) for p in NVML_DOUBLE] if dry_run else []
    paths += [str(ROOT / "src"), *sorted(glob.glob(str(ROOT / "wheels" / "*.whl")))]
    # The workers import the tasks by name (gpupool pickles them by reference): bench/ too.
    paths.append(str(BENCH))
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    existing = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([existing] if existing else [])])


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
    every: list[tuple[str, Callable[[], None]]] = [
        ("environment", lambda: step_environment(run)),
        ("census", lambda: step_census(run)),
        ("context", lambda: step_context(run)),
        ("peaks", lambda: step_peaks(run, "peaks", peak_jobs(run), CUDA_MODULE_LOADING="LAZY")),
        ("peaks-eager", lambda: step_peaks(run, "peaks-eager", eager, CUDA_MODULE_LOADING="EAGER")),
        ("cap", lambda: step_cap(run)),
        ("hidden-rows", lambda: step_hidden_rows(run)),
        ("ooms", lambda: step_ooms(run)),
        ("co-tenant", lambda: step_co_tenant(run)),
    ]
    assert [name for name, _ in every] == list(STEPS)
    steps = [(name, step) for name, step in every if name in (run.steps or STEPS)]
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

    missing = [str(p) for p in NVML_DOUBLE if not p.is_dir()]
    if missing:
        print(
            f"gpu_check: SETUP FAILED: the dry run reads the simulated card through the NVML "
            f"double in the source tree's tests/sensors, which lacks {', '.join(missing)}: "
            "run it from a checkout or an sdist",
            flush=True,
        )
        return EXIT_SETUP
    host = SimulatedHost(
        [SimulatedDevice("140GiB")], context=DRY_RUN_CONTEXT, cpus=16, host_ram="128GiB"
    )
    with host:
        run = Run(
            out=out,
            deadline=Deadline(DRY_RUN_BUDGET_S),
            dry_run=True,
            broken=args.break_probe,
            tolerance_bytes=args.tolerance_mib * MiB,
            uuid=host.device_uuid(0),
            # Long enough that the sampled path reads a hold on 2 loaded cores (its
            # sampler reads every 10 ms; a process may wait far longer for a core).
            hold_s=0.5,
            nvml_double=True,
            steps=args.steps,
        )
        return run_steps(run)


def _steps(text: str) -> tuple[str, ...]:
    """``--steps``: known step names, comma-separated, run in their usual order."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(STEPS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown step(s) {', '.join(unknown) or '(none given)'}; the steps are "
            f"{','.join(STEPS)}"
        )
    return tuple(name for name in STEPS if name in names)


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
    parser.add_argument(
        "--steps",
        type=_steps,
        default=STEPS,
        help=f"comma-separated steps to run, of {','.join(STEPS)} (default: all)",
    )
    args = parser.parse_args(argv)
    if args.break_probe and not args.dry_run:
        parser.error("--break-probe is meant only for the dry run: add --dry-run")
    if args.dry_run and args.require_gpu:
        parser.error(
            "--require-gpu asks for a real card and --dry-run runs on a simulated one "
            "(it would pass with no card): give one of them"
        )
    if args.dry_run and args.device != 0:
        parser.error("--device: the dry run has one simulated card, index 0")
    if args.tolerance_mib < 0:
        parser.error("--tolerance-mib must be 0 or more (it is slack on the peaks floor)")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    _use_source_tree(dry_run=args.dry_run)
    # Every pool of the check measures afresh: peaks remembered from an earlier run (of the
    # check, or the user's own pools on this card model) would price its tasks, and the
    # out-of-memory step's task would no longer be priced short; nor is the check remembered.
    os.environ["GPUPOOL_MEMORY"] = "off"
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
        steps=args.steps,
    )
    run.result["card"] = card
    return run_steps(run)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a pool that could not be stopped must not hold the exit
