"""Read a decision log back: what the pool did, and which term was wrong when a card ran out.

A reader, not part of the pool: it streams a JSON Lines decision log (written
with ``GpuPoolExecutor(log_path=...)``) one line at a time, keeps only bounded
aggregates, and parses with :mod:`json` alone (nothing in a log is executed or
unpickled). ``gpupool postmortem`` and ``gpupool plot`` print what it returns.

The attribution arithmetic is :mod:`gpupool._core.attribution`'s (pure), and
the schema (event names, versions, terms) is :mod:`gpupool._core.events`'s:
the writer and this reader share one definition.

A file may hold several runs (a ``log_path`` appended to by two pools):
:func:`read_runs` returns one :class:`Postmortem` per ``run_id``.

Bounded memory: a log grows with decisions, but a long run still writes
many; every series kept here is thinned (every other point dropped) when it
reaches :data:`MAX_POINTS`, and at most :data:`MAX_OOM_DETAILS` out-of-memory
analyses are kept in full (all are counted).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupool._core.attribution import (
    OomAnalysis,
    analyse_oom,
    record_float,
    record_int,
    record_str,
)
from gpupool._core.events import (
    SCHEMA_VERSION,
    SETTING_PREFIX,
    describe_task,
    truncate_text,
)
from gpupool._core.units import format_size
from gpupool._errors import GpuPoolError
from gpupool._observe.log_reader import OnCut, iter_records
from gpupool._observe.plot_series import MAX_POINTS, DevicePlot
from gpupool._observe.plot_series import Series as _Series
from gpupool._observe.plot_series import plot_point as _plot_point

__all__ = [
    "MAX_OOM_DETAILS",
    "MAX_TASK_DETAILS",
    "MAX_KEYS",
    "MAX_POINTS",
    "MAX_RUNS",
    "DevicePlot",
    "NoSuchRunError",
    "OomAnalysis",
    "Postmortem",
    "analyse_oom",
    "format_postmortem",
    "format_runs",
    "read_postmortem",
    "read_runs",
]

#: Out-of-memory analyses kept in full; the rest are counted.
MAX_OOM_DETAILS = 256

#: Records about one task in trouble (a lost worker, a deadline) listed by name; the rest are
#: counted.
MAX_TASK_DETAILS = 64


def _names_trouble(event: str) -> bool:
    """Whether a record of ``event`` that names its task is listed among the tasks in trouble
    (out-of-memory records have their own analysis; a measurement is routine)."""
    return event in ("worker_lost", "worker_replaced") or "timeout" in event or "timed_out" in event


#: Runs read from one file; later runs are skipped (a file appended by
#: thousands of runs still reads in bounded memory).
MAX_RUNS = 256

#: Task keys kept per run; later keys are not tabled.
MAX_KEYS = 1024

#: Records of features and outliers kept per run (``Postmortem.learned``).
MAX_LEARNED = 64

#: Events that set a device's width (``width_after``): a lifted out-of-memory cap widens a
#: card as a widened record does.
_WIDTH_EVENTS = frozenset({"constructed", "narrowed", "widened", "cap_lifted"})


# -- the run ---------------------------------------------------------------------------


@dataclass(slots=True)
class Postmortem:
    """What a decision log says about one run of a pool.

    Attributes:
        path: the log.
        run_id: the run's id (``legacy-N`` for a log written before run ids).
        run_index: the run's place in the file, from 1.
        started_at: when the run began (UTC, ISO 8601), if the log says.
        pid: the pool's parent process, if the log says.
        gpupool_version: the gpupool that wrote the run, if the log says.
        settings: the pool's settings from the run's ``run_started`` record.
        records: records read.
        duration_s: the last record's ``time_s``.
        events: records per event.
        widths: ``(time_s, total width)`` at each change of the pool's width
            (the sum of the devices' widths, or the pool's own for host pools).
        device_widths: per device, ``(time_s, width)`` at each change.
        cap_lifts: ``(time_s, device, width_before, width_after)`` of each ``cap_lifted``
            record (an out-of-memory's cap lifted, and the width it let the card reach).
        asks: per task key, its own ask's changes ``(time_s, ask_bytes, basis)``
            (from the records' ``key_ask_*`` terms).
        key_peaks: per task key, the largest device peak measured (a child's
            report, or what an out-of-memory showed it needed at least).
        partial_peaks: per task key, why a peak of it was a partial view (flagged
            incomplete: processes under the worker whose bytes no reading told), the
            first reason said.
        unexplained_rise_bytes: the most a card's used bytes that no process's row
            explains rose while the pool's tasks ran (``unexplained_memory``
            warnings), or ``None`` where no warning was recorded.
        ooms: the analyses kept (at most :data:`MAX_OOM_DETAILS`).
        tasks: the records about one task in trouble (a lost worker, a deadline passed),
            each naming it (its ``map`` entry, its label), at most
            :data:`MAX_TASK_DETAILS`.
        task_records: how many such records there were.
        out_of_memory: out-of-memory records seen.
        verdicts: out-of-memory records per verdict.
        shutdown: the shutdown record's totals, or ``None`` if the log has none.
        devices: per device, the series the plot draws.
        node: the cluster node the run's pool ran on (``gpupool.ray`` names it on
            every record of a run's account), or ``None``.
        learned: what the pool learned beyond each key's distribution, as its records said:
            a feature of the calls that predicts a key's peaks, an outlier kept apart (at
            most :data:`MAX_LEARNED`).
    """

    path: str
    run_id: str = "legacy-1"
    run_index: int = 1
    started_at: str | None = None
    pid: int | None = None
    gpupool_version: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    records: int = 0
    duration_s: float = 0.0
    events: dict[str, int] = field(default_factory=dict)
    widths: _Series = field(default_factory=_Series)
    device_widths: dict[int, _Series] = field(default_factory=dict)
    cap_lifts: _Series = field(default_factory=_Series)
    asks: dict[str, _Series] = field(default_factory=dict)
    key_peaks: dict[str, int] = field(default_factory=dict)
    partial_peaks: dict[str, str] = field(default_factory=dict)
    unexplained_rise_bytes: int | None = None
    ooms: list[OomAnalysis] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    task_records: int = 0
    out_of_memory: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    shutdown: dict[str, Any] | None = None
    devices: dict[int, DevicePlot] = field(default_factory=dict)
    node: str | None = None
    learned: list[str] = field(default_factory=list)

    @property
    def tasks_lost(self) -> int | None:
        """Tasks the shutdown record counts as lost (must be 0), or ``None`` without one."""
        if self.shutdown is None:
            return None
        value = self.shutdown.get("tasks_lost")
        return value if isinstance(value, int) else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary of the run (``gpupool postmortem --json`` prints a list of them)."""
        return {
            "path": self.path,
            "run_id": self.run_id,
            "run_index": self.run_index,
            "started_at": self.started_at,
            "pid": self.pid,
            "gpupool_version": self.gpupool_version,
            "node": self.node,
            "settings": dict(self.settings),
            "schema": SCHEMA_VERSION,
            "records": self.records,
            "duration_s": self.duration_s,
            "events": dict(sorted(self.events.items())),
            "widths": [{"time_s": t, "width": int(w)} for t, w in self.widths.points],
            "cap_lifts": [
                {"time_s": t, "device": int(d), "width_before": int(b), "width_after": int(w)}
                for t, d, b, w in self.cap_lifts.points
            ],
            "device_widths": {
                str(d): [{"time_s": t, "width": int(w)} for t, w in s.points]
                for d, s in sorted(self.device_widths.items())
            },
            "asks": {
                key: {
                    "ask_bytes": int(s.points[-1][1]) if s.points else None,
                    "basis": _BASES[int(s.points[-1][2])] if s.points else None,
                    "peak_bytes": self.key_peaks.get(key),
                    "history": [
                        {"time_s": t, "ask_bytes": int(a), "basis": _BASES[int(b)]}
                        for t, a, b in s.points
                    ],
                }
                for key, s in sorted(self.asks.items())
            },
            "partial_peaks": dict(sorted(self.partial_peaks.items())),
            "unexplained_rise_bytes": self.unexplained_rise_bytes,
            "out_of_memory": self.out_of_memory,
            "verdicts": dict(sorted(self.verdicts.items())),
            "retries": None if self.shutdown is None else self.shutdown.get("retries"),
            "tasks_lost": self.tasks_lost,
            "shutdown": self.shutdown,
            "ooms": [a.to_dict() for a in self.ooms],
            "tasks": list(self.tasks),
            "task_records": self.task_records,
            "learned": list(self.learned),
        }


