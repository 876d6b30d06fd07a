"""Claims of the docs and docstrings that no other test pinned.

The first part needs no worker process; the rest runs pools on simulated cards.
(One file: a second ``test_doc_claims.py`` elsewhere under ``tests/`` would clash
with this one's module name under pytest's default import mode.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import pytest
import tasks

import gpupool.testing as gt
from gpupool import ConfigurationError, GpuPoolExecutor, WidthError, WorkerLostError
from gpupool._core.bound import derive_ceiling
from gpupool._core.census import CardCensus
from gpupool._core.events import SCHEMA_VERSION, Decision
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB, MiB, format_size, parse_size
from gpupool._observe.log import DecisionLog
from gpupool._sensors.cuda import parse_visible_devices
from gpupool.testing import SimulatedDevice, SimulatedHost
from support.fit import planner_width

TOTAL = parse_size("44.39GiB")
CO_TENANT = parse_size("9.54GiB")
OWN_HIGH_WATER = parse_size("16.20GiB")
ESTIMATE = parse_size("9.90GiB")
MEASURED_PEAK = 6_461_325_312


def test_the_incident_under_the_default_policy_asks_6_62_gib_of_18_40_gib_room() -> None:
    """Default margin and reserve on the incident: 6.62 GiB ask, 18.40 GiB room, widths 1 then 2."""
    card = CardCensus(
        device=0,
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        name="incident card",
        total_bytes=TOTAL,
        free_bytes=TOTAL - CO_TENANT - OWN_HIGH_WATER,
        own_bytes=OWN_HIGH_WATER,
        source="given",
    )
    policy = Policy()
    table = AskTable(policy=policy, default_estimate_bytes=ESTIMATE)
    ceiling = derive_ceiling(max_workers=4)

    def width() -> tuple[int, int]:
        decision = planner_width(
            card,
            table.ask("entry"),
            ceiling=ceiling,
            own_high_water_bytes=OWN_HIGH_WATER,
            reserve_bytes=policy.reserve_bytes,
        )
        assert decision.bound.room_bytes is not None
        return decision.width, decision.bound.room_bytes

    estimated_width, room = width()
    assert format_size(room) == "18.40 GiB"
    assert estimated_width == 1
    table.measure("entry", MEASURED_PEAK)
    assert format_size(table.ask("entry").ask_bytes) == "6.62 GiB"
    measured_width, _ = width()
    assert measured_width == 2


def test_the_legacy_mig_gpu_form_of_cuda_visible_devices_is_not_resolved() -> None:
    """A MIG-GPU-<uuid>/<gi>/<ci> entry matches nothing, so it hides itself and what follows."""
    with gt.SimulatedHost([gt.SimulatedDevice("10GiB"), gt.SimulatedDevice("10GiB")]) as host:
        listed = host.sensor().read_devices()
        legacy = f"MIG-{host.device_uuid(0)}/1/0"
        visible, note = parse_visible_devices(f"1,{legacy},0", listed)
    assert [info.uuid for info in visible] == [host.device_uuid(1)]
    assert note is not None
    assert note.startswith(f"CUDA_VISIBLE_DEVICES entry {legacy!r} matches no device")


_WARNING_EVENTS = (
    "out_of_memory",
    "serial_start",
    "fixed_width_over_bound",
    "peaks_vary",
    "unexplained_memory",
)
_INFO_EVENTS = (
    "constructed",
    "widened",
    "narrowed",
    "measured",
    "live_gate_wait",
    "worker_lost",
    "sensor_error",
)


@pytest.mark.parametrize(
    ("event", "level"),
    [(e, logging.WARNING) for e in _WARNING_EVENTS] + [(e, logging.INFO) for e in _INFO_EVENTS],
)
def test_each_event_goes_to_the_gpupool_logger_at_its_level(
    event: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Out-of-memory, serial starts and a fixed width over the bound are WARNING (the user
    must act); the other records INFO; each with the record (and its run id) attached."""
    decision = Decision(
        event=event, time_s=0.0, device=None, width_before=1, width_after=1, reason="r"
    )  # type: ignore[arg-type]
    log = DecisionLog()
    with caplog.at_level(logging.INFO, logger="gpupool"):
        log.append(decision)
    [record] = caplog.records
    assert record.name == "gpupool"
    assert record.levelno == level
    assert record.gpupool == dataclasses.replace(decision, run_id=log.run_id)  # type: ignore[attr-defined]


