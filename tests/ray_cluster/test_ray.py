"""gpupool.ray on a real local Ray cluster: two GPU nodes, each with its own simulated card.

The cluster (``ray.cluster_utils.Cluster``) is one head without GPUs and two
nodes with one GPU each; every node's actor enters its own simulated host
(different totals and co-tenants), chosen by a custom resource of the node.
Each test builds its own executor on the shared cluster (an executor holds
every GPU of its nodes) and shuts it down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="gpupool.ray needs the 'ray' extra (ray)")

from ray.cluster_utils import Cluster  # noqa: E402

import gpupool  # noqa: E402
import gpupool.ray as gr  # noqa: E402
import gpupool.testing as gt  # noqa: E402
from gpupool import ConfigurationError  # noqa: E402
from gpupool._core.units import GiB, MiB  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

#: Each GPU node's simulated card, by the custom resource that marks the node.
CARDS = {
    "gpupool-card-a": ("8GiB", {"server": "1GiB"}),
    "gpupool-card-b": ("24GiB", {"trainer": "6GiB"}),
    "gpupool-card-c": ("16GiB", {}),
}

#: Bound every wait, so a broken test fails instead of hanging.
TIMEOUT_S = 90

#: What each node's Ray processes may keep in the object store: the least Ray accepts.
OBJECT_STORE_BYTES = 80 * MiB


def _simulated_host(node: gr.RayNode) -> gt.SimulatedHost | None:
    """The node's simulated card, built in its actor's process; tasks learn their node."""
    for resource, (total, co_tenants) in CARDS.items():
        if resource in node.resources:
            # The pool's workers start from the actor's environment: tasks can say where they ran.
            os.environ["GPUPOOL_TEST_NODE"] = resource
            return gt.SimulatedHost([gt.SimulatedDevice(total, co_tenants=co_tenants)], cpus=2)
    return None


def _hold(i: int, size: str = "2GiB", seconds: float = 0.1) -> tuple[int, str | None]:
    """Hold ``size`` of the node's card briefly; return a checkable value and the node."""
    with gt.hold(size):
        time.sleep(seconds)
    return i * i, os.environ.get("GPUPOOL_TEST_NODE")


def _gated(i: int, gate: str, size: str = "1GiB") -> tuple[int, str | None]:
    """Say it started (and where), then hold ``size`` until the gate opens for its node
    (an ``open-<node>`` file) or the process that started it is gone (its node was lost)."""
    node = os.environ.get("GPUPOOL_TEST_NODE")
    parent = os.getppid()
    Path(gate, f"started-{i}-{node}").touch()
    deadline = time.monotonic() + TIMEOUT_S
    with gt.hold(size):
        while not Path(gate, f"open-{node}").exists() and time.monotonic() < deadline:
            if os.getppid() != parent:
                break
            time.sleep(0.02)
    return i, node


def _open(gate: Path, *cards: str) -> None:
    for card in cards:
        (gate / f"open-{card}").touch()


def _together(i: int, gate: str, together: int, size: str) -> int:
    """Wait (bounded) until ``together`` tasks have started, then hold ``size`` at once."""
    Path(gate, f"started-{i}").touch()
    deadline = time.monotonic() + TIMEOUT_S
    while len(list(Path(gate).glob("started-*"))) < together and time.monotonic() < deadline:
        time.sleep(0.01)
    with gt.hold(size):
        time.sleep(0.3)
    return i


def _fail(message: str) -> None:
    raise ValueError(message)