_BASES = ("estimated", "measured", "unknown")


def _basis_code(value: object) -> int:
    return _BASES.index(value) if value in _BASES[:2] else 2


_SHUTDOWN_TERMS = (
    "time_s",
    "tasks_completed",
    "tasks_failed",
    "tasks_cancelled",
    "out_of_memory",
    "retries",
    "workers_lost",
    "tasks_lost",
    "reason",
    "refused",
)


class _RunReader:
    """Folds one run's records into its :class:`Postmortem`, in bounded memory.

    Out-of-memory records are analysed when the next record of their card
    that carries an own high-water is read (or at the end), so that a later
    high-water can count as evidence of the parent's growth.
    """

    def __init__(self, pm: Postmortem) -> None:
        self.pm = pm
        self.current: dict[int | None, int] = {}
        self.last_total: int | None = None
        self.waiting: list[tuple[int, dict[str, Any], int]] = []
        self.own_after: dict[int, int] = {}
        self.most: dict[int, int] = {}

    def feed(self, number: int, record: dict[str, Any]) -> None:
        """Fold one record of the run (``number``: its line in the log) into the postmortem."""
        pm = self.pm
        pm.records += 1
        event = str(record["event"])
        pm.events[event] = pm.events.get(event, 0) + 1
        time_s = record_float(record.get("time_s"))
        pm.duration_s = max(pm.duration_s, time_s)
        if event == "run_started":
            self._header(record)
            return
        device = record_int(record, "device")
        self._own_high_water(record, event, device)
        plot = pm.devices.setdefault(device, DevicePlot(device)) if device is not None else None
        width_after = record_int(record, "width_after")
        self._most_running(record, event, device, width_after)
        if event in _WIDTH_EVENTS and width_after is not None:
            self._width(device, width_after, time_s)
        if event == "cap_lifted" and device is not None and width_after is not None:
            before = record_int(record, "width_before")
            pm.cap_lifts.add(time_s, device, before if before is not None else -1, width_after)
        self._key_terms(record, event, time_s)
        if plot is not None:
            _plot_point(plot, record, event, time_s)
        self._outcome(number, record, event, device, time_s)
        if event in ("predicted", "outlier") and len(pm.learned) < MAX_LEARNED:
            pm.learned.append(f"{event} at {time_s:.2f} s: {record.get('reason')}")

    def _own_high_water(self, record: Mapping[str, Any], event: str, device: int | None) -> None:
        """Note the card's own high-water after its out-of-memory records, and analyse those
        that waited for it."""
        own_hw = record_int(record, "own_high_water_bytes")
        if device is not None and own_hw is not None and event != "out_of_memory":
            self.own_after[device] = max(self.own_after.get(device, 0), own_hw)
        if self.waiting and device is not None and own_hw is not None:
            self.flush(device)

    def _most_running(
        self, record: Mapping[str, Any], event: str, device: int | None, width_after: int | None
    ) -> None:
        """Note the most tasks the card ran, or was widened to, so far."""
        if device is None:
            return
        for value in (
            record_int(record, "running"),
            width_after if event in _WIDTH_EVENTS else None,
        ):
            if value is not None:
                self.most[device] = max(self.most.get(device, 0), value)

    def _width(self, device: int | None, width_after: int, time_s: float) -> None:
        """A width record: the card's width over time, and the pool's (the cards' sum)."""
        pm = self.pm
        if device is not None:
            pm.device_widths.setdefault(device, _Series()).add(time_s, width_after)
        self.current[device] = width_after
        per_device = {d: w for d, w in self.current.items() if d is not None}
        total_width = max(1, sum(per_device.values())) if per_device else width_after
        if total_width != self.last_total:
            # One turn's records share a time: the pool's width then is the sum after
            # them all, never one taken half-way through the turn.
            points = pm.widths.points
            if points and points[-1][0] == time_s:
                points.pop()
            if not points or points[-1][1] != total_width:
                pm.widths.add(time_s, total_width)
            self.last_total = total_width

    def _outcome(
        self, number: int, record: dict[str, Any], event: str, device: int | None, time_s: float
    ) -> None:
        """What the record says went wrong or ended: an out-of-memory (analysed later), memory
        no row explains, the shutdown, or a task in trouble."""
        pm = self.pm
        if event == "out_of_memory":
            pm.out_of_memory += 1
            self.waiting.append(
                (number, record, self.most.get(device, 0) if device is not None else 0)
            )
        elif event == "unexplained_memory":
            rise = record_int(record, "unexplained_rise_bytes")
            if rise is not None:
                pm.unexplained_rise_bytes = max(pm.unexplained_rise_bytes or 0, rise)
        elif event == "shutdown":
            pm.shutdown = {name: record.get(name) for name in _SHUTDOWN_TERMS}
        elif _names_trouble(event) and describe_task(record):
            pm.task_records += 1
            if len(pm.tasks) < MAX_TASK_DETAILS:
                reason = record.get("reason")
                pm.tasks.append(
                    {
                        "line": number,
                        "time_s": time_s,
                        "event": event,
                        "device": device,
                        "key": record_str(record, "key"),
                        "task": describe_task(record),
                        "reason": truncate_text(reason) if isinstance(reason, str) else None,
                    }
                )

    def _header(self, record: Mapping[str, Any]) -> None:
        pm = self.pm
        started = record.get("started_at")
        pm.started_at = started if isinstance(started, str) else None
        pm.pid = record_int(record, "pid")
        version = record.get("gpupool_version")
        pm.gpupool_version = version if isinstance(version, str) else None
        node = record.get("node")
        pm.node = node[:200] if isinstance(node, str) and node else None
        pm.settings = {
            name[len(SETTING_PREFIX) :]: value
            for name, value in record.items()
            if name.startswith(SETTING_PREFIX)
        }

    def _key_terms(self, record: Mapping[str, Any], event: str, time_s: float) -> None:
        """The record's key's own ask (``key_ask_*``) and the peak its child reported."""
        key = record.get("key")
        if not isinstance(key, str):
            return
        pm = self.pm
        for name in ("peak_bytes", "key_measured_peak_bytes"):
            peak = record_int(record, name)
            if peak is not None:
                pm.key_peaks[key] = max(pm.key_peaks.get(key, 0), peak)
        if record.get("peak_incomplete") is True and len(pm.partial_peaks) < MAX_KEYS:
            reason = record.get("incomplete_reason")
            pm.partial_peaks.setdefault(key, str(reason)[:400] if reason else "no reason given")
        ask = record_int(record, "key_ask_bytes")
        if ask is None:
            if key not in pm.asks and len(pm.asks) < MAX_KEYS:
                pm.asks[key] = _Series()
            return
        if key not in pm.asks:
            if len(pm.asks) >= MAX_KEYS:
                return
            pm.asks[key] = _Series()
        series = pm.asks[key]
        basis = _basis_code(record.get("key_ask_basis"))
        estimate = record_int(record, "key_estimate_bytes")
        if not series.points and estimate is not None and (estimate, 0) != (ask, basis):
            series.add(time_s, estimate, 0)
        if not series.points or series.points[-1][1:] != (ask, basis):
            series.add(time_s, ask, basis)

    def flush(self, device: int | None) -> None:
        """Analyse the waiting out-of-memory records of ``device`` (``None``: all)."""
        pm = self.pm
        kept: list[tuple[int, dict[str, Any], int]] = []
        for number, record, most_running in self.waiting:
            card = record_int(record, "device")
            if device is not None and card != device:
                kept.append((number, record, most_running))
                continue
            analysis = analyse_oom(
                record,
                line=number,
                later_own_high_water_bytes=self.own_after.get(card) if card is not None else None,
                most_running=most_running,
            )
            pm.verdicts[analysis.verdict] = pm.verdicts.get(analysis.verdict, 0) + 1
            if len(pm.ooms) < MAX_OOM_DETAILS:
                pm.ooms.append(analysis)
        self.waiting = kept


