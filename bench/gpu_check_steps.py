"""The device check's steps: the run they share (budget, report, pools) and steps 1 to 6.

``bench/gpu_check.py`` is the command and says what each step checks; the tasks the
steps' pools run are in ``bench/gpu_check_tasks.py``. gpupool is imported only
inside functions, once the command has put ``src/`` on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpu_check_tasks import (
    WAIT_S,
    GiB,
    MiB,
    break_probe,
    cap_child_task,
    card_reading,
    companion,
    cupy_spike_task,
    double_fork_task,
    dry_run_worker,
    jax_task,
    managed_task,
    oom_task,
    start_holder,
    stop_holder,
    subprocess_task,
    torch_child_task,
    torch_task,
)

#: A pool's shutdown waits at most this long (then its workers are killed).
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
#: A peak source that is not a measurement.
FALLBACK_WORDS = ("allowance", "estimated")
#: The dry run's simulated context (what a process is charged on its first allocation).
DRY_RUN_CONTEXT = "300MiB"
#: The dry run's cards whose rows the driver does not give (``SimulatedHost(rows=...)``, and a
#: MIG instance): the hidden-rows step runs a torch worker with a child on each.
HIDDEN_ROWS_MODES = ("hidden", "zero", "unavailable", "mig")


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
    #: The dry run: pools read the card through the real NVML sensor over the simulator-fed
    #: ``pynvml`` double (``tests/sensors/nvml_double``), never the simulator's exact ledger.
    nvml_double: bool = False
    #: The steps to run (``--steps``; the command's ``STEPS`` by default).
    steps: tuple[str, ...] = ()
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
        return card_reading(self.uuid)

    def sensor(self) -> Any:
        """The sensor pools and the census read the card through: NVML (over the double in
        the dry run), or ``None`` for the pool's default."""
        if not self.nvml_double:
            return None
        from gpupool._sensors.nvml import NvmlSensor

        return NvmlSensor()

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

    initializer: Any = break_probe if run.broken else None
    if run.nvml_double:  # the stand-in torch, charged on the simulated card
        initializer = functools.partial(dry_run_worker, run.total_bytes, run.broken)
    ex = GpuPoolExecutor(devices=[run.uuid], initializer=initializer, sensor=run.sensor(), **kwargs)
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

    sensor = run.sensor() or default_sensor()
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
    from gpupool._child import probe as _probe

    # The estimate the probe prices a context at where no row of the worker can be read.
    figure = getattr(_probe, "CONTEXT_ESTIMATE_BYTES", None)
    checks: list[dict[str, Any]] = []
    figures: dict[str, Any] = {}
    for mode in ("lazy", "eager"):
        baseline = run.card()["used"]
        env = run.child_env(CUDA_MODULE_LOADING=mode.upper())
        proc, child = start_holder(0, "conv", run.deadline.timeout(), env)
        try:
            used = run.card()["used"]
            if mode == "lazy":
                checks.append(_compute_apps(run, int(child["pid"])))
        finally:
            stop_holder(proc)
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
    model = _model_figure(run)
    if model.get("context_bytes") is not None:
        # Host state (earlier pools' measurements, other users' files), not the code under
        # check: reported beside the measurement, never judged.
        ok = model["context_bytes"] >= run.context_bytes
        detail = f"this host's figure for {model['model']}: {model['context_bytes'] / MiB:.0f} MiB"
        checks.append(check("figure.model", ok, f"{detail} ({model['source']})", report=True))
    run.add("context", checks, probe_figure_bytes=figure, model_figure=model, **figures)


def _model_figure(run: Run) -> dict[str, Any]:
    """The context a pool of the check would price a hidden worker of this card at: its
    card model's figure from the contexts files beside the check's own booking table (read,
    never written), or why there is none."""
    try:
        return _read_model_figure(run)
    except Exception as exc:  # a report only: it never costs the step its judged checks
        return {"reason": f"{type(exc).__name__}: {exc!s:.200}"}


def _read_model_figure(run: Run) -> dict[str, Any]:
    from gpupool._sensors.bookings import open_booking_table
    from gpupool._sensors.census import read_census
    from gpupool._sensors.contexts import open_context_file
    from gpupool._sensors.select import default_sensor

    sensor = run.sensor() or default_sensor()
    try:
        census, _ = read_census(sensor, devices=[run.uuid], visible_devices=None)
        table = open_booking_table(share=True, directory=None, sensor=sensor)
    finally:
        sensor.close()
    contexts = open_context_file(table, "gpu-check")
    if contexts is None:
        return {"reason": "no booking table"}
    name = census.cards[0].name
    estimate = contexts.estimate(name)
    return {
        "model": name,
        "context_bytes": estimate.context_bytes,
        "source": estimate.source,
        "directory": str(contexts.directory),
        "refused": dict(contexts.refused),
        "problem": contexts.problem,
    }