def _empty(i: int) -> int:
    return i


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head without GPUs and two GPU nodes (cards a and b), kept tiny for a 2-core machine.

    Ray's workers, and the pools' workers they start, import this module to run its
    functions: the nodes start with its folder on ``PYTHONPATH``.
    """
    before = os.environ.get("PYTHONPATH")
    here = str(Path(__file__).parent)
    # Nodes added later (the lost-node test's) start with it too: restored at the end.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, before) if p)
    local = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
            # A killed node is declared dead in about a second, not Ray's default 15 s or so.
            "_system_config": {
                "health_check_initial_delay_ms": 0,
                "health_check_period_ms": 300,
                "health_check_failure_threshold": 3,
            },
        },
    )
    try:
        for resource in ("gpupool-card-a", "gpupool-card-b"):
            local.add_node(
                num_cpus=1,
                num_gpus=1,
                resources={resource: 1},
                object_store_memory=OBJECT_STORE_BYTES,
            )
        ray.init(address=local.address, log_to_driver=False)
        yield local
    finally:
        ray.shutdown()
        local.shutdown()
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _by_card(ex: gr.RayGpuExecutor) -> dict[str, dict[str, Any]]:
    """Each node's report, by its card's resource name."""
    names = {n.name: next(r for r in CARDS if r in n.resources) for n in ex.nodes}
    return {names[name]: report for name, report in ex.reports().items()}


def _executor(**kwargs: Any) -> gr.RayGpuExecutor:
    kwargs.setdefault("simulate", _simulated_host)
    kwargs.setdefault("start_timeout_s", TIMEOUT_S)
    return gr.RayGpuExecutor(**kwargs)


def test_tasks_pack_each_node_by_its_own_card_and_the_account_names_the_nodes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Tasks run on both nodes within each card's bound, with no out-of-memory; the run's
    account holds both nodes' logs, and postmortem and plot name the node of each run."""
    account = tmp_path / "account.jsonl"
    with _executor(max_workers=4, task_peak="3GiB", log_path=account) as ex:
        assert len(ex.nodes) == 2
        # The pools hold every GPU of their nodes: Ray places no fraction beside them.
        assert ray.available_resources().get("GPU", 0) == 0
        results = list(ex.map(_hold, range(16)))
        assert [r for r, _ in results] == [i * i for i in range(16)]
        reports = _by_card(ex)
    assert {node for _, node in results} == {"gpupool-card-a", "gpupool-card-b"}
    for card, report in reports.items():
        total = gpupool.parse_size(CARDS[card][0])
        assert report["census"]["cards"][0]["total_bytes"] == total
        assert report["simulated"]["out_of_memory_events"] == []
        assert report["simulated"]["devices"][0]["peak_bytes"] <= total
        assert report["statistics"]["out_of_memory"] == 0
        widths = [d["width_after"] for d in report["decisions"] if d.get("width_after")]
        # Card a: 8 GiB - 1 GiB co-tenant - 256 MiB reserve holds two 3 GiB asks, b four.
        assert max(widths) <= (2 if card == "gpupool-card-a" else 4)
    assert sum(r["statistics"]["tasks_completed"] for r in reports.values()) == 16

    records = [json.loads(line) for line in account.read_text().splitlines()]
    names = {n.name for n in ex.nodes}
    assert {r["node"] for r in records} == names
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-m", "gpupool", "postmortem", str(account), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        check=True,
    )
    runs = json.loads(out.stdout)["runs"]
    assert {run["node"] for run in runs} == names
    pytest.importorskip("matplotlib", reason="gpupool plot needs the 'plot' extra")
    from gpupool._observe.plot import card_views
    from gpupool._observe.postmortem import read_runs

    titles = [view.title for column in card_views(read_runs(account)) for view in column]
    assert all(any(name in title for title in titles) for name in names)


def test_results_and_exceptions_reach_their_futures(cluster: Cluster) -> None:
    """A result comes back through the object store; an exception keeps its type."""
    with _executor(max_workers=2, task_peak="1GiB") as ex:
        big = ex.submit(bytes, 4 * MiB)
        error = ex.submit(_fail, "no such entry")
        keyed = ex.options(key="keyed", task_peak="2GiB", label="ckpt-3").submit(_hold, 3, "1GiB")
        assert big.result(timeout=TIMEOUT_S) == bytes(4 * MiB)
        with pytest.raises(ValueError, match="no such entry"):
            error.result(timeout=TIMEOUT_S)
        assert keyed.result(timeout=TIMEOUT_S)[0] == 9
        # An argument that does not pickle fails its own task, at once; the next one runs.
        unpicklable = ex.submit(_hold, threading.Lock())
        with pytest.raises(TypeError):
            unpicklable.result(timeout=TIMEOUT_S)
        assert ex.submit(_hold, 2, "1GiB").result(timeout=TIMEOUT_S)[0] == 4
        # Many short tasks: outcomes land while the router is sending others.
        assert list(ex.map(_empty, range(300), timeout=TIMEOUT_S)) == list(range(300))
        # Larger than every card: it still runs, alone, on the node with the largest card.
        huge = ex.options(key="huge", task_peak="40GiB").submit(_hold, 5, "1GiB")
        assert huge.result(timeout=TIMEOUT_S) == (25, "gpupool-card-b")
        reports = ex.reports().values()
        asks = {k for r in reports for k in r["statistics"]["asks"]}
        labels = {d.get("task_label") for r in reports for d in r["decisions"]}
    assert "keyed" in asks
    assert "ckpt-3" in labels
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(_hold, 1)