class NoSuchRunError(GpuPoolError, LookupError):
    """The run asked for (``--run``) is not in the log.

    Attributes:
        run: what was asked for.
        runs: the run ids the log holds.
    """

    def __init__(self, message: str, *, run: str, runs: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.run = run
        self.runs = runs

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_no_such_run, (str(self), self.run, self.runs))


def _rebuild_no_such_run(message: str, run: str, runs: tuple[str, ...]) -> NoSuchRunError:
    return NoSuchRunError(message, run=run, runs=runs)


def _selects(pm: Postmortem, run: str) -> bool:
    return run == str(pm.run_index) or (len(run) >= 4 and pm.run_id.startswith(run))


def read_runs(
    path: str | Path, *, run: str | int | None = None, on_cut: OnCut | None = None
) -> list[Postmortem]:
    """Stream a decision log into one :class:`Postmortem` per run, in bounded memory.

    A run is the records that carry one ``run_id``, in the order the file
    first shows them (two pools appending at once interleave, and are told
    apart). A log written before run ids (schema 1) is split at each
    ``constructed`` record that follows any other event.

    Args:
        path: the log, or ``"-"`` for standard input.
        run: keep only this run: its place in the file (``1``, ``"2"``) or
            the start of its run id (4 characters at least).
        on_cut: told of a last line cut short, which is dropped (see
            :func:`iter_records`; default: a :class:`CutLogWarning`).

    Raises:
        DecisionLogError: the file is not a readable decision log (see
            :func:`iter_records`).
        NoSuchRunError: ``run`` names no run in the log.
    """
    name = "<stdin>" if str(path) == "-" else str(path)
    readers: dict[str, _RunReader] = {}
    ids: list[str] = []
    legacy = 0
    legacy_id: str | None = None
    legacy_seen_other = False
    for number, record in iter_records(path, on_cut=on_cut):
        run_id = record.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            # Schema 1: a run starts at a "constructed" record after any other event.
            event = record["event"]
            if legacy_id is None or (event == "constructed" and legacy_seen_other):
                legacy += 1
                legacy_id = f"legacy-{legacy}"
                legacy_seen_other = False
            run_id = legacy_id
            if event != "constructed":
                legacy_seen_other = True
        reader = readers.get(run_id)
        if reader is None:
            if len(ids) >= MAX_RUNS:
                ids.append(run_id)  # counted, not read
                continue
            ids.append(run_id)
            reader = _RunReader(Postmortem(path=name, run_id=run_id, run_index=len(ids)))
            readers[run_id] = reader
        reader.feed(number, record)
    runs = [reader.pm for reader in readers.values()]
    for reader in readers.values():
        reader.flush(None)
    return runs if run is None else _choose_run(name, runs, str(run))


