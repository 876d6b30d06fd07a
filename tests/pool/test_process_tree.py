"""A task's peak is its whole process tree's: real spawned processes on a simulated card."""

from __future__ import annotations

import os
import signal
import time

import pytest
import tree_tasks

from gpupool import GpuPoolExecutor
from gpupool._core.units import GiB, MiB
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = pytest.mark.slow


def _measured(decisions: list, key: str) -> list[dict]:
    return [d.to_dict() for d in decisions if d.key == key and "peak_bytes" in d.to_dict()]


def test_bytes_held_in_a_subprocess_are_the_tasks_peak():
    """A task whose 8 GiB live in a subprocess is measured at 8 GiB and its ask does not fall."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB", context="300MiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="9GiB", reserve=0) as ex:
            assert ex.submit(tree_tasks.in_a_subprocess, "8GiB").result(timeout=60) == 0
            stats = ex.statistics()
            decisions = list(ex.decisions)
    ask = stats.asks["tree_tasks.in_a_subprocess"]
    assert ask.measured_peak_bytes == 8 * GiB + 300 * MiB
    assert ask.ask_bytes >= 8 * GiB + 300 * MiB
    measured = _measured(decisions, "tree_tasks.in_a_subprocess")
    assert measured and measured[0]["peak_bytes"] == 8 * GiB + 300 * MiB
    assert measured[0]["outliving_descendants"] == 0


def test_host_memory_of_a_subprocess_is_the_tasks_rss():
    """A task whose child fills 256 MiB of host RAM reports its own RSS plus the child's."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB", context="300MiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB", reserve=0) as ex:
            own_bytes = ex.submit(tree_tasks.rss_in_a_subprocess, 256).result(timeout=60)
            decisions = list(ex.decisions)
    measured = _measured(decisions, "tree_tasks.rss_in_a_subprocess")
    assert measured, [d.to_dict() for d in decisions]
    assert measured[0]["rss_peak_bytes"] >= own_bytes + 256 * MiB
    assert measured[0]["rss_source"] == "vmhwm+descendants"


