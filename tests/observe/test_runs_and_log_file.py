"""The decision log file: one run id per pool run, read back run by run; written safely."""

from __future__ import annotations

import json
import logging
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import observe_tasks
import pytest

from gpupool import ConfigurationError, GpuPoolExecutor, WidthError
from gpupool._commands.cli import EXIT_USAGE, main
from gpupool._core.events import ERROR_TEXT_CHARS, OOM_TERMS, Decision, truncate_text
from gpupool._core.units import GiB
from gpupool._observe.log import DecisionLog, check_log_path, level_for
from gpupool._observe.postmortem import NoSuchRunError, read_runs
from gpupool.testing import SimulatedDevice, SimulatedHost, hold


def _two_runs(log: Path) -> None:
    """Two pools append to one file: 6 then 3 at once (the second on a fuller card)."""
    for parent in ("1GiB", "26GiB"):
        with SimulatedHost([SimulatedDevice("44GiB")], cpus=8, host_ram="64GiB"):
            with hold(parent):
                with GpuPoolExecutor(max_workers=6, task_peak="5GiB", log_path=log) as pool:
                    list(pool.map(observe_tasks.entry, range(6), ["1GiB"] * 6, [0.01] * 6))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log file appended by two pool runs."""
    log = tmp_path_factory.mktemp("runs") / "two.jsonl"
    _two_runs(log)
    return log


def test_every_record_carries_its_runs_id(two_runs: Path) -> None:
    """Each run opens with run_started (its settings) and every record carries its run_id."""
    records = [json.loads(line) for line in two_runs.read_text().splitlines()]
    ids = list(dict.fromkeys(r["run_id"] for r in records))
    assert len(ids) == 2
    starts = [r for r in records if r["event"] == "run_started"]
    assert [r["run_id"] for r in starts] == ids
    assert starts[0]["setting_max_workers"] == 6
    assert starts[0]["setting_task_peak_bytes"] == 5 * GiB
    assert all(isinstance(r["run_id"], str) for r in records)


def test_a_file_of_two_runs_reads_as_two_runs(two_runs: Path) -> None:
    """Two runs in one file are two postmortems, each with its own widths (not one mixed run)."""
    first, second = read_runs(two_runs)
    assert (first.run_index, second.run_index) == (1, 2)
    assert first.run_id != second.run_id
    assert [int(w) for _, w in first.widths.points] == [6]
    assert int(second.widths.points[0][1]) < 6
    assert first.shutdown is not None and second.shutdown is not None
    assert first.settings["max_workers"] == 6


def test_postmortem_reports_each_run_and_one_on_request(
    two_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text output has one section per run; --run N and --run ID-prefix pick one; --json lists."""
    assert main(["postmortem", str(two_runs)]) == 0
    out = capsys.readouterr().out
    assert "holds 2 runs" in out
    assert out.count("widths over time:") == 2
    assert main(["postmortem", "--json", str(two_runs)]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = [run["run_id"] for run in report["runs"]]
    assert len(ids) == 2
    assert main(["postmortem", "--run", "2", "--json", str(two_runs)]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == [ids[1]]
    assert main(["postmortem", "--run", ids[0][:20], "--json", str(two_runs)]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == [ids[0]]


def test_an_unknown_run_is_a_usage_error(
    two_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--run that names no run: exit 2 and the runs the log holds."""
    assert main(["postmortem", "--run", "7", str(two_runs)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "run '7' is not a run in the log; the log holds 2 runs (1: " in err
    with pytest.raises(NoSuchRunError):
        read_runs(two_runs, run="7")


def test_a_run_refused_by_strict_mode_ends_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """strict=True refusing the first width: the run its log opened ends with a shutdown
    record naming the refusal, and a pool that appends to the file next is a whole run too."""
    log = tmp_path / "strict.jsonl"
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context="0MiB"):
        with pytest.raises(WidthError, match=r"^strict mode: the bound gives width 2"):
            GpuPoolExecutor(max_workers=4, strict=True, task_peak="4GiB", reserve=0, log_path=log)
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB", reserve=0, log_path=log) as pool:
            assert pool.submit(abs, -3).result(timeout=60) == 3
    records = [json.loads(line) for line in log.read_text().splitlines()]
    runs = list(dict.fromkeys(r["run_id"] for r in records))
    assert len(runs) == 2
    for run in runs:
        events = [r["event"] for r in records if r["run_id"] == run]
        assert (events[0], events[-1], events.count("shutdown")) == ("run_started", "shutdown", 1)
    ended = [r for r in records if r["event"] == "shutdown"]
    assert ended[0]["refused"].startswith("WidthError: strict mode: the bound gives width 2")
    assert ended[0]["tasks_lost"] == ended[0]["tasks_completed"] == 0
    assert "refused" not in ended[1] and ended[1]["tasks_completed"] == 1
    assert main(["postmortem", "--run", "1", str(log)]) == 0
    out = capsys.readouterr().out
    assert "refused as it was built, before any task ran: WidthError: strict mode:" in out
    assert "no shutdown record" not in out


def test_a_legacy_log_splits_at_each_construction(tmp_path: Path, two_runs: Path) -> None:
    """A schema-1 log (no run ids) appended twice still reads as two runs."""
    legacy = tmp_path / "legacy.jsonl"
    lines = []
    for line in two_runs.read_text().splitlines():
        record = json.loads(line)
        if record["event"] in ("run_started", "card_read"):
            continue  # schema 1 had neither
        record.pop("run_id")
        record["schema"] = 1
        lines.append(json.dumps(record))
    legacy.write_text("\n".join(lines) + "\n")
    runs = read_runs(legacy)
    assert [pm.run_id for pm in runs] == ["legacy-1", "legacy-2"]
    assert [int(w) for _, w in runs[0].widths.points] == [6]


def test_plot_draws_each_run(two_runs: Path, tmp_path: Path) -> None:
    """The plot of a two-run log is two columns (twice as wide as one run's)."""
    pytest.importorskip("matplotlib")
    both = tmp_path / "both.png"
    one = tmp_path / "one.png"
    assert main(["plot", str(two_runs), "-o", str(both)]) == 0
    assert main(["plot", str(two_runs), "--run", "1", "-o", str(one)]) == 0

    def width(path: Path) -> int:
        return int.from_bytes(path.read_bytes()[16:20], "big")

    assert width(both) == 2 * width(one)


def test_the_ask_table_is_each_keys_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key hinted at 20 GiB that measures ~19.7 GiB is tabled at its own ask, not the default."""
    log = tmp_path / "keys.jsonl"
    with SimulatedHost([SimulatedDevice("80GiB")], cpus=4, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="2GiB", log_path=log) as pool:
            big = pool.options(key="large-model", task_peak="20GiB")
            futures = [big.submit(observe_tasks.entry, i, "19.37GiB", 0.02) for i in range(3)]
            futures += [pool.submit(observe_tasks.entry, i, "1GiB", 0.02) for i in range(6)]
            for future in futures:
                future.result()
            asks = pool.statistics().asks
    (pm,) = read_runs(log)
    large = pm.asks["large-model"].points
    assert large[0][1:] == (20 * GiB, 0)  # its own estimate, not the pool's 2 GiB default
    assert large[-1][1] == asks["large-model"].ask_bytes
    small = pm.asks["observe_tasks.entry"].points
    assert small[-1][1] == asks["observe_tasks.entry"].ask_bytes
    assert small[-1][1] < 2 * GiB
    assert pm.key_peaks["large-model"] > 19 * GiB
    assert main(["postmortem", str(log)]) == 0
    out = capsys.readouterr().out
    assert "  large-model: 20.00 GiB (estimated) -> " in out


# -- the file itself ---------------------------------------------------------------------


def test_the_log_is_created_0600(tmp_path: Path) -> None:
    """A new log file is readable by its owner alone."""
    path = tmp_path / "new.jsonl"
    log = DecisionLog(check_log_path(path))
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_symlink_at_log_path_is_refused(tmp_path: Path) -> None:
    """A link planted at log_path is never followed: the target is untouched."""
    target = tmp_path / "secret"
    target.write_text("root only\n")
    link = tmp_path / "run.jsonl"
    link.symlink_to(target)
    with pytest.raises(ConfigurationError, match=r"is a symbolic link; gpupool does not follow"):
        check_log_path(link)
    assert target.read_text() == "root only\n"


@pytest.mark.parametrize("path", ["/dev/full", "/dev/null"])
def test_a_device_log_path_is_a_clear_error(path: str) -> None:
    """log_path='/dev/full' is refused at construction with a message, not a raw OSError."""
    if not Path(path).exists():
        pytest.skip(f"{path} is not on this system")
    with pytest.raises(ConfigurationError, match=r"is a character device, not a regular file"):
        check_log_path(path)


def test_error_text_is_cut_in_the_file() -> None:
    """Free text (an exception message) is cut to ERROR_TEXT_CHARS in the written record."""
    secret = "x" * 5000
    record = Decision(
        event="sensor_error",
        time_s=0.0,
        device=0,
        width_before=1,
        width_after=1,
        reason="r",
        extra={"error": secret},
    ).to_dict()
    assert str(record["error"]).startswith("x" * ERROR_TEXT_CHARS + "... [cut: 4800 more")
    assert truncate_text("short") == "short"


def _fill(log_path: str, records: int) -> dict[str, Any]:
    """Child: write records to a log that cannot take them; report what the log saw."""
    log = DecisionLog(Path(log_path))
    for i in range(records):
        log.append(
            Decision(
                event="measured",
                time_s=float(i),
                device=None,
                width_before=1,
                width_after=1,
                reason="x" * 200,
            )
        )
    fds = len(os.listdir("/proc/self/fd"))
    out = {"write_errors": log.write_errors, "kept": len(log.records()), "fds": fds}
    log.close()
    out["fds_after_close"] = len(os.listdir("/proc/self/fd"))
    return out


_CHILD = """
import json, resource, sys
sys.path.insert(0, {here!r})
from test_runs_and_log_file import _fill
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
print(json.dumps(_fill({path!r}, 50)))
"""


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_log_past_its_file_size_limit_is_counted_not_fatal(tmp_path: Path) -> None:
    """EFBIG (RLIMIT_FSIZE): the first failure is reported once, later records are counted."""
    path = tmp_path / "capped.jsonl"
    code = _CHILD.format(here=str(Path(__file__).parent), path=str(path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kept"] == 50
    assert 0 < report["write_errors"] <= 50
    assert report["fds"] == report["fds_after_close"]  # the file was closed at the failure
    assert path.stat().st_size <= 2048


def test_a_failed_write_warns_once_and_the_pool_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A log that fails mid-run (its descriptor gone bad): one warning, a count, every result."""
    path = tmp_path / "run.jsonl"
    caplog.set_level(logging.WARNING, logger="gpupool")
    card = SimulatedDevice("44.39GiB", co_tenants={"serve": "9.54GiB"})
    with SimulatedHost([card], cpus=16, host_ram="128GiB"), hold("16.20GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="9.9GiB", log_path=path) as pool:
            log = pool._dispatcher.log
            # Not checked against its path (which it no longer matches): this test is of a
            # write that fails, not of a file replaced (tests/observe/test_log_is_ours.py).
            log._check_every_s = float("inf")
            # The file's descriptor now points at /dev/full: every write fails with ENOSPC.
            full = os.open("/dev/full", os.O_WRONLY)
            assert log._fd is not None
            os.dup2(full, log._fd)
            os.close(full)
            results = list(pool.map(observe_tasks.entry, range(8)))
    assert results == list(range(8))
    assert log.write_errors >= 1
    warnings = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warnings) == 1
    assert "No space left on device" in warnings[0].getMessage()
    assert log._fd is None


def test_unconfigured_logging_is_silent() -> None:
    """With logging unconfigured, a pool run prints nothing to stderr (a NullHandler)."""
    code = (
        "from gpupool import GpuPoolExecutor\n"
        "from gpupool.testing import SimulatedHost, SimulatedDevice, hold\n"
        "with SimulatedHost([SimulatedDevice('8GiB')], cpus=2, host_ram='8GiB'):\n"
        "    with GpuPoolExecutor(max_workers=2, task_peak='6GiB') as ex:\n"
        "        print(list(ex.map(abs, [-1, -2])))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1, 2]"
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("event", "level"),
    [
        ("out_of_memory", logging.WARNING),
        ("serial_start", logging.WARNING),
        ("fixed_width_over_bound", logging.WARNING),
        ("narrowed", logging.INFO),
        ("worker_lost", logging.INFO),
        ("constructed", logging.INFO),
    ],
)
def test_levels(event: str, level: int) -> None:
    """WARNING only for what a user must act on; INFO for every other decision."""
    assert level_for(event) == level


def test_messages_are_short_with_the_terms_as_fields(caplog: pytest.LogCaptureFixture) -> None:
    """The message is one short line; the record's terms ride on the LogRecord."""
    caplog.set_level(logging.INFO, logger="gpupool")
    log = DecisionLog()
    log.append(
        Decision(
            event="narrowed",
            time_s=1.0,
            device=0,
            width_before=4,
            width_after=2,
            reason="a very long sentence " * 40,
            key="k",
        )
    )
    (record,) = caplog.records
    assert record.getMessage() == "gpupool narrowed: device 0 width 4 -> 2 key k"
    assert record.gpupool_record["width_after"] == 2  # type: ignore[attr-defined]
    assert record.gpupool.run_id == log.run_id  # type: ignore[attr-defined]


def test_the_oom_terms_are_what_the_pool_writes(logs: dict[str, Path]) -> None:
    """Every out-of-memory term the attribution reads (OOM_TERMS) is in a real OOM record."""
    # The staged runs run the card out by construction (a gate holds two tasks
    # between their allocations while the card changes), not by timing.
    ooms = [
        json.loads(line)
        for name in ("co_tenant", "own")
        for line in logs[name].read_text().splitlines()
        if json.loads(line)["event"] == "out_of_memory"
    ]
    assert len(ooms) >= 2
    for record in ooms:
        assert set(OOM_TERMS) <= set(record), set(OOM_TERMS) - set(record)


def test_the_attribution_reads_only_terms_the_schema_defines() -> None:
    """Every record term the OOM attribution reads is named in the schema (OOM_TERMS)."""
    import ast

    import gpupool._core.attribution as attribution

    tree = ast.parse(Path(attribution.__file__).read_text())
    read = {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("record_int", "record_str")
        and isinstance(node.args[1], ast.Constant)
    }
    assert "reached_bytes" in read  # the scan sees the calls
    # The bound's own terms (every card record) and the record's identity.
    common = {"device", "key", "co_tenant_bytes", "ask_basis"}
    assert read - common <= set(OOM_TERMS), read - common - set(OOM_TERMS)


def test_a_failed_write_also_warns_where_logging_is_not_configured(tmp_path: Path) -> None:
    """The first failed write is a RuntimeWarning too (seen without logging configured)."""
    log = DecisionLog(check_log_path(tmp_path / "w.jsonl"))
    full = os.open("/dev/full", os.O_WRONLY)
    assert log._fd is not None
    os.dup2(full, log._fd)
    os.close(full)
    with pytest.warns(RuntimeWarning, match=r"w\.jsonl cannot be written \(No space left"):
        log.append(
            Decision(
                event="measured", time_s=0.0, device=None, width_before=1, width_after=1, reason="r"
            )
        )
    log.close()
    assert log.write_errors == 1
