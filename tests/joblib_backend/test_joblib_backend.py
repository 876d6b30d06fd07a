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
        assert gj.shutdown_pools() >= 0  # the kept pools end with the host they were built on


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
    [(3, 3), (-1, None), (-2, "cpus - 1")],
)
def test_n_jobs_is_the_pools_max_workers(
    host: gt.SimulatedHost, tmp_path: Path, n_jobs: int, max_workers: int | str | None
) -> None:
    """n_jobs is max_workers (-1: the pool's default; -2: joblib's CPUs but one, which on
    a 2-CPU host is one job: joblib's calling process, as with loky)."""
    log = tmp_path / "run.jsonl"
    with joblib.parallel_config(backend="gpupool", n_jobs=n_jobs, log_path=log):
        results = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(3))
    assert [value for value, _ in results] == [0, 1, 4]
    expected = max(joblib.cpu_count() - 1, 1) if max_workers == "cpus - 1" else max_workers
    if expected == 1 or (expected is None and joblib.cpu_count() == 1):
        assert {pid for _, pid in results} == {os.getpid()}
        assert not log.exists()
        return
    assert os.getpid() not in {pid for _, pid in results}
    assert _run_settings(log)["max_workers"] == expected


@pytest.mark.parametrize("n_jobs", [None, 1])
def test_n_jobs_none_and_1_run_in_the_calling_process(
    host: gt.SimulatedHost, tmp_path: Path, n_jobs: int | None
) -> None:
    """As joblib documents: n_jobs=None (no config setting it) and n_jobs=1 run the calls
    in the calling process, and build no pool."""
    log = tmp_path / "run.jsonl"
    results = joblib.Parallel(backend="gpupool", n_jobs=n_jobs, log_path=log)(
        joblib.delayed(_square)(i) for i in range(3)
    )
    assert results == [(0, os.getpid()), (1, os.getpid()), (4, os.getpid())]
    with joblib.parallel_config(backend="gpupool", log_path=log):
        assert joblib.Parallel(n_jobs=n_jobs)(joblib.delayed(_square)(i) for i in range(2)) == [
            (0, os.getpid()),
            (1, os.getpid()),
        ]
    assert not log.exists()


def test_a_pool_is_kept_for_the_next_call_with_the_same_options(
    host: gt.SimulatedHost, tmp_path: Path
) -> None:
    """As loky's reusable executor: the second call runs on the first call's workers (one
    run in the log, the ask learned); other options get another pool; shutdown_pools
    ends the kept ones."""
    log = tmp_path / "run.jsonl"
    with joblib.parallel_config(backend="gpupool", n_jobs=2, log_path=log):
        first = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(4))
        second = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(4))
    assert first == second or {p for _, p in first} & {p for _, p in second}
    assert [v for v, _ in second] == [i * i for i in range(4)]
    assert _run_settings(log)["max_workers"] == 2  # one pool: one run_started record
    other = tmp_path / "other.jsonl"
    with joblib.parallel_config(backend="gpupool", n_jobs=3, log_path=other):
        third = joblib.Parallel()(joblib.delayed(_square)(i) for i in range(2))
    assert not {p for _, p in third} & {p for _, p in first + second}
    assert _run_settings(other)["max_workers"] == 3
    assert gj.shutdown_pools() == 2
    assert gj.shutdown_pools() == 0


def _thread_variables() -> dict[str, str | None]:
    names = [*gj.GpuPoolBackend.MAX_NUM_THREADS_VARS, gj.GpuPoolBackend.TBB_ENABLE_IPC_VAR]
    return {name: os.environ.get(name) for name in names}


def test_workers_threads_are_capped_as_lokys(
    host: gt.SimulatedHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of joblib's thread variables is cpus // n_jobs in the workers (the caller's own
    value where it sets one), and TBB's ENABLE_IPC is 1: what joblib's loky backend sets."""
    for name in _thread_variables():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    with joblib.parallel_config(backend="gpupool", n_jobs=2):
        (seen,) = joblib.Parallel()(joblib.delayed(_thread_variables)() for _ in range(1))
    with joblib.parallel_config(backend="loky", n_jobs=2):
        (lokys,) = joblib.Parallel()(joblib.delayed(_thread_variables)() for _ in range(1))
    cap = str(max(joblib.cpu_count() // 2, 1))
    assert seen["OMP_NUM_THREADS"] == seen["OPENBLAS_NUM_THREADS"] == cap
    assert seen["MKL_NUM_THREADS"] == "7"
    assert seen["ENABLE_IPC"] == "1"
    assert seen == lokys


def _in_a_daemonic_process() -> tuple[list[tuple[int, int]], list[str]]:
    """Run a gpupool Parallel of two jobs inside this (daemonic) process."""
    import warnings

    import gpupool.joblib  # noqa: F401  # registers the backend here

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = joblib.Parallel(backend="gpupool", n_jobs=2)(
            joblib.delayed(_square)(i) for i in range(2)
        )
    return results, [str(w.message) for w in caught]


def test_in_a_daemonic_process_it_warns_and_runs_in_it(host: gt.SimulatedHost) -> None:
    """In a multiprocessing.Pool worker (daemonic: no children), as loky's backend: a
    warning, and the calls run in that process instead of raising ConfigurationError."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as mp_pool:
        results, messages = mp_pool.apply(_in_a_daemonic_process)
        child_pid = mp_pool.apply(os.getpid)
    assert results == [(0, child_pid), (1, child_pid)]
    assert any("daemonic process" in m and "n_jobs=1" in m for m in messages)


def _nested_call(i: int, log: str) -> list[int]:
    """A gpupool Parallel made from a thread of an outer Parallel."""
    with joblib.parallel_config(backend="gpupool", n_jobs=2, log_path=log):
        return [v for v, _ in joblib.Parallel()(joblib.delayed(_square)(j) for j in (i, i + 1))]


def test_re_entrant_and_nested_calls_never_end_a_pool_in_use(
    host: gt.SimulatedHost, tmp_path: Path
) -> None:
    """A Parallel made while a managed ``with Parallel()`` is open (same config, so the
    same backend object) leaves the outer call's pool working; calls from threads of
    an outer Parallel share one kept pool and none ends it under another."""
    log = tmp_path / "run.jsonl"
    with joblib.parallel_config(backend="gpupool", n_jobs=2, log_path=log):
        with joblib.Parallel() as outer:
            first = outer(joblib.delayed(_square)(i) for i in range(2))
            inner = joblib.Parallel(n_jobs=3)(joblib.delayed(_square)(i) for i in range(2))
            again = outer(joblib.delayed(_square)(i) for i in range(2, 4))
    assert [v for v, _ in first + inner + again] == [0, 1, 0, 1, 4, 9]
    nested_log = tmp_path / "nested.jsonl"
    nested = joblib.Parallel(backend="threading", n_jobs=4)(
        joblib.delayed(_nested_call)(i, str(nested_log)) for i in range(8)
    )
    assert nested == [[i * i, (i + 1) * (i + 1)] for i in range(8)]
    assert _run_settings(nested_log)["max_workers"] == 2  # one kept pool for all of them


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
    # The killed pool is not kept: the next call runs on a new one.
    with joblib.parallel_config(backend="gpupool", n_jobs=2, task_peak="1GiB"):
        assert [v for v, _ in joblib.Parallel()(joblib.delayed(_square)(i) for i in range(3))] == [
            0,
            1,
            4,
        ]
    assert gj.shutdown_pools() == 1


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