def _choose_run(name: str, runs: list[Postmortem], wanted: str) -> list[Postmortem]:
    """The one run ``wanted`` names; else the error lists the runs there are, to choose from."""
    chosen = [pm for pm in runs if _selects(pm, wanted)]
    if len(chosen) != 1:
        listing = ", ".join(f"{pm.run_index}: {pm.run_id}" for pm in runs)
        why = "matches several runs" if chosen else "is not a run in the log"
        raise NoSuchRunError(
            f"{name}: run {wanted!r} {why}; the log holds {len(runs)} run"
            f"{'s' if len(runs) != 1 else ''} ({listing}). Pass a run's number or the "
            "start of its id.",
            run=wanted,
            runs=tuple(pm.run_id for pm in runs),
        )
    return chosen


def read_postmortem(
    path: str | Path, *, run: str | int | None = None, on_cut: OnCut | None = None
) -> Postmortem:
    """One run of a decision log: the one chosen by ``run``, by default the last.

    A last line cut short is dropped and reported to ``on_cut`` (see :func:`read_runs`).

    Raises:
        DecisionLogError: the file is not a readable decision log.
        NoSuchRunError: ``run`` names no run in the log.
    """
    return read_runs(path, run=run, on_cut=on_cut)[-1]


# -- words -----------------------------------------------------------------------------