def test_a_key_measured_on_one_node_is_priced_by_it_on_the_other(cluster: Cluster) -> None:
    """The first task of a key measures 5 GiB on one node; the other node, which has not run
    the key, prices it at that ask (not the 1 GiB hint), and neither runs out of memory."""
    with _executor(max_workers=4) as ex:
        learned = ex.options(key="learned", task_peak="1GiB")
        first = learned.submit(_hold, 0, "5GiB")
        assert first.result(timeout=TIMEOUT_S)[0] == 0
        measured_on = first.result()[1]
        ask = _by_card(ex)[measured_on]["statistics"]["asks"]["learned"]
        assert ask["basis"] == "measured"
        results = list(learned.map(_hold, range(1, 7), ["5GiB"] * 6))
        assert [r for r, _ in results] == [i * i for i in range(1, 7)]
        reports = _by_card(ex)
    other = next(card for card in reports if card != measured_on)
    assert other in {node for _, node in results}
    other_ask = reports[other]["statistics"]["asks"]["learned"]
    # The other node's estimate is the ask learned on the first (a hint never lowers it).
    assert other_ask["estimate_bytes"] >= ask["ask_bytes"] > 5 * GiB
    for report in reports.values():
        assert report["simulated"]["out_of_memory_events"] == []


def test_an_out_of_memory_on_a_node_is_retried_there(cluster: Cluster, tmp_path: Path) -> None:
    """Four tasks priced at 1 GiB start together on card b and hold 5 GiB each (20 GiB on
    17.75 GiB of room): the pool there retries the one that ran out; every result arrives."""
    with _executor(max_workers=4) as ex:
        view = ex.options(key="underestimated", task_peak="1GiB")
        futures = [view.submit(_together, i, str(tmp_path), 4, "5GiB") for i in range(4)]
        assert [f.result(timeout=TIMEOUT_S) for f in futures] == [0, 1, 2, 3]
        reports = _by_card(ex)
    stats = reports["gpupool-card-b"]["statistics"]
    assert stats["out_of_memory"] >= 1
    assert stats["retries"] >= 1
    assert reports["gpupool-card-b"]["simulated"]["out_of_memory_events"]
    assert any(d["event"] == "out_of_memory" for d in reports["gpupool-card-b"]["decisions"])


