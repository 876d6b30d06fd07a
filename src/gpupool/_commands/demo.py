"""``gpupool demo``: the incident's pipeline, run through the pool and through a fixed pool.

The canonical incident: 36 entries, each holding 6.02 GiB
briefly, on a 44.39 GiB card beside a 9.54 GiB serving co-tenant, from a
parent holding 16.20 GiB, with ``task_peak="9.9GiB"`` and ``max_workers=4``.
Without a GPU (or with ``--simulate``) it runs on :class:`gpupool.testing.SimulatedHost`:
first through :class:`~gpupool.GpuPoolExecutor`, then the same tasks through
``concurrent.futures.ProcessPoolExecutor(max_workers=4)`` (spawn) on the same
simulated card, and counts each run's out-of-memory events from the host's
ledger. With a real NVIDIA card and torch it runs a small torch workload of
known footprint on the card instead.

The task functions are module-level so that spawned children import them.
Printing goes through the ``say`` callback (the command line is the only module
that prints); the progress bar, when on, is tqdm's, on stderr.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool._core.units import format_size, parse_size

if TYPE_CHECKING:
    import subprocess

__all__ = ["INCIDENT", "demo_directory", "entry", "run_demo", "torch_entry"]

#: The demo's files, in :func:`demo_directory` unless the command line names others.
DEMO_LOG_NAME = "gpupool-demo.jsonl"
DEMO_PLOT_NAME = "gpupool-demo.png"


def demo_directory(temp: str | Path | None = None) -> Path:
    """Where the demo writes its log and plot when not told: a directory of this user's own
    under the system's temporary directory (``$TMPDIR/gpupool-demo-<uid>``), never the
    current directory (a source tree the README was followed in stays clean).

    A path there that is not a directory, is a link, or is not this user's alone (another
    user on the host made it first) is not used: a fresh private directory is made instead.
    """
    import stat
    import tempfile

    root = Path(temp if temp is not None else tempfile.gettempdir())
    path = root / f"gpupool-demo-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return Path(tempfile.mkdtemp(prefix="gpupool-demo-", dir=root))
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return Path(tempfile.mkdtemp(prefix="gpupool-demo-", dir=root))
    return path


#: The incident's figures, as the simulated host is built from.
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
#: four tasks overlap on the card (as the incident's did: an entry that cannot
#: allocate fails at once, so the workers soon meet two that hold); short
#: enough that the 36 entries hold under a second in all at gpupool's width of
#: 2 (measured: the whole demo in about 5 s on two idle cores).
ENTRY_HOLD_S = 0.05

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


#: Where the demo's numbers are explained, term by term: the page by its title, and the
#: command that prints it from the installed package.
DOCS_PAGE = "'The demo, explained': gpupool docs demo"

#: How often the demo reads the simulated card for its plot.
SAMPLE_INTERVAL_S = 0.02


def ignore_interrupt() -> None:
    """A worker initializer: Ctrl-C goes to the parent alone, which stops the run once.

    A terminal sends SIGINT to the whole process group; without this, every
    worker prints its own ``KeyboardInterrupt`` traceback.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Sampler:
    """Reads a simulated card's used bytes every :data:`SAMPLE_INTERVAL_S` in a thread."""

    def __init__(self, host: Any, device: int = 0) -> None:
        self.host = host
        self.device = device
        self.points: list[tuple[float, int]] = []
        self.started_s = time.monotonic()
        self.started_epoch_s = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpupool-demo-sampler", daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                used = self.host.used(self.device)
            except Exception:  # the host is going away: stop sampling
                return
            self.points.append((time.monotonic() - self.started_s, used))
            self._stop.wait(SAMPLE_INTERVAL_S)


def _preload_plotting() -> None:
    """Import matplotlib in a daemon thread, while the pools run (mostly waiting on tasks).

    Its first import is the larger part of drawing the plot (about 1 s of CPU);
    done beside the runs, the plot is drawn sooner after them. Without
    matplotlib this does nothing (the plot then says why it was not drawn).
    """

    def load() -> None:
        try:
            import matplotlib.backends.backend_agg
            import matplotlib.figure  # noqa: F401
        except Exception:  # not installed, or broken: _maybe_plot reports it
            return

    threading.Thread(target=load, name="gpupool-demo-preload", daemon=True).start()


def _real_card_present() -> bool:
    """Whether NVML finds a device (never inside a simulated host)."""
    from gpupool._errors import SensorError
    from gpupool._sensors.census import live_census
    from gpupool._sensors.select import read_simulator_ledger

    if read_simulator_ledger():
        return False
    try:
        sensor, census, _ = live_census()
    except (SensorError, ImportError):
        return False
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
    futures = [pool.submit(fn, *a) for a in args]
    try:
        return _follow(pool, futures, progress)
    except KeyboardInterrupt:
        for future in futures:
            future.cancel()
        raise