def test_a_descendant_left_running_is_reported_with_its_bytes():
    """A subprocess that outlives its task is counted in the peak and named in the record."""
    child = None
    try:
        with SimulatedHost(
            [SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB", context="300MiB"
        ) as host:
            with GpuPoolExecutor(max_workers=1, task_peak="4GiB", reserve=0) as ex:
                child = ex.submit(tree_tasks.leave_a_subprocess, "2GiB").result(timeout=60)
                decisions = list(ex.decisions)
                assert host.process_peak(child) == 2 * GiB + 300 * MiB
                os.kill(child, signal.SIGKILL)
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    measured = _measured(decisions, "tree_tasks.leave_a_subprocess")
    assert measured, [d.to_dict() for d in decisions]
    assert measured[0]["peak_bytes"] == 2 * GiB + 300 * MiB
    assert measured[0]["outliving_descendants"] == 1
    assert measured[0]["descendants"] >= 1
    assert measured[0]["outliving_device_bytes"] == 2 * GiB + 300 * MiB


def test_processes_a_task_spawns_are_its_peak():
    """Two processes a task starts with the ``spawn`` start method (as torch's
    ``multiprocessing.spawn`` does) run, and the 2 GiB each holds at once are the task's peak."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB", context="300MiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="9GiB", reserve=0) as ex:
            codes = ex.submit(tree_tasks.in_spawned_processes, "2GiB", 2).result(timeout=120)
            decisions = list(ex.decisions)
    assert codes == [0, 0]
    measured = _measured(decisions, "tree_tasks.in_spawned_processes")
    assert measured and measured[0]["peak_bytes"] == 2 * (2 * GiB + 300 * MiB)


def test_a_double_forked_daemon_stays_in_the_tree():
    """A task whose 3 GiB live in a double-forked daemon (orphaned before it allocates) is
    measured with them: the worker is a child subreaper, so the daemon stays under it."""
    with SimulatedHost([SimulatedDevice("40GiB")], cpus=4, host_ram="64GiB", context="300MiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="4GiB", reserve=0) as ex:
            for _ in range(2):  # the second task: the first's daemon was reaped, not counted
                assert ex.submit(tree_tasks.in_a_double_forked_daemon, "3GiB").result(60) == 0
            decisions = list(ex.decisions)
    measured = _measured(decisions, "tree_tasks.in_a_double_forked_daemon")
    assert measured, [d.to_dict() for d in decisions]
    assert measured[0]["peak_bytes"] == 3 * GiB + 300 * MiB
    assert measured[0]["descendants"] >= 1


def test_a_subprocess_that_runs_the_card_out_of_memory_is_retried(tmp_path):
    """Six tasks priced at 1 GiB whose children hold 4.5 GiB, three at once on a 12 GiB card:
    a child the card refused fails the task with a CalledProcessError whose stderr says so;
    it is classified as out-of-memory from that output and retried, and no task is lost."""
    gate = tmp_path / "gate"
    gate.mkdir()
    with SimulatedHost([SimulatedDevice("12GiB")], cpus=4, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=3, task_peak="1GiB") as ex:
            futures = [
                ex.submit(tree_tasks.in_a_subprocess_together, i, "4.5GiB", str(gate))
                for i in range(6)
            ]
            assert sorted(f.result(timeout=120) for f in futures) == list(range(6))
            stats = ex.statistics()
            decisions = [d.to_dict() for d in ex.decisions]
        refused = host.out_of_memory_events
    assert refused, "three children of 4.5 GiB at once on a 12 GiB card: one was refused"
    assert stats.retries >= 1
    ooms = [d for d in decisions if d["event"] == "out_of_memory"]
    assert ooms and all(d["oom_recognised"] == "subprocess-output" for d in ooms)


def _until_none_run(pid: int) -> list[str]:
    """The states of ``pid``'s children once none of them runs any more (at most 60 s)."""
    deadline = time.monotonic() + 60
    states = tree_tasks.children_states(pid)
    while any(state != "Z" for state in states) and time.monotonic() < deadline:
        time.sleep(0.01)
        states = tree_tasks.children_states(pid)
    return states


def test_orphans_adopted_by_the_worker_are_reaped_not_left_as_zombies():
    """A task whose 12 shells each leave a background ``true`` behind (``sh -c "true & exit
    0"``): the orphans are adopted by the worker, a child subreaper, and exit. Once the next
    task has run, none is left a zombie of the worker."""
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB", container=True):
        with GpuPoolExecutor(max_workers=1, task_peak="256MiB", reserve=0) as ex:
            worker = ex.submit(tree_tasks.orphan_shells, 12).result(timeout=60)
            _until_none_run(worker)
            assert ex.submit(tree_tasks.nothing).result(timeout=60) == 0
            states = tree_tasks.children_states(worker)
    assert states == []


def test_a_child_a_task_keeps_for_a_later_task_keeps_its_exit_status():
    """A task starts a child that exits with status 3 and keeps its ``Popen`` unwaited; once the
    child has exited and another task has run, a later task's ``wait`` still reads 3 (the
    worker reaps only children nothing in it waits for)."""
    with SimulatedHost([SimulatedDevice("8GiB")], cpus=2, host_ram="64GiB", container=True):
        with GpuPoolExecutor(max_workers=1, task_peak="256MiB", reserve=0) as ex:
            assert ex.submit(tree_tasks.start_and_keep, 3).result(timeout=60) > 0
            worker = ex.submit(os.getpid).result(timeout=60)
            _until_none_run(worker)
            assert ex.submit(tree_tasks.nothing).result(timeout=60) == 0
            assert ex.submit(tree_tasks.wait_kept).result(timeout=60) == 3