def test_the_json_lines_file_is_flushed_as_each_record_is_written(tmp_path) -> None:
    """Each record is on disk, one JSON object per line, before the log is closed."""
    path = tmp_path / "run.jsonl"
    log = DecisionLog(path)
    try:
        for width in (1, 2):
            log.append(
                Decision(
                    event="widened",
                    time_s=0.5,
                    device=0,
                    width_before=1,
                    width_after=width,
                    reason="r",
                )
            )
            header, *lines = path.read_text(encoding="utf-8").splitlines()
            assert json.loads(header)["event"] == "run_started"
            assert len(lines) == width
            assert json.loads(lines[-1])["width_after"] == width
            assert json.loads(lines[-1])["schema"] == SCHEMA_VERSION
            assert json.loads(lines[-1])["run_id"] == log.run_id
    finally:
        log.close()


# -- gpupool.testing ------------------------------------------------------------------------


def test_a_simulated_host_cannot_be_entered_twice() -> None:
    """Entering a SimulatedHost that is already entered raises RuntimeError."""
    with gt.SimulatedHost([gt.SimulatedDevice("1GiB")]) as host:
        with pytest.raises(RuntimeError, match=r"^this SimulatedHost is already entered"):
            host.__enter__()


def test_ledger_path_and_sensor_outside_the_block_raise() -> None:
    """ledger_path and sensor() raise RuntimeError outside the block."""
    host = gt.SimulatedHost([gt.SimulatedDevice("1GiB")])
    with pytest.raises(RuntimeError, match=r"^this SimulatedHost is not entered"):
        _ = host.ledger_path
    with pytest.raises(RuntimeError, match=r"^this SimulatedHost is not entered"):
        host.sensor()


def test_device_uuids_follow_the_documented_pattern_and_unknown_indexes_are_refused() -> None:
    """Device i has UUID GPU-51a1a7ed-...-00000000000i; a missing index is a ValueError."""
    host = gt.SimulatedHost([gt.SimulatedDevice("1GiB"), gt.SimulatedDevice("1GiB")])
    assert host.device_uuid(1) == "GPU-51a1a7ed-0000-4000-8000-000000000001"
    with pytest.raises(ValueError, match=r"^the simulated host has 2 device\(s\); no 2$"):
        host.device_uuid(2)


def test_process_peak_without_a_device_is_the_largest_over_the_cards() -> None:
    """process_peak(pid) is the largest per-card peak; 0 for a card it never allocated on."""
    devices = [gt.SimulatedDevice("10GiB") for _ in range(3)]
    with gt.SimulatedHost(devices, context=0) as host:
        with gt.hold("1GiB", device=0):
            pass
        with gt.hold("3GiB", device=1):
            pass
    pid = os.getpid()
    assert host.process_peak(pid, device=0) == 1 * GiB
    assert host.process_peak(pid, device=2) == 0
    assert host.process_peak(pid) == 3 * GiB
    assert host.process_peak(pid + 10**6) == 0


def test_the_default_context_is_300_mib() -> None:
    """A process's first allocation on a card is charged 300 MiB unless told otherwise."""
    with gt.SimulatedHost([gt.SimulatedDevice("10GiB")]) as host, gt.hold(0):
        assert host.used(0) == 300 * MiB


# -- gpupool.dask ----------------------------------------------------------------------------