def _follow(pool: Any, futures: list[Any], progress: bool | None) -> tuple[int, int]:
    from gpupool._observe.progress import track

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
    say("   what it decided (every term: gpupool postmortem on the log):")
    for decision in decisions:
        say(f"   {decision.time_s:6.2f} s  {_short(decision)}")


def _short(decision: Any) -> str:
    """One decision in a short line: the event, the width's move, what set it, the ask."""
    parts = [decision.event]
    if decision.device is not None:
        parts.append(f"card {decision.device}")
    if decision.width_after is not None and decision.event != "shutdown":
        before = decision.width_before
        moved = f"{before} -> " if before is not None and before != decision.width_after else ""
        parts.append(f"width {moved}{decision.width_after}")
        if decision.limit:
            parts[-1] += f" ({decision.limit})"
    ask = decision.key_ask
    bound = decision.bound
    if ask is not None:
        parts.append(f"ask {format_size(ask.ask_bytes)} {ask.basis}")
    elif bound is not None:
        parts.append(f"ask {format_size(bound.ask_bytes)} {bound.ask_basis}")
    if decision.event == "shutdown":
        parts.append(decision.reason.split(";")[0].replace("pool shut down after ", ""))
    return ", ".join(parts)


def run_demo_isolated(
    *,
    log_path: str | Path = "gpupool-demo.jsonl",
    plot_path: str | Path | None = "gpupool-demo.png",
    simulate: bool = False,
    progress: bool | None = None,
    say: Callable[[str], None],
) -> int:
    """:func:`run_demo` in a child process of its own session; Ctrl-C stops it once, cleanly.

    A terminal sends Ctrl-C's SIGINT to its whole foreground process group:
    every worker of both pools would print its own ``KeyboardInterrupt``
    traceback (a worker still starting cannot ignore it yet). The demo runs
    in a new session instead, so only this process hears the terminal; it
    passes one SIGINT on to the demo, which cancels what has not started and
    exits quietly. Lines the demo says are relayed through ``say``; its
    progress bar writes to the inherited stderr.

    Raises:
        KeyboardInterrupt: after the demo stopped, when Ctrl-C stopped it.
    """
    import json
    import subprocess
    import sys

    from gpupool._observe.progress import progress_enabled

    options = {
        "log_path": str(log_path),
        "plot_path": None if plot_path is None else str(plot_path),
        "simulate": simulate,
        "progress": progress_enabled(progress),
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "gpupool._commands.demo", json.dumps(options)],
        env=_fixed_scenario_env(os.environ),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=ignore_interrupt,  # until its imports are done: see _child_main
    )
    interrupted = _relay(child, say)
    try:
        status = child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        status = child.wait()
    if interrupted or status == 130:
        raise KeyboardInterrupt
    return status


def _relay(child: subprocess.Popen[str], say: Callable[[str], None]) -> bool:
    """Relay the demo child's lines through ``say`` until it closes its output, passing the
    first Ctrl-C on to it; returns whether one came."""
    assert child.stdout is not None
    interrupted = False
    while True:
        try:
            for line in child.stdout:
                say(line.rstrip("\n"))
            break
        except KeyboardInterrupt:
            if not interrupted:
                interrupted = True
                child.send_signal(signal.SIGINT)
    child.stdout.close()
    return interrupted


def _fixed_scenario_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The demo child's environment: without the variables that set a pool's defaults and
    the CPU cap (``GPUPOOL_MAX_WORKERS``, ..., ``LOKY_MAX_CPU_COUNT``). The demo is a fixed
    scenario; a pipeline's settings in the shell, good or bad, neither change nor fail it."""
    from gpupool._pool import environ as pool_environ

    names = {getattr(pool_environ, name) for name in pool_environ.__all__ if name.endswith("_ENV")}
    return {name: value for name, value in environ.items() if name not in names}