def _settings_line(settings: Mapping[str, Any]) -> str:
    parts = []
    for name, value in settings.items():
        if value is None or name == "python":
            continue
        if name.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
            parts.append(f"{name[: -len('_bytes')]}={format_size(value)}")
        else:
            parts.append(f"{name}={value}")
    return "settings: " + (", ".join(parts) or "none recorded")


def format_runs(runs: list[Postmortem]) -> list[str]:
    """Every run in words (``gpupool postmortem`` prints them), one section per run."""
    if len(runs) == 1:
        return format_postmortem(runs[0])
    lines = [
        f"gpupool postmortem: {runs[0].path} holds {len(runs)} runs "
        "(--run N or --run RUN_ID for one)"
    ]
    for pm in runs:
        lines.append("")
        lines.extend(format_postmortem(pm))
    return lines


def format_postmortem(pm: Postmortem) -> list[str]:
    """One run in words, one string per line."""
    lines = _format_run(pm)
    lines += _format_widths(pm)
    lines += _format_asks(pm)
    lines += _format_unmeasured(pm)
    refused = pm.events.get("widen_refused", 0)
    waits = pm.events.get("live_gate_wait", 0)
    serial = pm.events.get("serial_start", 0)
    over = pm.events.get("fixed_width_over_bound", 0)
    lines.append(
        f"refused widens: {refused}; live-gate waits: {waits}; serial starts: {serial}"
        + (f"; fixed width over the bound: {over}" if over else "")
    )
    lines += _format_shutdown(pm)
    lines += _format_ooms(pm)
    lines += _format_tasks(pm)
    return lines