def _compute_apps(run: Run, pid: int) -> dict[str, Any]:
    """Whether this machine lists per-process rows at all: ``nvidia-smi
    --query-compute-apps`` while process ``pid`` holds a context (a report)."""
    if run.dry_run:
        return check("compute-apps", True, "simulated: rows listed", report=True)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return check("compute-apps", True, f"nvidia-smi could not run: {exc!s:.200}", report=True)
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    mine = [line for line in lines if line.split(",")[0].strip() == str(pid)]
    said = (
        f"{len(lines)} row(s) listed; this holder's (PID {pid}): {mine[0] if mine else 'none'}"
        f" ({'rows of this namespace listed' if mine else 'rows hidden or of another namespace'})"
    )
    run.result["compute_apps"] = lines[:32]
    return check("compute-apps", True, said, report=True)


# -- step 4: peaks ----------------------------------------------------------------------------


def _have(run: Run, module: str) -> bool:
    return run.dry_run or importlib.util.find_spec(module) is not None


def peak_jobs(run: Run) -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    n, h = run.task_bytes, run.hold_s
    jobs: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
        ("torch-first", torch_task, (n, "hold", h)),
        ("torch-spike", torch_task, (n, "spike", 0.0)),
        ("torch-conv", torch_task, (64 * MiB, "conv", h)),
    ]
    if _have(run, "cupy"):
        # The dry run's loaded CI cores can stall a process longer than a 50 ms spike: it
        # holds as long as the other tasks (it is sampled: CuPy keeps no peak counter).
        spike_s = run.hold_s if run.dry_run else SPIKE_HOLD_S
        jobs.append(("cupy-spike", cupy_spike_task, (n, spike_s)))
    if _have(run, "jax"):
        jobs.append(("jax", jax_task, (n, h)))
    jobs.append(("subprocess", subprocess_task, (n, h, WAIT_S / 2)))
    jobs.append(("double-fork", double_fork_task, (n, h, WAIT_S / 2)))
    jobs.append(("torch-child", torch_child_task, (n, h, WAIT_S / 2)))
    if _have(run, "cupy"):
        jobs.append(("managed", managed_task, (n, h)))
    missing = [m for m in ("cupy", "jax") if not _have(run, m)]
    run.add("peaks", [check(m, True, "not installed: not checked", report=True) for m in missing])
    return jobs


#: Tasks that free what they allocated before returning: the peak must be caught while held.
_RELEASING = ("torch-spike", "cupy-spike", "jax", "subprocess", "double-fork")


def _terms(ex: Any, key: str) -> dict[str, Any]:
    """The terms of the pool's measurement record for ``key`` (``{}``: none)."""
    for decision in ex.decisions:
        if decision.key == key and "peak_bytes" in decision.extra:
            return dict(decision.extra)
    return {}


def _measured(ex: Any, key: str) -> tuple[int | None, str, str | None, dict[str, Any]]:
    """The peak the pool recorded for ``key``, its source, the key's ask basis, and the
    measurement's terms."""
    terms = _terms(ex, key)
    peak = terms.get("peak_bytes")
    source = str(terms.get("peak_source")) if terms else "no measurement record"
    ask = ex.statistics().asks.get(key)
    return peak, source, None if ask is None else ask.basis, terms


def _peak_checks(
    run: Run,
    key: str,
    out: dict[str, Any],
    measured: tuple[int | None, str, str | None, dict[str, Any]],
) -> list[dict[str, Any]]:
    peak, source, basis, terms = measured
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
    if run.context_bytes and terms.get("context_source") not in (None, "none"):
        checks.append(_context_check(run, key, terms))
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


def _context_check(run: Run, key: str, terms: dict[str, Any]) -> dict[str, Any]:
    """The context the probe priced the worker at, against the context step's measurement.

    Where the worker's own row is listed (bare metal) the probe measures its context
    from it (``process-row``), and that must reach the card's. On a card only a report:
    the context step's process loaded more modules (a convolution) than a task may.
    """
    context, source = terms.get("context_bytes"), terms.get("context_source")
    floor = run.context_bytes - run.tolerance_bytes
    ok = source == "process-row" and isinstance(context, int) and context >= floor
    detail = (
        f"probe's context {context} bytes ({source}); the context step measured "
        f"{run.context_bytes} - tolerance {run.tolerance_bytes // MiB} MiB = {floor}"
    )
    return check(f"{key}.context", ok, detail, report=not run.dry_run or run.container)


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


