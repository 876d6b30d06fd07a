"""gpupool.joblib: joblib's Parallel on a GpuPoolExecutor, on the simulated host."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

joblib = pytest.importorskip("joblib", reason="gpupool.joblib needs the 'joblib' extra")

import gpupool  # noqa: E402
import gpupool.joblib as gj  # noqa: E402
import gpupool.testing as gt  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]

#: Bounds a task's wait for a gate the test opens, so a broken test fails instead of hanging.
GATE_WAIT_S = 60.0


@pytest.fixture
def host() -> Iterator[gt.SimulatedHost]:
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB") as h:
        yield h


def _square(i: int) -> tuple[int, int]:
    """Hold 1 GiB of the simulated card; return ``i * i`` and the process that ran it."""
    with gt.hold("1GiB"):
        return i * i, os.getpid()


def _wait_for(path: Path) -> None:
    """Wait (bounded) until ``path`` exists."""
    deadline = time.monotonic() + GATE_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _fail_first_then_wait(i: int, gate: str, together: bool) -> int:
    """Call 0 raises (once call 1 has started, if ``together``); every other call records
    its start, waits for the gate, and records its end."""
    if i == 0:
        if together:
            _wait_for(Path(gate, "started-1"))
        raise ValueError("call 0 failed")
    Path(gate, f"started-{i}").touch()
    _wait_for(Path(gate, "open"))
    Path(gate, f"finished-{i}").touch()
    return i


def _run_settings(log: Path) -> dict[str, Any]:
    """The settings of the log's (only) run."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    started = [r for r in records if r["event"] == "run_started"]
    assert len(started) == 1
    prefix = "setting_"
    return {k[len(prefix) :]: v for k, v in started[0].items() if k.startswith(prefix)}


def _started(gate: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in gate.glob("started-*")}


def test_parallel_config_runs_calls_in_the_pool_with_its_options(
    host: gt.SimulatedHost, tmp_path: Path
) -> None:
    """Results come back in order, from the pool's workers, priced with the config's task_peak."""
    log = tmp_path / "run.jsonl"
    with joblib.parallel_config(backend="gpupool", n_jobs=2, task_peak="3GiB", log_path=log):
        results = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(8))
    assert [value for value, _ in results] == [i * i for i in range(8)]
    assert os.getpid() not in {pid for _, pid in results}
    settings = _run_settings(log)
    assert settings["max_workers"] == 2
    assert settings["task_peak_bytes"] == gpupool.parse_size("3GiB")
    keys = {r.get("key") for r in map(json.loads, log.read_text().splitlines())}
    assert f"{__name__}._square" in keys  # priced under its function, not joblib's batch
    assert host.out_of_memory_events == []


@pytest.mark.parametrize(
    ("n_jobs", "max_workers"),
    [(1, 1), (3, 3), (-1, None), (-2, "cpus - 1")],
)
def test_n_jobs_is_the_pools_max_workers(
    host: gt.SimulatedHost, tmp_path: Path, n_jobs: int, max_workers: int | str | None
) -> None:
    """n_jobs is max_workers (-1: the pool's default; -2: joblib's CPUs but one); even
    n_jobs=1 runs the calls in a pool worker, not in the calling process."""
    log = tmp_path / "run.jsonl"
    with joblib.parallel_config(backend="gpupool", n_jobs=n_jobs, log_path=log):
        results = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(3))
    assert [value for value, _ in results] == [0, 1, 4]
    assert os.getpid() not in {pid for _, pid in results}
    expected = max(joblib.cpu_count() - 1, 1) if max_workers == "cpus - 1" else max_workers
    assert _run_settings(log)["max_workers"] == expected