def _format_widths(pm: Postmortem) -> list[str]:
    """The pool's width over time, each card's where there are several, and the caps lifted."""
    lines = [
        "widths over time: "
        + (", ".join(f"{int(w)} at {t:.2f} s" for t, w in pm.widths.points) or "none recorded")
    ]
    for device, series in sorted(pm.device_widths.items()):
        if len(pm.device_widths) > 1:
            lines.append(
                f"  card {device}: " + ", ".join(f"{int(w)} at {t:.2f} s" for t, w in series.points)
            )
    if pm.cap_lifts.points:
        lines.append(
            "caps lifted (an out-of-memory's cap, once the room it was set for was back): "
            + ", ".join(
                f"card {int(d)} at {t:.2f} s (width {int(b) if b >= 0 else '?'} -> {int(w)})"
                for t, d, b, w in pm.cap_lifts.points
            )
        )
    return lines


def _format_unmeasured(pm: Postmortem) -> list[str]:
    """What the measurements could not see or explain, and what was learned beyond the keys'
    distributions (none: no lines)."""
    lines = []
    if pm.partial_peaks:
        lines.append(
            "partial views (a peak that could not read the processes under its worker; "
            "it never lowered an ask):"
        )
        lines += [f"  {key}: {reason}" for key, reason in sorted(pm.partial_peaks.items())]
    if pm.unexplained_rise_bytes is not None:
        count = pm.events.get("unexplained_memory", 0)
        lines.append(
            f"memory no row explains: rose by up to {format_size(pm.unexplained_rise_bytes)} "
            f"while tasks ran ({count} warning{'s' if count != 1 else ''}: managed memory, a "
            "process the driver does not list, or a spike; no task's peak counts it)"
        )
    if pm.learned:
        lines.append("learned beyond the keys' distributions (features, outliers):")
        lines += [f"  {line}" for line in pm.learned]
    return lines