def _child_main(argv: list[str]) -> int:
    """``python -m gpupool._commands.demo OPTIONS``: the child of :func:`run_demo_isolated`."""
    import json

    options = json.loads(argv[0])

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # The module by its name, not as __main__: task keys read gpupool._commands.demo.entry.
        import gpupool._commands.demo as demo

        return demo.run_demo(say=say, **options)
    except KeyboardInterrupt:
        return 130


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
    """The incident on a simulated card: gpupool, then a fixed pool, then the two compared."""
    from gpupool.testing import SimulatedDevice, SimulatedHost, hold

    inc = INCIDENT
    n = inc["entries"]
    log = _fresh_log(log_path)
    if plot_path is not None:
        _preload_plotting()
    _say_incident(say)
    card = SimulatedDevice(inc["card_total"], co_tenants={"serve": inc["co_tenant"]})
    args = [(i, hold_s, inc["entry_holds"]) for i in range(n)]
    with (
        SimulatedHost([card], cpus=inc["cpus"], host_ram=inc["host_ram"]) as host,
        hold(inc["parent_holds"]),
    ):
        ours, failed, gpupool_ooms = _run_gpupool_side(host, args, log, progress, say)
        theirs, std_s, std_events = _run_fixed_side(host, args, progress, say)
        total_bytes = host.devices[0].total_bytes
    say("")
    say(f"decision log: {log}")
    say(f"  read it back: gpupool postmortem {shlex.quote(str(log))}")
    if plot_path is not None:
        fixed = _fixed_pool_view(
            theirs, std_events, total_bytes=total_bytes, width=inc["max_workers"], end_s=std_s
        )
        _maybe_plot(log, plot_path, say, used=ours.points, beside=fixed)
    say(f"comparison: the same {n} tasks ran the card out of memory")
    say(
        f"  {len(std_events)} times under a fixed pool of {inc['max_workers']}, "
        f"{gpupool_ooms} under gpupool."
    )
    say(f"every number above, explained: {DOCS_PAGE}")
    return 0 if gpupool_ooms == 0 and failed == 0 else 1


def _say_incident(say: Callable[[str], None]) -> None:
    """The scenario's figures, so a reader can check the runs' numbers against them."""
    from gpupool.testing import DEFAULT_CONTEXT

    inc = INCIDENT
    say("gpupool demo: the incident, on a simulated card (no GPU needed)")
    say(
        f"  a {format_size(parse_size(inc['card_total']))} card; a serving co-tenant holds "
        f"{format_size(parse_size(inc['co_tenant']))},"
    )
    say(
        f"  the parent {format_size(parse_size(inc['parent_holds']))}; {inc['entries']} entries "
        f"of {format_size(parse_size(inc['entry_holds']))} each"
    )
    context = parse_size(DEFAULT_CONTEXT)
    say(f"  each process on it also holds a {format_size(context)} CUDA context, so the")
    say(
        f"  parent reads {format_size(parse_size(inc['parent_holds']) + context)} and an entry "
        f"{format_size(parse_size(inc['entry_holds']) + context)}"
    )


def _run_gpupool_side(
    host: Any,
    args: list[tuple[Any, ...]],
    log: Path,
    progress: bool | None,
    say: Callable[[str], None],
) -> tuple[_Sampler, int, int]:
    """Part 1: the entries through gpupool, with what it decided; returns the card's samples,
    how many entries failed and how many times the card ran out."""
    from gpupool._pool.executor import GpuPoolExecutor

    inc = INCIDENT
    say("")
    say(f"1. GpuPoolExecutor(max_workers={inc['max_workers']}, task_peak={inc['task_peak']!r})")
    start = time.monotonic()
    with (
        _Sampler(host) as ours,
        GpuPoolExecutor(
            max_workers=inc["max_workers"],
            task_peak=inc["task_peak"],
            log_path=log,
            initializer=ignore_interrupt,
        ) as pool,
    ):
        done, failed = _run_pool(pool, entry, args, progress)
        stats = pool.statistics()
    elapsed_s = time.monotonic() - start
    ooms = len(host.out_of_memory_events)
    peak_bytes = host.device_peak(0)
    _say_decisions(say, pool.decisions)
    widths = " -> ".join(str(w) for _, w in stats.widths) or str(stats.width)
    say(f"   {done} completed, {failed} failed in {elapsed_s:.1f} s; width {widths}")
    say(
        f"   {ooms} out-of-memory; card peak {format_size(peak_bytes)} of "
        f"{format_size(host.devices[0].total_bytes)}"
    )
    return ours, failed, ooms


def _run_fixed_side(
    host: Any, args: list[tuple[Any, ...]], progress: bool | None, say: Callable[[str], None]
) -> tuple[_Sampler, float, list[Any]]:
    """Part 2: the same entries through CPython's fixed pool (spawn) on the same card; returns
    the card's samples, the run's seconds and its out-of-memory events."""
    inc = INCIDENT
    before = len(host.out_of_memory_events)
    say("")
    say(f"2. concurrent.futures.ProcessPoolExecutor(max_workers={inc['max_workers']})")
    start = time.monotonic()
    spawn = multiprocessing.get_context("spawn")
    with (
        _Sampler(host) as theirs,
        concurrent.futures.ProcessPoolExecutor(
            max_workers=inc["max_workers"], mp_context=spawn, initializer=ignore_interrupt
        ) as stdlib,
    ):
        done, failed = _run_pool(stdlib, entry, args, progress)
    elapsed_s = time.monotonic() - start
    events: list[Any] = host.out_of_memory_events[before:]
    say(
        f"   {done} completed, {failed} failed in {elapsed_s:.1f} s at a fixed width "
        f"of {inc['max_workers']}"
    )
    say(
        f"   {len(events)} out-of-memory (SimulatedOutOfMemory); card peak "
        f"{format_size(host.device_peak(0))}"
    )
    return theirs, elapsed_s, events