def test_parallel_backend_and_n_jobs_on_parallel(host: gt.SimulatedHost, tmp_path: Path) -> None:
    """parallel_backend works too, and Parallel's own n_jobs overrides the config's."""
    log = tmp_path / "run.jsonl"
    with joblib.parallel_backend("gpupool", n_jobs=4, task_peak="2GiB", log_path=log):
        results = joblib.Parallel(n_jobs=2)(joblib.delayed(_square)(i) for i in range(4))
    assert [value for value, _ in results] == [0, 1, 4, 9]
    assert _run_settings(log)["max_workers"] == 2


def test_pool_options_given_to_parallel_itself_reach_the_pool(
    host: gt.SimulatedHost, tmp_path: Path
) -> None:
    """Parallel(backend="gpupool", task_peak=..., log_path=...): joblib hands these to the
    backend's configure, and the pool is built with them (none silently dropped); beside a
    pool of your own they are refused."""
    log = tmp_path / "run.jsonl"
    results = joblib.Parallel(n_jobs=2, backend="gpupool", task_peak="3GiB", log_path=log)(
        joblib.delayed(_square)(i) for i in range(3)
    )
    assert [value for value, _ in results] == [0, 1, 4]
    settings = _run_settings(log)
    assert settings["max_workers"] == 2
    assert settings["task_peak_bytes"] == gpupool.parse_size("3GiB")
    with pytest.raises(gpupool.ConfigurationError, match="max_workers: pass n_jobs"):
        joblib.Parallel(backend="gpupool", max_workers=2)(joblib.delayed(_square)(0) for _ in "a")
    with gpupool.GpuPoolExecutor(max_workers=1) as ex:
        with (
            joblib.parallel_config(backend="gpupool", executor=ex),
            pytest.raises(gpupool.ConfigurationError, match="task_peak: given with executor="),
        ):
            joblib.Parallel(task_peak="2GiB")(joblib.delayed(_square)(0) for _ in "a")


def test_an_exception_aborts_the_rest_and_kills_the_running_call(
    host: gt.SimulatedHost, tmp_path: Path
) -> None:
    """The exception reaches the caller with its type; calls not started never start, and
    the call running beside it is stopped (its worker killed), not waited for."""
    gate = tmp_path / "gate"
    gate.mkdir()
    calls = (joblib.delayed(_fail_first_then_wait)(i, str(gate), True) for i in range(12))
    with (
        joblib.parallel_config(backend="gpupool", n_jobs=2, task_peak="1GiB"),
        pytest.raises(ValueError, match="call 0 failed") as raised,
    ):
        joblib.Parallel(pre_dispatch="all")(calls)
    assert raised.value.__cause__ is not None  # the child's traceback
    # Two workers: call 1 ran beside call 0; call 2 at most took call 0's place before
    # the abort; the other nine were cancelled.
    started = _started(gate)
    assert 1 in started
    assert started <= {1, 2}
    # The pool was shut down (its workers joined) before Parallel returned, and the gate
    # never opened: the running calls were killed, not waited for.
    assert list(gate.glob("finished-*")) == []


def test_a_pool_of_your_own_is_reused_and_never_shut_down(host: gt.SimulatedHost) -> None:
    """executor=: every call runs on it, it learns the function's ask, it stays open."""
    with gpupool.GpuPoolExecutor(max_workers=2, task_peak="2GiB") as ex:
        with joblib.parallel_config(backend="gpupool", executor=ex):
            first = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(4))
            second = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(4, 6))
        assert [v for v, _ in first + second] == [i * i for i in range(6)]
        assert ex.submit(pow, 2, 5).result(timeout=60) == 32  # still open
        assert f"{__name__}._square" in ex.statistics().asks
    assert ex.statistics().tasks_completed == 7