def _format_ooms(pm: Postmortem) -> list[str]:
    """The run's out-of-memory errors, each analysed (up to those kept), and their verdicts."""
    lines = [f"out of memory: {pm.out_of_memory}"]
    for number, analysis in enumerate(pm.ooms, 1):
        lines.extend(_format_oom(number, analysis))
    if pm.out_of_memory > len(pm.ooms):
        lines.append(f"  ({pm.out_of_memory - len(pm.ooms)} more not shown)")
    if pm.verdicts:
        lines.append("verdicts: " + ", ".join(f"{v} {n}" for v, n in sorted(pm.verdicts.items())))
    return lines


def _format_tasks(pm: Postmortem) -> list[str]:
    """The tasks in trouble (a lost worker, a deadline), up to those kept (none: no lines)."""
    lines = []
    if pm.task_records:
        lines.append(f"tasks in trouble: {pm.task_records}")
        for t in pm.tasks:
            card = "-" if t["device"] is None else t["device"]
            lines.append(
                f"  {t['event']} at {t['time_s']:.2f} s (line {t['line']}), card {card}, "
                f"task {t['key']} ({t['task']}): {t['reason']}"
            )
        if pm.task_records > len(pm.tasks):
            lines.append(f"  ({pm.task_records - len(pm.tasks)} more not shown)")
    return lines


def _format_run(pm: Postmortem) -> list[str]:
    """The report's head: which run of which log, its settings, and how much it recorded."""
    started = f", started {pm.started_at}" if pm.started_at else ""
    by = f" by process {pm.pid}" if pm.pid is not None else ""
    version = f" (gpupool {pm.gpupool_version})" if pm.gpupool_version else ""
    node = f" on node {pm.node}" if pm.node else ""
    lines = [
        f"gpupool postmortem: {pm.path}",
        f"run {pm.run_index}: {pm.run_id}{node}{started}{by}{version}",
    ]
    if pm.settings:
        lines.append(_settings_line(pm.settings))
    samples = pm.events.get("card_read", 0)
    lines.append(
        f"{pm.records} record{'s' if pm.records != 1 else ''} over {pm.duration_s:.2f} s"
        + (f" ({samples} of them samples of a card)" if samples else "")
    )
    return lines


def _format_asks(pm: Postmortem) -> list[str]:
    """Each key's asks over the run, and its largest measured peak (none: no lines)."""
    if not pm.asks:
        return []
    lines = ["asks per task key (each key's own ask, and its largest measured peak):"]
    for key, series in sorted(pm.asks.items()):
        history = (
            " -> ".join(f"{format_size(int(a))} ({_BASES[int(b)]})" for _t, a, b in series.points)
            or "not in the log (written before gpupool recorded each key's ask)"
        )
        peak = pm.key_peaks.get(key)
        lines.append(
            f"  {key}: {history}" + (f"; peak {format_size(peak)}" if peak is not None else "")
        )
    return lines


def _format_shutdown(pm: Postmortem) -> list[str]:
    """How the run ended: its shutdown record's counts, and whether a task was lost."""
    shutdown = pm.shutdown
    if shutdown is None:
        return ["no shutdown record: the pool did not shut down cleanly, or is still running"]
    if shutdown.get("refused"):
        return [f"refused as it was built, before any task ran: {shutdown['refused']}"]
    lost = pm.tasks_lost
    return [
        f"shutdown: {shutdown.get('tasks_completed')} completed, "
        f"{shutdown.get('tasks_failed')} failed, {shutdown.get('tasks_cancelled')} "
        f"cancelled; {shutdown.get('out_of_memory')} out-of-memory, "
        f"{shutdown.get('retries')} retries, {shutdown.get('workers_lost')} workers lost",
        "tasks lost: none"
        if lost == 0
        else f"TASKS LOST: {lost} (the pool must never lose a task: report this)",
    ]