def test_dask_plugin_shutdown_timeout_defaults_to_30_s() -> None:
    """GpuPoolPlugin waits at most 30 s for running tasks at teardown by default."""
    gd = pytest.importorskip("gpupool.dask")
    assert gd.GpuPoolPlugin(task_peak="6GiB").shutdown_timeout == 30.0


def test_dask_preload_has_the_documented_options() -> None:
    """The preload takes --gpupool-name (default gpu), -task-peak, -max-workers, -log-path."""
    gd = pytest.importorskip("gpupool.dask")
    options = {opt: param for param in gd.dask_setup.params for opt in param.opts}
    assert set(options) == {
        "--gpupool-name",
        "--gpupool-task-peak",
        "--gpupool-max-workers",
        "--gpupool-log-path",
    }
    assert options["--gpupool-name"].default == "gpu"


# -- pools on simulated cards ------------------------------------------------------------


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def host():
    with SimulatedHost([SimulatedDevice("80GiB")], cpus=3, host_ram="64GiB") as h:
        yield h


# -- construction: defaults and refusals ----------------------------------------------------


def test_max_workers_defaults_to_the_usable_cpus(host):
    """Without max_workers, the ceiling's max_workers term is the host's usable CPUs."""
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        constructed = ex.decisions[0]
        assert ex.width == 3
    assert constructed.ceiling is not None
    assert constructed.ceiling.max_workers == 3


def test_the_default_reserve_is_256_mib_in_the_bound(host):
    """Without reserve=, the constructed record's bound keeps 256 MiB free."""
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        record = ex.decisions[0].to_dict()
    assert record["reserve_bytes"] == 256 * MiB
    assert record["room_bytes"] == 80 * GiB - 256 * MiB


def test_a_reserve_exactly_as_large_as_the_card_is_refused(host):
    """reserve equal to the card's total is refused, not only a larger one."""
    with pytest.raises(ConfigurationError, match=r"^reserve=80\.00 GiB is not smaller than card 0"):
        GpuPoolExecutor(task_peak="1GiB", reserve="80GiB")


@pytest.mark.parametrize("value", [-0.1, float("nan"), "0.1", True])
def test_a_bad_margin_fraction_is_refused(host, value):
    """margin_fraction must be a finite number in range; the message names the value."""
    with pytest.raises(ConfigurationError, match=r"^margin_fraction=.*: pass a fraction such as"):
        GpuPoolExecutor(task_peak="1GiB", margin_fraction=value)


def test_a_bad_progress_value_is_refused(host):
    """progress accepts only True, False or None."""
    with pytest.raises(ConfigurationError, match=r"^progress='yes': pass True, False or None\.$"):
        GpuPoolExecutor(task_peak="1GiB", progress="yes")  # type: ignore[arg-type]


def test_an_options_key_that_is_not_a_str_is_refused(host):
    """options(key=...) must be a non-empty str; the message says how to fix it."""
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        with pytest.raises(ConfigurationError, match=r"^key=3: a task key must be a non-empty str"):
            ex.options(key=3)  # type: ignore[arg-type]


def test_the_first_decision_goes_to_the_logger_and_the_file_at_once(host, tmp_path, caplog):
    """The constructed record is ex.decisions[0], on the gpupool logger and on disk at once."""
    path = tmp_path / "run.jsonl"
    with caplog.at_level(logging.INFO, logger="gpupool"):
        with GpuPoolExecutor(task_peak="1GiB", log_path=path) as ex:
            first = ex.decisions[0]
            lines = path.read_text(encoding="utf-8").splitlines()
    assert first.event == "constructed"
    assert json.loads(lines[0])["event"] == "run_started"
    # The dispatcher may have sampled the card since (a card_read record, not a decision).
    decided = [json.loads(line) for line in lines[1:]]
    assert [r for r in decided if r["event"] != "card_read"] == [first.to_dict()]
    logged = [r for r in caplog.records if r.name == "gpupool"]
    assert logged[0].gpupool is first  # type: ignore[attr-defined]
    assert logged[0].levelno == logging.INFO