def test_with_your_own_pool_an_exception_cancels_what_has_not_started(
    host: gt.SimulatedHost, tmp_path: Path
) -> None:
    """executor=: calls not started are cancelled in the pool; the running one finishes."""
    gate = tmp_path / "gate"
    gate.mkdir()
    with gpupool.GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        calls = (joblib.delayed(_fail_first_then_wait)(i, str(gate), False) for i in range(12))
        with (
            joblib.parallel_config(backend="gpupool", executor=ex),
            pytest.raises(ValueError, match="call 0 failed"),
        ):
            joblib.Parallel(pre_dispatch="all")(calls)
        (gate / "open").touch()
    started = _started(gate)
    assert started <= {1}
    assert {int(p.name.split("-")[1]) for p in gate.glob("finished-*")} == started
    stats = ex.statistics()
    assert stats.tasks_submitted == 12
    assert stats.tasks_failed == 1
    assert stats.tasks_completed == len(started)
    assert stats.tasks_cancelled == 12 - 1 - len(started)


def test_bad_configuration_is_refused_when_the_config_is_made(host: gt.SimulatedHost) -> None:
    """max_workers (that is n_jobs), an unknown keyword, or pool keywords beside executor=."""
    with pytest.raises(gpupool.ConfigurationError, match="pass n_jobs"):
        joblib.parallel_config(backend="gpupool", max_workers=2)
    with pytest.raises(gpupool.ConfigurationError, match="task_peek: not a parameter"):
        joblib.parallel_config(backend="gpupool", task_peek="2GiB")
    with gpupool.GpuPoolExecutor(max_workers=1) as ex:
        with pytest.raises(gpupool.ConfigurationError, match="task_peak: given with executor="):
            joblib.parallel_config(backend="gpupool", executor=ex, task_peak="2GiB")
    with pytest.raises(gpupool.ConfigurationError, match="pass a GpuPoolExecutor"):
        joblib.parallel_config(backend="gpupool", executor=object())
    with gpupool.GpuPoolExecutor(max_workers=1) as ex:
        with (
            joblib.parallel_config(backend="gpupool", executor=ex, inner_max_num_threads=1),
            pytest.raises(gpupool.ConfigurationError, match="inner_max_num_threads: given"),
        ):
            joblib.Parallel()(joblib.delayed(_square)(i) for i in range(2))
    with pytest.raises(ValueError, match="n_jobs == 0"):
        joblib.Parallel(backend="gpupool", n_jobs=0)(joblib.delayed(_square)(i) for i in range(2))


def _thread_limits() -> tuple[str | None, str | None]:
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS")


def test_inner_max_num_threads_reaches_the_workers(host: gt.SimulatedHost) -> None:
    """inner_max_num_threads sets joblib's thread variables in the workers; env= wins."""
    with joblib.parallel_config(
        backend="gpupool", n_jobs=2, inner_max_num_threads=3, env={"MKL_NUM_THREADS": "5"}
    ):
        limits = joblib.Parallel()(joblib.delayed(_thread_limits)() for _ in range(2))
    assert limits == [("3", "5"), ("3", "5")]


def test_with_parallel_keeps_one_pool_for_its_calls(host: gt.SimulatedHost, tmp_path: Path) -> None:
    """A ``with Parallel(...)`` block builds one pool (one run in the log) for all its calls."""
    log = tmp_path / "run.jsonl"
    with (
        joblib.parallel_config(backend="gpupool", n_jobs=2, log_path=log),
        joblib.Parallel() as parallel,
    ):
        first = parallel(joblib.delayed(_square)(i) for i in range(3))
        second = parallel(joblib.delayed(_square)(i) for i in range(3, 5))
    assert [v for v, _ in first + second] == [i * i for i in range(5)]
    assert _run_settings(log)["max_workers"] == 2  # one run_started record


def test_register_under_another_name(host: gt.SimulatedHost) -> None:
    """register(name) makes the backend available under that name."""
    gj.register("gpupool-test")
    with joblib.parallel_config(backend="gpupool-test", n_jobs=2):
        results = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(2))
    assert [v for v, _ in results] == [0, 1]
    with pytest.raises(gpupool.ConfigurationError, match="non-empty backend name"):
        gj.register("")