def _format_oom(number: int, a: OomAnalysis) -> list[str]:
    card = "-" if a.device is None else str(a.device)
    fate = "retried at a narrower width" if a.retry else "its error went to its future"
    co_live = (
        f"live {format_size(a.co_tenant_live_bytes)} (read: the card's rows)"
        if a.co_tenant_live_bytes is not None and a.pool_read and a.own_separable
        else f"live >= {format_size(a.co_tenant_live_bytes)} (derived from the bookings)"
        if a.co_tenant_live_bytes is not None
        else "live: not derivable"
    )
    own_live = (
        f"live {format_size(a.own_live_bytes)}"
        + ("" if a.own_separable and "live_own_bytes" not in a.missing else " (a later record)")
        if a.own_live_bytes is not None
        else "live: not in the record"
    )
    rows = [
        f"out of memory #{number} at {a.time_s:.2f} s (line {a.line}), card {card}, "
        f"task {a.key}" + (f" ({a.task})" if a.task else "") + f"; {fate}",
        f"  card total             {format_size(a.total_bytes):>12}",
        f"  co-tenant (census)     {format_size(a.census_co_tenant_bytes):>12}   {co_live}",
        f"  own high-water         {format_size(a.own_high_water_bytes):>12}   {own_live}",
        f"  reserve                {format_size(a.reserve_bytes):>12}",
        f"  booked                 {format_size(a.booked_bytes):>12}   "
        f"{a.running} running, the failing task's included, each at its price when it started",
        *(f"    {n} x {key}: {format_size(b)}{_each(a, key, n)}" for key, n, b in a.runs_by_key),
        *(
            [
                f"  the pool's workers     {format_size(a.children_bytes):>12}   "
                "read from the card's rows (running tasks and idle workers' contexts)"
            ]
            if a.pool_read
            else []
        ),
        f"  failing task's ask     {format_size(a.task_ask_bytes):>12}   {_booked_at_start(a)}; "
        f"the key was priced {format_size(a.key_ask_bytes)} ({a.ask_basis}) when it failed",
        f"  it had reached         {format_size(a.reached_bytes):>12}   "
        f"and {format_size(a.requested_bytes)} more was refused",
        f"  live used / free       {format_size(a.live_used_bytes):>12}   "
        f"/ {format_size(a.live_free_bytes)} (read after the child reported)",
        f"  wrong term: {a.verdict} - {a.explanation}",
    ]
    return rows


#: Bookings of one key listed one by one in an out-of-memory's table; more are counted.
_BOOKINGS_LISTED = 8


def _each(a: OomAnalysis, key: str, running: int) -> str:
    """What each of ``key``'s running tasks was booked at, as the record's ``runs`` states it:
    one figure where they were all booked alike, else each (never an average no record
    states)."""
    if running < 2:
        return ""
    booked = dict(a.run_bookings).get(key, ())
    if not booked:
        return ""
    if len(set(booked)) == 1:
        return f" ({format_size(booked[0])} each)"
    listed = " + ".join(format_size(b) for b in booked[:_BOOKINGS_LISTED])
    more = len(booked) - _BOOKINGS_LISTED
    return f" ({listed}{f' + {more} more' if more > 0 else ''}, each as booked when it started)"


def _booked_at_start(a: OomAnalysis) -> str:
    """How the failing task was booked when it started, as the record states it."""
    booked = a.task_booked_bytes
    if booked is None or booked == a.task_ask_bytes:
        return "booked at its start"
    return (
        f"booked {format_size(booked)} at its start (its share of its key's price for the "
        "tasks together)"
    )