def _fixed_pool_view(
    sampler: _Sampler, events: list[Any], *, total_bytes: int, width: int, end_s: float
) -> Any:
    """The fixed pool's column of the plot: what the card held, and where it ran out."""
    from gpupool._observe.plot import CardView

    return CardView(
        title=(
            f"ProcessPoolExecutor(max_workers={width}): {format_size(total_bytes)} card; "
            f"{len(events)} out-of-memory"
        ),
        name="fixed pool",
        total_bytes=total_bytes,
        end_s=max(end_s, 1e-3),
        used=sampler.points,
        used_label="used (the simulated card, sampled)",
        used_sampled=True,
        width=[(0.0, width)],
        marks={
            "out_of_memory": [
                (
                    max(0.0, e.time_s - sampler.started_epoch_s),
                    e.used_bytes + e.requested_bytes,
                    f"SimulatedOutOfMemory: process {e.pid} was refused "
                    f"{format_size(e.requested_bytes)} with "
                    f"{format_size(e.used_bytes)} of {format_size(total_bytes)} in use",
                )
                for e in events
            ]
        },
    )


def _run_real(
    *,
    log_path: str | Path,
    plot_path: str | Path | None,
    progress: bool | None,
    say: Callable[[str], None],
) -> int:
    from gpupool._pool.executor import GpuPoolExecutor

    log = _fresh_log(log_path)
    if plot_path is not None:
        _preload_plotting()
    say(
        f"gpupool demo (real card): {TORCH_ENTRIES} torch entries of "
        f"{format_size(TORCH_ENTRY_BYTES)} each, task_peak={TORCH_TASK_PEAK}, max_workers=4"
    )
    start = time.monotonic()
    with GpuPoolExecutor(
        max_workers=4, task_peak=TORCH_TASK_PEAK, log_path=log, initializer=ignore_interrupt
    ) as pool:
        args = [(i, TORCH_ENTRY_BYTES) for i in range(TORCH_ENTRIES)]
        done, failed = _run_pool(pool, torch_entry, args, progress)
        stats = pool.statistics()
    _say_decisions(say, pool.decisions)
    say(
        f"gpupool: {done} completed, {failed} failed in {time.monotonic() - start:.1f} s; "
        f"{stats.out_of_memory} out-of-memory"
    )
    say(f"decision log: {log}  (read it back: gpupool postmortem {shlex.quote(str(log))})")
    if plot_path is not None:
        _maybe_plot(log, plot_path, say)
    return 0 if failed == 0 else 1


def demo_columns(
    log: Path, *, used: list[tuple[float, int]] | None = None, beside: Any = None
) -> list[list[Any]]:
    """The demo figure's columns: the pool's run from its log (its first card drawn with the
    demo's own samples of the card, when given), then ``beside`` (the fixed pool's view)."""
    from gpupool._observe.plot import card_views
    from gpupool._observe.postmortem import read_runs

    columns: list[list[Any]] = card_views(read_runs(log))
    if used and columns and columns[0]:
        first = columns[0][0]
        first.used = used
        first.used_label = "used (the simulated card, sampled)"
        first.used_sampled = True
        first.title = "GpuPoolExecutor: " + first.title
    if beside is not None:
        columns.append([beside])
    return columns


#: The demo figure's title.
DEMO_TITLE = "gpupool demo: the same 36 tasks, packed by gpupool (left) and a fixed pool"


def _maybe_plot(
    log: Path,
    plot_path: str | Path,
    say: Callable[[str], None],
    *,
    used: list[tuple[float, int]] | None = None,
    beside: Any = None,
) -> None:
    from gpupool._observe.plot import PlotUnavailableError, write_plot

    columns = demo_columns(log, used=used, beside=beside)
    try:
        write_plot([], plot_path, columns=columns, title=DEMO_TITLE)
    except PlotUnavailableError as exc:
        import textwrap

        for line in textwrap.wrap(f"no plot: {exc}", 78, subsequent_indent="  "):
            say(line)
        return
    say(f"plot: {plot_path}")


if __name__ == "__main__":  # pragma: no cover - run by run_demo_isolated
    import sys

    sys.exit(_child_main(sys.argv[1:]))