def test_cancelling_a_task_the_cluster_has_no_room_for_cancels_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With both nodes full, a queued task is cancelled before it starts; a running one is not."""
    with _executor(max_workers=1, task_peak="1GiB") as ex:
        running = [ex.submit(_gated, i, str(tmp_path)) for i in range(2)]
        waiting = ex.submit(_gated, 9, str(tmp_path))
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(list(tmp_path.glob("started-*"))) == 2
            assert waiting.cancel()
            assert waiting.cancelled()
            assert not running[0].cancel()
        finally:  # a failed check must not leave the tasks waiting at the gate
            _open(tmp_path, "gpupool-card-a", "gpupool-card-b")
        assert sorted(f.result(timeout=TIMEOUT_S)[0] for f in running) == [0, 1]
    assert not list(tmp_path.glob("started-9-*"))


def test_cancelling_a_task_its_node_holds_back_cancels_it_in_the_pool(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A task the router sent (priced at 1 GiB) that the node's pool holds back, because the
    running task holds 6 GiB of card a, is cancelled in the pool: it never runs."""
    with _executor(
        max_workers=2, task_peak="1GiB", nodes=lambda n: "gpupool-card-a" in n.resources
    ) as ex:
        assert [n.resources.get("gpupool-card-a") for n in ex.nodes] == [1.0]
        running = ex.submit(_gated, 0, str(tmp_path), "6GiB")
        deadline = time.monotonic() + TIMEOUT_S
        while not list(tmp_path.glob("started-0-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        held = ex.submit(_gated, 1, str(tmp_path))
        stats: dict[str, Any] = {}
        try:
            while time.monotonic() < deadline:
                stats = next(iter(ex.reports().values()))["statistics"]
                if stats["tasks_submitted"] == 2:
                    break
                time.sleep(0.05)
            assert stats["tasks_submitted"] == 2  # it reached the node's pool
            assert held.cancel()
            assert held.cancelled()
        finally:  # a failed check must not leave the tasks waiting at the gate
            _open(tmp_path, "gpupool-card-a")
        assert running.result(timeout=TIMEOUT_S)[0] == 0
        stats = next(iter(ex.reports().values()))["statistics"]
    assert stats["tasks_cancelled"] == 1
    assert not list(tmp_path.glob("started-1-*"))


# Two executors, each of which may wait out a killed node's close (Ray notices a dead node
# within its own heartbeat timeout; a node's close is waited for up to
# DEFAULT_SHUTDOWN_TIMEOUT_S + 60 s): under a CPU hog on each core the module's 180 s guard
# against a hang was reached once in four whole-suite runs, waiting in a node's close.
@pytest.mark.timeout(420)
def test_a_node_killed_mid_run_fails_or_retries_only_its_tasks(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A third node (card c) is killed while it runs tasks. With retry_lost=1 its tasks run
    again on the nodes left; with the default (0) they fail with NodeLostError naming it.
    Either way every other future gets its result, and later tasks run on the nodes left."""
    for retry_lost in (1, 0):
        gate = tmp_path / f"retry-{retry_lost}"
        gate.mkdir()
        node_c = cluster.add_node(
            num_cpus=1,
            num_gpus=1,
            resources={"gpupool-card-c": 1},
            object_store_memory=OBJECT_STORE_BYTES,
        )
        with _executor(max_workers=2, task_peak="1GiB", retry_lost=retry_lost) as ex:
            assert len(ex.nodes) == 3
            futures = [ex.submit(_gated, i, str(gate)) for i in range(6)]
            deadline = time.monotonic() + TIMEOUT_S
            while len(list(gate.glob("started-*"))) < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            on_c = {int(p.name.split("-")[1]) for p in gate.glob("started-*-gpupool-card-c")}
            assert on_c, "the router sent nothing to node c"
            # Node c's tasks never see their gate open: they end only with their node.
            cluster.remove_node(node_c, allow_graceful=False)
            _open(gate, "gpupool-card-a", "gpupool-card-b")
            errors = [f.exception(timeout=TIMEOUT_S) for f in futures]
            later = ex.submit(_hold, 7, "1GiB").result(timeout=TIMEOUT_S)
        assert later[0] == 49
        assert later[1] != "gpupool-card-c"
        # Ray marks the node dead once its heartbeats stop: only then is it gone for the next.
        while time.monotonic() < deadline and any(
            n["Alive"] and "gpupool-card-c" in n["Resources"] for n in ray.nodes()
        ):
            time.sleep(0.2)
        for i, (future, error) in enumerate(zip(futures, errors, strict=True)):
            if i in on_c and retry_lost == 0:
                assert isinstance(error, gr.NodeLostError)
                assert isinstance(error, gpupool.WorkerLostError)
                assert error.node in str(error)
                assert error.node in {n.name for n in ex.nodes if "gpupool-card-c" in n.resources}
            else:
                assert error is None
                assert future.result()[0] == i
            if i in on_c and retry_lost == 1:
                # It started on c, then again on a node left.
                assert len(list(gate.glob(f"started-{i}-*"))) == 2


def test_a_cluster_without_a_gpu_node_is_refused_at_once(cluster: Cluster) -> None:
    """No GPU node among those chosen: a clear error naming the nodes, not a hang."""
    head = next(n for n in ray.nodes() if n["Alive"] and not n["Resources"].get("GPU"))
    with pytest.raises(ConfigurationError, match="no node with a whole GPU") as caught:
        gr.RayGpuExecutor(nodes=[head["NodeID"]])
    assert head["NodeID"][:8] in str(caught.value)
    assert "ray start --num-gpus" in str(caught.value)


def test_bad_arguments_are_refused_before_any_actor_starts(cluster: Cluster) -> None:
    """Keywords the executor owns, or that are not the pool's, are refused with their names."""
    with pytest.raises(ConfigurationError, match="num_gpus"):
        gr.RayGpuExecutor(actor_options={"num_gpus": 0.25})
    with pytest.raises(ConfigurationError, match="task_peek"):
        gr.RayGpuExecutor(task_peek="6GiB")
    with pytest.raises(ConfigurationError, match="log_path is the run's account"):
        gr.RayGpuExecutor(progress=True)
    with pytest.raises(ConfigurationError, match="retry_lost"):
        gr.RayGpuExecutor(retry_lost=-1)