# -- measurements ----------------------------------------------------------------------------


def test_statistics_asks_lists_every_key_submitted_with_its_basis(host, tmp_path):
    """statistics().asks lists a key as soon as its task is submitted, priced by the estimate
    (the pool's task_peak, or the key's own) with basis "estimated", then "measured"."""
    started, release = tmp_path / "started", tmp_path / "release"
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        try:
            running = ex.submit(tasks.touch_and_wait, str(started), str(release), 1)
            waiting = ex.options(key="hinted", task_peak="2GiB").submit(tasks.sleep_return, 2, 0.0)
            _wait_for(started.exists, "the first task to run in its worker")
            _wait_for(lambda: "hinted" in ex.statistics().asks, "the hinted key's snapshot")
            asks = ex.statistics().asks
            assert {key: (a.basis, a.ask_bytes) for key, a in asks.items()} == {
                "tasks.touch_and_wait": ("estimated", 1 * GiB),
                "hinted": ("estimated", 2 * GiB),
            }
        finally:
            release.touch()
        assert (running.result(timeout=60), waiting.result(timeout=60)) == (1, 2)
    assert {a.basis for a in ex.statistics().asks.values()} == {"measured"}


def test_a_measured_peak_includes_the_context_and_gets_the_default_margin():
    """A task's peak counts its CUDA context; the ask adds max(256 MiB, 10 %) by default."""
    with SimulatedHost([SimulatedDevice("80GiB")], cpus=2, host_ram="64GiB"):  # 300 MiB context
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB") as ex:
            assert ex.submit(tasks.sized, 0, "1GiB", 0.0).result(timeout=60) == 0
            ask = ex.statistics().asks["tasks.sized"]
            measured = [d.to_dict() for d in ex.decisions if d.event == "measured"]
    assert ask.basis == "measured"
    assert ask.measured_peak_bytes == 1 * GiB + 300 * MiB
    assert ask.ask_bytes == 1 * GiB + 300 * MiB + 256 * MiB
    assert measured and measured[0]["peak_bytes"] == 1 * GiB + 300 * MiB
    assert measured[0]["peak_source"] == "simulator"
    assert isinstance(measured[0]["rss_peak_bytes"], int) and measured[0]["rss_peak_bytes"] > 0


def test_the_census_is_not_retaken_when_a_measurement_moves_the_width():
    """A widen after a co-tenant grew still prices the co-tenant the census saw."""
    with SimulatedHost(
        [SimulatedDevice("20GiB", co_tenants={"serve": "2GiB"})],
        cpus=8,
        host_ram="64GiB",
        context=0,
    ) as host:
        with GpuPoolExecutor(max_workers=4, task_peak="16GiB", reserve=0) as ex:
            assert ex.width == 1
            host.grow("serve", "4GiB")
            assert ex.submit(tasks.sized, 0, "1GiB", 0.0).result(timeout=60) == 0
            widened = [d.to_dict() for d in ex.decisions if d.event == "widened"]
            census_co_tenant = ex.census.cards[0].co_tenant_bytes
    assert census_co_tenant == 2 * GiB
    assert widened, "the measurement should have widened the pool"
    assert widened[0]["co_tenant_bytes"] == 2 * GiB
    assert widened[0]["width_after"] == 4


