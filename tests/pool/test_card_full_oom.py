"""A task that fails without a word (a subprocess's exit status 1) while its card was full and its
tree grew is an out-of-memory all the same, retried as one; on a card with room it is an ordinary
failure. Real spawned processes on simulated cards."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import full_card_tasks
import standin_torch
from gpupool import GpuPoolExecutor
from gpupool._child.probe import Probe
from gpupool._core.units import GiB, MiB
from gpupool._sensors.base import DeviceInfo
from gpupool.testing import SimulatedDevice, SimulatedHost


@pytest.mark.slow
def test_a_subprocess_that_exits_1_after_a_refused_allocation_is_retried(tmp_path):
    """Two tasks priced at 1 GiB whose children each hold 3.5 GiB, together on a 6 GiB card: the
    refused child exits 1 silently; its task is classified out-of-memory from the card's
    refusal (``card-full``), retried, and succeeds once the card has room."""
    gate = tmp_path / "gate"
    gate.mkdir()
    with SimulatedHost([SimulatedDevice("6GiB")], cpus=4, host_ram="64GiB") as host:
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB", reserve=0) as ex:
            futures = [
                ex.submit(full_card_tasks.silent_pair, i, "3.5GiB", str(gate)) for i in range(2)
            ]
            assert sorted(f.result(timeout=120) for f in futures) == [0, 1]
            stats = ex.statistics()
            decisions = [d.to_dict() for d in ex.decisions]
        refused = [e for e in host.out_of_memory_events if not e.co_tenant]
    assert refused and refused[0].requested_bytes == int(3.5 * GiB)
    assert stats.retries >= 1
    ooms = [d for d in decisions if d["event"] == "out_of_memory"]
    assert ooms and all(d["oom_recognised"] == "card-full" for d in ooms)
    assert "refused an allocation of 3.50 GiB" in ooms[0]["card_full_reason"]
    assert ooms[0]["requested_bytes"] == int(3.5 * GiB)


@pytest.mark.slow
def test_a_subprocess_that_exits_1_on_a_card_with_room_is_not_retried():
    """The same silent exit 1 after holding 1 GiB on a 16 GiB card that never came near full is
    an ordinary failure: the CalledProcessError reaches the future, with no retry."""
    with SimulatedHost([SimulatedDevice("16GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB", reserve=0) as ex:
            future = ex.submit(full_card_tasks.silent_failure, "1GiB")
            with pytest.raises(subprocess.CalledProcessError):
                future.result(timeout=60)
            stats = ex.statistics()
            events = [d.event for d in ex.decisions]
    assert stats.retries == 0
    assert "out_of_memory" not in events


@pytest.mark.slow
def test_a_task_taken_for_card_full_that_fails_alone_gets_its_own_error():
    """A child that asks for more than the 4 GiB card (5 GiB) is refused and exits 1 silently:
    the task is taken for an out-of-memory (card-full), fails alone on the card, and its own
    CalledProcessError reaches the future (not a DeviceOutOfMemoryError)."""
    with SimulatedHost([SimulatedDevice("4GiB")], cpus=2, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="1GiB", reserve=0) as ex:
            future = ex.submit(full_card_tasks.silent_failure, "5GiB")
            with pytest.raises(subprocess.CalledProcessError):
                future.result(timeout=60)
            ooms = [d.to_dict() for d in ex.decisions if d.event == "out_of_memory"]
    assert ooms and ooms[-1]["oom_recognised"] == "card-full"
    assert ooms[-1]["retry"] is False


# -- the probe's reading of a full card (rows hidden: sampled, as on a real card) -----------

_HOLDER = """
import sys
import time
import gpupool.testing as gt
with gt.hold(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _fail_while_a_child_holds(size: str, *, co_tenant: str | None = None):
    """A probe window on an 8 GiB card whose rows are hidden (a container): a child of this
    process holds ``size`` (or, with ``co_tenant``, a co-tenant grows by that and no child
    runs) and the task fails with a CalledProcessError; the report."""
    with SimulatedHost([SimulatedDevice("8GiB")], context="300MiB", container=True) as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        probe = Probe(host.sensor(), info, 0, os.getpid())
        probe.start()
        failure = subprocess.CalledProcessError(1, ["child"])
        if co_tenant is not None:
            host.grow("other", co_tenant)
            return probe.stop(failure=failure)
        with subprocess.Popen(
            [sys.executable, "-c", _HOLDER, size],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdout is not None and child.stdout.readline().strip() == "held"
            report = probe.stop(failure=failure)
            assert child.stdin is not None
            child.stdin.close()
        return report


def test_free_bytes_read_below_the_threshold_while_the_tree_grew_is_an_out_of_memory():
    """A child holding 7.5 GiB of an 8 GiB card (0.2 GiB free, below 512 MiB) as the task fails:
    the failure is an out-of-memory, recognised as ``card-full``, and the reason gives the
    reading."""
    report = _fail_while_a_child_holds("7.5GiB")
    assert report.oom is True
    assert report.oom_recognised == "card-full"
    assert report.card_full_reason is not None
    assert "free bytes were read at 212.00 MiB of 8.00 GiB" in report.card_full_reason


@pytest.mark.parametrize(
    ("size", "co_tenant"), [("2GiB", None), (None, "7.5GiB")], ids=["room", "co-tenant"]
)
def test_a_card_with_room_or_filled_by_another_is_no_out_of_memory(size, co_tenant):
    """A child holding 2 GiB of 8 GiB leaves the card with room; a co-tenant that fills the
    card while the task's tree did not grow is not the task's doing: neither failure is an
    out-of-memory."""
    report = _fail_while_a_child_holds(size, co_tenant=co_tenant)
    assert report.oom is False
    assert report.oom_recognised is None and report.card_full_reason is None


def test_the_simulator_tells_a_refusal_to_a_process_of_the_tree_and_to_no_other_tree():
    """A child asking for more than the 8 GiB card has (9 GiB) is refused; the sensor tells the
    refusal to its parent's tree (by the ancestors the ledger noted as it refused), after the
    child exited, and not to a tree it is not in, nor to a window opened after it."""
    code = (
        "import gpupool.testing as gt\n"
        "try:\n"
        "    with gt.hold('9GiB'):\n"
        "        pass\n"
        "except gt.SimulatedOutOfMemory:\n"
        "    pass\n"
    )
    with SimulatedHost([SimulatedDevice("8GiB")], context="300MiB") as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        sensor = host.sensor()
        since = time.time()
        subprocess.run([sys.executable, "-c", code], check=True)
        refused_to_us = sensor.read_refused_bytes(info, os.getpid(), since)
        stranger = sensor.read_refused_bytes(info, 2**22 - 1, since)  # no process's ancestor
        refused_later = sensor.read_refused_bytes(info, os.getpid(), time.time() + 1)
    assert refused_to_us == 9 * GiB
    assert stranger == 0
    assert [e.requested_bytes for e in host.out_of_memory_events] == [9 * GiB]
    assert refused_later == 0


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["hidden", "listed"])
def test_an_error_of_the_workers_own_code_on_a_card_a_co_tenant_filled_is_no_out_of_memory(rows):
    """A co-tenant holds 15.3 GiB of a 16 GiB card (with the worker's 300 MiB context, free
    bytes below 512 MiB from the start); a
    task allocates 128 MiB through the worker's own torch (it succeeds: a refusal would raise
    torch's own out-of-memory error), then raises a ValueError, starting no process. That is
    no out-of-memory: the ValueError reaches the future, with no ``out_of_memory`` record and
    no retry."""
    kwargs = {"container": True} if rows == "hidden" else {}
    device = SimulatedDevice("16GiB")
    with SimulatedHost([device], context="300MiB", cpus=2, host_ram="64GiB", **kwargs) as host:
        host.grow("other", "15.3GiB")
        with GpuPoolExecutor(
            max_workers=1,
            task_peak="256MiB",
            reserve=0,
            initializer=standin_torch.install_in_worker,
            initargs=(16 * GiB, True),
        ) as ex:
            future = ex.submit(full_card_tasks.torch_then_error, 128 * MiB)
            with pytest.raises(ValueError, match="row 7"):
                future.result(timeout=60)
            stats = ex.statistics()
            ooms = [d.to_dict() for d in ex.decisions if d.event == "out_of_memory"]
    assert ooms == []
    assert stats.retries == 0


_IDLE_CHILD = """
import sys
print("running", flush=True)
sys.stdin.read()
"""


def test_with_rows_hidden_a_co_tenant_growing_beside_a_child_is_taken_for_the_trees_growth():
    """The limit of the free-bytes signal where rows are hidden: a child that holds no device
    memory runs while a co-tenant fills the 8 GiB card (7.6 GiB) and the task fails. Nothing
    tells the co-tenant's rise in the card's used bytes from the child's, so the failure is
    taken for ``card-full`` (as docs/readings.md says); with no child it is not (above)."""
    with SimulatedHost([SimulatedDevice("8GiB")], context="300MiB", container=True) as host:
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        probe = Probe(host.sensor(), info, 0, os.getpid())
        probe.start()
        with subprocess.Popen(
            [sys.executable, "-c", _IDLE_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdout is not None and child.stdout.readline().strip() == "running"
            host.grow("other", "7.6GiB")
            report = probe.stop(failure=subprocess.CalledProcessError(1, ["child"]))
            assert child.stdin is not None
            child.stdin.close()
    assert report.descendants >= 1
    assert report.oom is True and report.oom_recognised == "card-full"