# -- step 4b: the allocator cap and the worker's tree ----------------------------------------


def step_cap(run: Run) -> None:
    """With ``cap_allocator=True``: torch in the worker, then a child that holds the task's
    bytes; torch's cap must leave room for the child (booked ask >= torch's allowance + the
    child's bytes on the card). In a container (rows of this host's processes hidden) the
    cap cannot see the child: there its checks are reported."""
    checks: list[dict[str, Any]] = []
    n = run.task_bytes
    ask = n + 2 * GiB
    with pool(run, checks, max_workers=1, cap_allocator=True, log_path=run.out / "cap.jsonl") as ex:
        future = ex.options(key="cap-child", task_peak=ask).submit(cap_child_task, n, WAIT_S / 2)
        out = dict(future.result(timeout=run.deadline.timeout()))
    state, child = out["state"], int(out["child_used_bytes"])
    fraction, total, booked = state["fraction"], state["total_bytes"], state["ask_bytes"]
    allowed = None if fraction is None or total is None else int(fraction * total)
    said = f"state {state}"
    checks += [
        check("set", allowed is not None and state["error"] is None, said),
        check(
            "descendants",
            state["descendant_bytes"] >= n,
            f"the cap's count of the worker's descendants {state['descendant_bytes']} bytes; "
            f"its child holds {n} bytes (and its context)",
            report=run.container,
        ),
        check(
            "binds",
            allowed is not None and allowed + child <= booked + run.tolerance_bytes,
            f"torch allowed {allowed} bytes + the child's {child} on the card; booked {booked} "
            f"(+ tolerance {run.tolerance_bytes // MiB} MiB)",
            report=run.container,
        ),
    ]
    run.add("cap", checks, cap=out)


def _hidden_rows_case(run: Run, mode: str) -> list[dict[str, Any]]:
    """torch in the worker beside a child that holds as much, on a card that does not give the
    rows (``mode``): the recorded peak reaches the truth, or is flagged incomplete; the key's
    ask is never learned below the truth."""
    checks: list[dict[str, Any]] = []
    n, key = run.task_bytes, f"hidden-{mode}"
    baseline = run.card()["used"]
    log = run.out / f"hidden-rows-{mode}.jsonl"
    log.unlink(missing_ok=True)
    with pool(run, checks, max_workers=1, log_path=log) as ex:
        future = ex.options(key=key, task_peak=2 * n + 2 * GiB).submit(
            torch_child_task, n, run.hold_s, WAIT_S / 2
        )
        out = dict(future.result(timeout=run.deadline.timeout()))
        terms = _terms(ex, key)
        ask = ex.statistics().asks.get(key)
    oracle = int(out["held_used_bytes"]) - baseline
    floor = oracle - run.tolerance_bytes
    peak, flagged = terms.get("peak_bytes"), bool(terms.get("peak_incomplete"))
    asked = None if ask is None else ask.ask_bytes
    checks += [
        check(
            f"{mode}.flagged",
            (peak is not None and peak >= floor) or flagged,
            f"recorded {peak} bytes ({terms.get('peak_source')}), oracle {oracle} - tolerance = "
            f"{floor}; incomplete: {terms.get('incomplete_reason')}",
        ),
        check(
            f"{mode}.ask",
            asked is not None and asked >= floor,
            f"the key's ask {asked} bytes ({None if ask is None else ask.basis}) after it; "
            f"the truth {oracle}",
        ),
    ]
    return checks


def step_hidden_rows(run: Run) -> None:
    """Dry run: each card that hides the rows (a container, rows of 0, rows without a figure, a
    MIG instance), each a simulated host of its own. On a card: the card as it is."""
    if not run.dry_run:
        run.add("hidden-rows", _hidden_rows_case(run, "this-card"))
        return
    from gpupool.testing import SimulatedDevice, SimulatedHost

    for mode in HIDDEN_ROWS_MODES:
        device = SimulatedDevice(run.total_bytes, mig=mode == "mig")
        rows = "listed" if mode == "mig" else mode
        with SimulatedHost(
            [device], context=DRY_RUN_CONTEXT, rows=rows, cpus=16, host_ram="128GiB"
        ):
            run.add("hidden-rows", _hidden_rows_case(run, mode))


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
    from gpupool._child.probe import is_device_oom

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
    proc, _ = start_holder(co_bytes, "plain", run.deadline.timeout(), run.child_env())
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
        stop_holder(proc)
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
