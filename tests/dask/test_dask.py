"""gpupool.dask: one memory-priced pool per Dask worker, each on its own simulated host."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

distributed = pytest.importorskip(
    "distributed", reason="gpupool.dask needs the 'dask' extra (distributed)"
)
# Imported through importorskip: ruff would take ``import dask`` for this test folder.
dask = pytest.importorskip("dask")

import gpupool  # noqa: E402
import gpupool.dask as gd  # noqa: E402
import gpupool.testing as gt  # noqa: E402
from gpupool._core.units import GiB  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]

#: Each worker's simulated card, by worker name: different totals, so each
#: pool's census and widths must be its own.
CARDS = {0: "8GiB", 1: "24GiB"}

#: Bound every wait on the cluster, so a broken test fails instead of hanging.
TIMEOUT_S = 60


def _simulated_host(worker: Any) -> gt.SimulatedHost:
    """The simulated host of one worker, built in that worker's own process."""
    return gt.SimulatedHost([gt.SimulatedDevice(CARDS[worker.name])], cpus=2)


def _hold_task(i: int, size: str = "3GiB", seconds: float = 0.1) -> int:
    """A GPU-ish task: hold ``size`` of the simulated card briefly, return a checkable value."""
    with gt.hold(size):
        time.sleep(seconds)
    return i * i


def _hold_together(i: int, size: str, gate: str, together: int) -> int:
    """Wait (bounded) until ``together`` tasks have started, then hold ``size`` briefly."""
    from pathlib import Path

    Path(gate, f"started-{i}").touch()
    deadline = time.monotonic() + 60
    while len(list(Path(gate).glob("started-*"))) < together and time.monotonic() < deadline:
        time.sleep(0.01)
    with gt.hold(size):
        time.sleep(0.5)
    return i * i


def _fail(message: str) -> None:
    """A task that raises a ValueError."""
    raise ValueError(message)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, dict[int, str]]]:
    """A two-process LocalCluster with the gpupool plugin; yields (client, address by name)."""
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        distributed.LocalCluster(
            processes=True,
            n_workers=2,
            threads_per_worker=2,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as local,
        distributed.Client(local) as client,
    ):
        gd.register(client, task_peak="6GiB", simulate=_simulated_host)
        info = client.scheduler_info()["workers"]
        addresses = {w["name"]: address for address, w in info.items()}
        yield client, addresses


def _gather(client: Any, futures: list[Any]) -> list[Any]:
    """Wait (bounded) for ``futures``, then gather their results."""
    distributed.wait(futures, timeout=TIMEOUT_S)
    return list(client.gather(futures))


def _pool_states(dask_worker: Any) -> dict[str, str]:
    """The state of each Dask task in the worker's pool (PENDING: held back for memory)."""
    executor = dask_worker.executors["gpu"]
    return {
        key: "RUNNING"
        if future._inner.running()
        else "PENDING"
        if not future._inner.done()
        else "DONE"
        for key, future in executor._running.items()
    }


def _reports(client: Any) -> dict[int, dict[str, Any]]:
    return {r["worker_name"]: r for r in gd.report(client).values()}


def test_annotated_tasks_pack_each_worker_by_its_own_card(cluster: Any) -> None:
    """Annotated tasks run in each worker's pool, priced by that worker's own census, no OOM."""
    client, _ = cluster
    offset = 7

    def closure(i: int) -> int:
        with gt.hold("2GiB"):
            time.sleep(0.05)
        return i + offset

    with dask.annotate(executor="gpu"):
        squares = client.map(_hold_task, range(32))
        closures = client.map(closure, range(8))
    assert _gather(client, squares) == [i * i for i in range(32)]
    assert _gather(client, closures) == [i + 7 for i in range(8)]

    reports = _reports(client)
    assert set(reports) == {0, 1}
    assert json.loads(json.dumps(reports)) == {str(k): v for k, v in reports.items()}
    for name, rep in reports.items():
        total = gpupool.parse_size(CARDS[name])
        assert rep["census"]["cards"][0]["total_bytes"] == total
        constructed = [d for d in rep["decisions"] if d["event"] == "constructed"]
        assert len(constructed) == 1
        assert constructed[0]["total_bytes"] == total
        assert rep["simulated"]["out_of_memory_events"] == []
        assert rep["simulated"]["devices"][0]["peak_bytes"] <= total
        assert rep["statistics"]["out_of_memory"] == 0
    # 8 GiB holds one 6 GiB estimate; 24 GiB holds three, capped at the worker's 2 threads.
    assert reports[0]["decisions"][0]["width_after"] == 1
    assert reports[1]["decisions"][0]["width_after"] == 2
    assert reports[1]["decisions"][0]["limit"] == "max_workers"
    done = sum(r["statistics"]["tasks_completed"] for r in reports.values())
    assert done >= 40
    keys = set().union(*(r["statistics"]["asks"] for r in reports.values()))
    # Asks are kept per Dask task prefix (key_split drops the leading underscore).
    assert {"hold_task", "closure"} <= keys