def test_strict_mode_breaks_the_pool_when_a_measurement_would_narrow():
    """strict=True: a measurement that narrows below max_workers breaks the pool with WidthError."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context=0):
        ex = GpuPoolExecutor(max_workers=2, task_peak="1GiB", reserve=0, strict=True)
        try:
            assert ex.width == 2
            assert ex.submit(tasks.sized, 0, "6GiB", 0.0).result(timeout=60) == 0
            with pytest.raises(WidthError, match=r"^strict mode: .*refusing to narrow"):
                ex.submit(tasks.sized, 1, "1GiB", 0.0)
        finally:
            ex.shutdown()


# -- the live gate -------------------------------------------------------------------------


def test_a_live_gate_wait_is_logged_once_per_wait_not_once_per_poll():
    """A task held back by the live gate for many polls yields one live_gate_wait record."""
    with SimulatedHost([SimulatedDevice("10GiB")], cpus=4, host_ram="64GiB", context=0) as host:
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB", reserve=0) as ex:
            assert ex.width == 2
            first = ex.submit(tasks.sized, 0, "4GiB", 1.0)
            _wait_for(lambda: host.used(0) >= 4 * GiB, "the first task to hold its bytes")
            host.grow("serve", "4GiB")  # 2 GiB free: the second 4 GiB ask waits
            second = ex.submit(tasks.sized, 1, "1GiB", 0.0)
            assert [first.result(timeout=60), second.result(timeout=60)] == [0, 1]
            waits = [d for d in ex.decisions if d.event == "live_gate_wait"]
    assert len(waits) == 1
    assert waits[0].to_dict()["running"] == 1


# -- forced shutdown -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "signal_name"),
    [("kill_workers", "SIGKILL"), ("terminate_workers", "SIGTERM")],
)
def test_a_task_whose_worker_is_still_booting_fails_naming_the_pools_own_call(
    host, tmp_path, method, signal_name
):
    """kill_workers()/terminate_workers() while the worker started for a task is still in its
    initializer: that task (RUNNING: a worker was started for it) fails with WorkerLostError
    naming the call and its signal, as a running task's does; what waited is cancelled, the
    pool is not broken, and no task is lost."""
    booting, release = tmp_path / "booting", tmp_path / "release"
    ex = GpuPoolExecutor(
        max_workers=1,
        task_peak="1GiB",
        initializer=tasks.touch_and_wait,
        initargs=(str(booting), str(release)),
    )
    try:
        handed = ex.submit(tasks.sleep_return, 1, 0.0)
        waiting = ex.submit(tasks.sleep_return, 2, 0.0)
        _wait_for(booting.exists, "the worker to run its initializer")
        assert handed.running()
        getattr(ex, method)()
        with pytest.raises(WorkerLostError) as info:
            handed.result(timeout=30)
        assert info.value.signal_name == signal_name
        assert f"{method}() stopped the pool before this task ran" in str(info.value)
        assert waiting.cancelled()
        with pytest.raises(RuntimeError, match=r"^cannot schedule new futures after shutdown$"):
            ex.submit(abs, 1)
    finally:
        release.touch()
        ex.shutdown()
    stats = ex.statistics()
    assert (stats.tasks_failed, stats.tasks_cancelled, stats.tasks_submitted) == (1, 1, 2)
    assert [d.to_dict()["tasks_lost"] for d in ex.decisions if d.event == "shutdown"] == [0]


def test_kill_workers_cancels_pending_tasks_and_sigkills_the_running_one(host, tmp_path):
    """kill_workers(): what has not started is cancelled; the running task's worker is SIGKILLed."""
    ex = GpuPoolExecutor(max_workers=1, task_peak="1GiB")
    started = tmp_path / "started"
    try:
        running = ex.submit(tasks.touch_and_sleep, str(started), 30.0)
        pending = [ex.submit(tasks.sleep_return, i, 0.0) for i in range(1, 4)]
        # RUNNING is set once a worker is started for the task, which it is handed when
        # that worker is ready: wait until it runs there.
        _wait_for(started.exists, "the first task to run in its worker")
        ex.kill_workers()
        with pytest.raises(WorkerLostError) as info:
            running.result(timeout=30)
        assert info.value.signal_name == "SIGKILL"
        assert all(f.cancelled() for f in pending)
        with pytest.raises(RuntimeError, match=r"^cannot schedule new futures after shutdown$"):
            ex.submit(abs, 1)
    finally:
        ex.shutdown()
