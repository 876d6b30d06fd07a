"""``gpupool demo``: the incident's pipeline, run through the pool and through a fixed pool.

The canonical incident (``DESIGN.md``): 36 entries, each holding 6.02 GiB
briefly, on a 44.39 GiB card beside a 9.54 GiB serving co-tenant, from a
parent holding 16.20 GiB, with ``task_peak="9.9GiB"`` and ``max_workers=4``.
Without a GPU (or with ``--simulate``) it runs on :class:`gpupool.testing.SimulatedHost`:
first through :class:`~gpupool.GpuPoolExecutor`, then the same tasks through
``concurrent.futures.ProcessPoolExecutor(max_workers=4)`` (spawn) on the same
simulated card, and counts each run's out-of-memory events from the host's
ledger. With a real NVIDIA card and torch it runs a small torch workload of
known footprint on the card instead.

The task functions are module-level so that spawned children import them.
Printing goes through the ``say`` callback (``cli.py`` is the only module
that prints); the progress bar, when on, is tqdm's, on stderr.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpupool._core.units import format_size

__all__ = ["INCIDENT", "entry", "run_demo", "torch_entry"]

#: The incident's figures (``shared/seeds/003``), as the simulated host is built from.
INCIDENT: dict[str, Any] = {
    "entries": 36,
    "card_total": "44.39GiB",
    "co_tenant": "9.54GiB",
    "parent_holds": "16.20GiB",
    "entry_holds": "6.02GiB",
    "task_peak": "9.9GiB",
    "max_workers": 4,
    "cpus": 16,
    "host_ram": "128GiB",
}

#: How long each simulated entry holds its bytes. Long enough that a fixed pool's
#: four tasks overlap on the card (as the incident's did), short enough that
#: both runs finish in well under a minute on two cores (measured: about 10 s).
ENTRY_HOLD_S = 0.1

#: The real-card workload: bytes each task allocates with torch, and its estimate
#: (the allocation plus a CUDA context, generously).
TORCH_ENTRY_BYTES = 512 * 1024**2
TORCH_TASK_PEAK = "1.5GiB"
TORCH_ENTRIES = 16


def entry(index: int, hold_s: float = ENTRY_HOLD_S, size: str = "6.02GiB") -> int:
    """One simulated entry: hold ``size`` on this process's card for ``hold_s`` seconds."""
    from gpupool.testing import hold

    with hold(size):
        time.sleep(hold_s)
    return index


def torch_entry(index: int, nbytes: int = TORCH_ENTRY_BYTES, hold_s: float = 0.2) -> int:
    """One real entry: allocate ``nbytes`` on the pinned CUDA device, hold it, free it."""
    import torch

    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    time.sleep(hold_s)
    del block
    return index