def test_exceptions_reach_the_dask_future_with_their_type(cluster: Any) -> None:
    """A task's exception reaches its Dask future with its type and message."""
    client, _ = cluster
    with dask.annotate(executor="gpu"):
        future = client.submit(_fail, "no such entry", pure=False)
        zero = client.submit(lambda: 1 // 0, pure=False)
    with pytest.raises(ValueError, match="no such entry"):
        future.result(timeout=TIMEOUT_S)
    with pytest.raises(ZeroDivisionError):
        zero.result(timeout=TIMEOUT_S)
    assert future.status == "error"


def test_a_peak_annotation_prices_the_task_and_an_oversized_one_runs_serially(
    cluster: Any,
) -> None:
    """gpupool_peak and gpupool_key reach the pool; a task larger than the card still runs."""
    client, addresses = cluster
    with dask.annotate(executor="gpu", gpupool_peak="30GiB", gpupool_key="huge"):
        future = client.submit(_hold_task, 3, "1GiB", workers=[addresses[0]], pure=False)
    assert future.result(timeout=TIMEOUT_S) == 9
    asks = _reports(client)[0]["statistics"]["asks"]
    assert asks["huge"]["estimate_bytes"] == 30 * GiB


def test_an_oom_retried_in_the_pool_is_invisible_to_dask(cluster: Any, tmp_path: Any) -> None:
    """Under an underestimated peak, a simulated OOM is retried in the pool; Dask sees results."""
    client, addresses = cluster
    before = _reports(client)[0]
    # Both start before either allocates (staged with files, not delays): 2 x 5 GiB overflow.
    with dask.annotate(executor="gpu", gpupool_peak="1GiB", gpupool_key="underestimated"):
        futures = client.map(
            _hold_together,
            [1, 2],
            size="5GiB",
            gate=str(tmp_path),
            together=2,
            workers=[addresses[0]],
            pure=False,
        )
    assert _gather(client, futures) == [1, 4]
    after = _reports(client)[0]
    assert after["statistics"]["out_of_memory"] > before["statistics"]["out_of_memory"]
    assert after["statistics"]["retries"] > before["statistics"]["retries"]
    events = after["simulated"]["out_of_memory_events"]
    assert len(events) > len(before["simulated"]["out_of_memory_events"])
    assert any(d["event"] == "out_of_memory" for d in after["decisions"])


def test_cancelling_a_task_held_back_by_the_pool_cancels_it_there(cluster: Any) -> None:
    """A Dask task the pool holds back for memory never runs once Dask cancels it."""
    client, addresses = cluster
    before = _reports(client)[0]["statistics"]
    # On the 8 GiB card a 5 GiB task and a 6 GiB task do not fit together, and the
    # larger ask cannot queue behind the smaller one's worker: the second waits.
    with dask.annotate(executor="gpu", gpupool_peak="5GiB", gpupool_key="first"):
        running = client.submit(_hold_task, 1, "1GiB", 1.0, workers=[addresses[0]], pure=False)
    with dask.annotate(executor="gpu", gpupool_peak="6GiB", gpupool_key="second"):
        held = client.submit(_hold_task, 2, "1GiB", 0.1, workers=[addresses[0]], pure=False)
    deadline = time.monotonic() + TIMEOUT_S
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = client.run(_pool_states, workers=[addresses[0]])[addresses[0]]
        if states.get(running.key) == "RUNNING" and states.get(held.key) == "PENDING":
            break
        time.sleep(0.05)
    assert states == {running.key: "RUNNING", held.key: "PENDING"}
    held.cancel()
    assert running.result(timeout=TIMEOUT_S) == 1
    assert held.cancelled()
    time.sleep(1.0)  # had it not been cancelled in the pool, it would have run by now
    after = _reports(client)[0]["statistics"]
    assert after["tasks_submitted"] - before["tasks_submitted"] == 2
    assert after["tasks_completed"] - before["tasks_completed"] == 1
    assert after["tasks_failed"] == before["tasks_failed"]
    assert after["asks"]["second"]["samples"] == 0


def test_the_cluster_shuts_down_without_leaking_pool_processes() -> None:
    """Closing the cluster tears the pools down: no pool worker process outlives it."""

    def pool_pids(dask_worker: Any) -> list[int]:
        return list(dask_worker.executors["gpu"].pool._processes)

    with (
        dask.config.set({"distributed.worker.daemon": False}),
        distributed.LocalCluster(
            processes=True,
            n_workers=1,
            threads_per_worker=2,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as local,
        distributed.Client(local) as client,
    ):
        gd.register(
            client,
            task_peak="1GiB",
            simulate=lambda worker: gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=2),
        )
        with dask.annotate(executor="gpu"):
            assert _gather(client, client.map(_hold_task, range(4))) == [
                0,
                1,
                4,
                9,
            ]
        pids = [pid for found in client.run(pool_pids).values() for pid in found]
        assert pids
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid)]
        time.sleep(0.1)
    assert alive == []


def test_a_daemonic_worker_is_refused_with_the_setting_to_change() -> None:
    """On a nanny's default daemonic worker, registering fails and names the Dask setting."""
    with (
        dask.config.set({"distributed.worker.daemon": True}),
        distributed.LocalCluster(
            processes=True,
            n_workers=1,
            threads_per_worker=1,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as local,
        distributed.Client(local) as client,
        pytest.raises(gpupool.ConfigurationError, match=r"distributed\.worker\.daemon"),
    ):
        gd.register(client, task_peak="1GiB")


def test_plugin_arguments_are_checked_on_the_client() -> None:
    """An unknown pool keyword or a reserved executor name fails before anything is sent."""
    with pytest.raises(gpupool.ConfigurationError, match="task_peek"):
        gd.GpuPoolPlugin(task_peek="6GiB")
    with pytest.raises(gpupool.ConfigurationError, match="default"):
        gd.GpuPoolPlugin("default")


def test_import_gpupool_does_not_import_distributed() -> None:
    """``import gpupool`` in a fresh interpreter loads neither distributed nor dask."""
    script = "import sys, gpupool; print(sorted({'distributed', 'dask'} & set(sys.modules)))"
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert completed.stdout.strip() == "[]"