def _real_card_present() -> bool:
    """Whether NVML finds a device (never inside a simulated host)."""
    from gpupool._errors import SensorError
    from gpupool._sensors.census import read_census
    from gpupool._sensors.select import SIMULATOR_ENV, default_sensor

    if os.environ.get(SIMULATOR_ENV):
        return False
    try:
        sensor = default_sensor()
    except (SensorError, ImportError):
        return False
    try:
        census, _ = read_census(sensor, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    except SensorError:
        return False
    finally:
        sensor.close()
    return census.driver and bool(census.cards)


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _fresh_log(path: str | Path) -> Path:
    """The demo's log starts empty: a decision log appends, and two runs in one file mislead."""
    log = Path(path)
    if log.exists() and log.is_file():
        log.unlink()
    return log


def _run_pool(
    pool: Any,
    fn: Callable[..., Any],
    args: list[tuple[Any, ...]],
    progress: bool | None,
) -> tuple[int, int]:
    """Submit every task, follow them with a progress bar; returns ``(completed, failed)``."""
    from gpupool._progress import track

    futures = [pool.submit(fn, *a) for a in args]
    done = failed = 0
    observed = pool if hasattr(pool, "statistics") else None
    for future in track(
        concurrent.futures.as_completed(futures),
        total=len(futures),
        executor=observed,
        enabled=progress,
        desc="gpupool" if observed is not None else "stdlib",
    ):
        if future.exception() is None:
            done += 1
        else:
            failed += 1
    return done, failed


def _say_decisions(say: Callable[[str], None], decisions: Any) -> None:
    say("what the pool decided, in words:")
    for decision in decisions:
        say(f"  {decision.time_s:6.2f} s  {decision.event}: {decision.reason}")


def run_demo(
    *,
    log_path: str | Path = "gpupool-demo.jsonl",
    plot_path: str | Path | None = "gpupool-demo.png",
    simulate: bool = False,
    progress: bool | None = None,
    say: Callable[[str], None],
    hold_s: float = ENTRY_HOLD_S,
) -> int:
    """Run the demo; returns the exit status (0 when gpupool never ran a card out).

    Args:
        log_path: the decision log to write (overwritten).
        plot_path: the PNG to draw, when matplotlib is installed; ``None``: none.
        simulate: use the simulated host even when a real card is present.
        progress: the progress bar: ``None`` when stderr is a terminal.
        say: prints one line.
        hold_s: how long each simulated entry holds its bytes.
    """
    if not simulate and _real_card_present():
        if _torch_importable():
            return _run_real(log_path=log_path, plot_path=plot_path, progress=progress, say=say)
        say(
            "a real NVIDIA card is present, but the real-card demo needs torch "
            "(pip install torch); running on the simulated host instead."
        )
    return _run_simulated(
        log_path=log_path, plot_path=plot_path, progress=progress, say=say, hold_s=hold_s
    )


def _run_simulated(
    *,
    log_path: str | Path,
    plot_path: str | Path | None,
    progress: bool | None,
    say: Callable[[str], None],
    hold_s: float,
) -> int:
    from gpupool._pool.executor import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost, hold

    inc = INCIDENT
    n = inc["entries"]
    log = _fresh_log(log_path)
    say(
        f"gpupool demo (simulated host): {n} entries of {inc['entry_holds']} each on a "
        f"{inc['card_total']} card beside a {inc['co_tenant']} serving co-tenant, from a parent "
        f"holding {inc['parent_holds']}; task_peak={inc['task_peak']}, "
        f"max_workers={inc['max_workers']}"
    )
    card = SimulatedDevice(inc["card_total"], co_tenants={"serve": inc["co_tenant"]})
    args = [(i, hold_s, inc["entry_holds"]) for i in range(n)]
    start = time.monotonic()
    with (
        SimulatedHost([card], cpus=inc["cpus"], host_ram=inc["host_ram"]) as host,
        hold(inc["parent_holds"]),
    ):
        with GpuPoolExecutor(
            max_workers=inc["max_workers"], task_peak=inc["task_peak"], log_path=log
        ) as pool:
            done, failed = _run_pool(pool, entry, args, progress)
            stats = pool.statistics()
        gpupool_s = time.monotonic() - start
        gpupool_ooms = len(host.out_of_memory_events)
        _say_decisions(say, pool.decisions)
        widths = " -> ".join(str(w) for _, w in stats.widths) or str(stats.width)
        say(
            f"gpupool: {done} completed, {failed} failed in {gpupool_s:.1f} s; width {widths}; "
            f"{gpupool_ooms} out-of-memory; card peak {format_size(host.device_peak(0))} of "
            f"{format_size(host.devices[0].total_bytes)}"
        )
        start = time.monotonic()
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=inc["max_workers"], mp_context=context
        ) as stdlib:
            std_done, std_failed = _run_pool(stdlib, entry, args, progress)
        std_s = time.monotonic() - start
        std_ooms = len(host.out_of_memory_events) - gpupool_ooms
        say(
            f"stdlib: {std_done} completed, {std_failed} failed (SimulatedOutOfMemory) in "
            f"{std_s:.1f} s at a fixed width of {inc['max_workers']}; card peak "
            f"{format_size(host.device_peak(0))}"
        )
    say(f"decision log: {log}  (read it back: gpupool postmortem {log})")
    _maybe_plot(log, plot_path, say)
    say(
        f"comparison: the same {n} tasks under a fixed concurrent.futures.ProcessPoolExecutor"
        f"(max_workers={inc['max_workers']}) ran out of memory {std_ooms} times; "
        f"gpupool ran out {gpupool_ooms} times."
    )
    return 0 if gpupool_ooms == 0 and failed == 0 else 1


def _run_real(
    *,
    log_path: str | Path,
    plot_path: str | Path | None,
    progress: bool | None,
    say: Callable[[str], None],
) -> int:
    from gpupool._pool.executor import GpuPoolExecutor

    log = _fresh_log(log_path)
    say(
        f"gpupool demo (real card): {TORCH_ENTRIES} torch entries of "
        f"{format_size(TORCH_ENTRY_BYTES)} each, task_peak={TORCH_TASK_PEAK}, max_workers=4"
    )
    start = time.monotonic()
    with GpuPoolExecutor(max_workers=4, task_peak=TORCH_TASK_PEAK, log_path=log) as pool:
        args = [(i, TORCH_ENTRY_BYTES) for i in range(TORCH_ENTRIES)]
        done, failed = _run_pool(pool, torch_entry, args, progress)
        stats = pool.statistics()
    _say_decisions(say, pool.decisions)
    say(
        f"gpupool: {done} completed, {failed} failed in {time.monotonic() - start:.1f} s; "
        f"{stats.out_of_memory} out-of-memory"
    )
    say(f"decision log: {log}  (read it back: gpupool postmortem {log})")
    _maybe_plot(log, plot_path, say)
    return 0 if failed == 0 else 1


def _maybe_plot(log: Path, plot_path: str | Path | None, say: Callable[[str], None]) -> None:
    if plot_path is None:
        return
    from gpupool._plot import PlotUnavailableError, write_plot
    from gpupool._postmortem import read_postmortem

    try:
        write_plot(read_postmortem(log), plot_path)
    except PlotUnavailableError as exc:
        say(f"no plot: {exc}")
        return
    say(f"plot: {plot_path}")
