"""Reading the simulated host's ledger: parsed once per content, never stale about the dead."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpupool._core.units import GiB, MiB
from gpupool._sensors.base import DeviceInfo
from gpupool._sensors.booking_rows import read_start_token
from gpupool._sensors.simulated import Ledger
from gpupool.testing import SimulatedDevice, SimulatedHost

#: Hold argv[1] on the simulated card, say so, and keep it until stdin closes.
_HOLDER = (
    "import sys\nfrom gpupool.testing import hold\n"
    "with hold(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()\n"
)


@contextmanager
def _holder(size: str) -> Iterator[subprocess.Popen[str]]:
    """A child process that holds ``size`` on the simulated card until it is killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, size],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        yield child
    finally:
        child.kill()
        child.communicate()


def _kill_and_leave_unreaped(child: subprocess.Popen[str]) -> None:
    """Kill ``child`` and wait until it has exited, leaving it a zombie (not reaped)."""
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)


def test_an_unchanged_ledger_is_not_parsed_again_and_a_change_is_seen():
    """Two readings of an unchanged ledger share one parse; another process's change is read."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        ledger = Ledger(host.ledger_path)
        try:
            first = ledger.view()
            assert ledger.view() is first
            with _holder("2GiB") as child:
                held = ledger.view()
                assert held is not first
                assert held["devices"][0]["procs"][str(child.pid)]["held"] == 2 * GiB
        finally:
            ledger.close()


def test_a_snapshot_is_a_copy_of_the_shared_reading():
    """Changing a snapshot changes neither the ledger nor what the next reader sees."""
    with SimulatedHost([SimulatedDevice("16GiB")]) as host:
        ledger = Ledger(host.ledger_path)
        try:
            copy = ledger.snapshot()
            copy["devices"][0]["total"] = 1
            assert ledger.view()["devices"][0]["total"] == 16 * GiB
            assert ledger.snapshot()["devices"][0]["total"] == 16 * GiB
        finally:
            ledger.close()


def test_a_process_that_exits_between_two_readings_of_an_unchanged_ledger_holds_nothing():
    """The file did not change, but its holder exited (a zombie, unreaped): the next reading of
    the card frees its bytes and its tree window, as a driver frees a dead process's memory."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        sensor = host.sensor()
        info = DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")
        with _holder("2GiB") as child:
            assert sensor.start_tree_window(info, child.pid) == 2 * GiB + 300 * MiB
            memory, rows = sensor.read_snapshot(info)
            assert memory.used_bytes == 2 * GiB + 300 * MiB
            assert rows is not None and [row.pid for row in rows] == [child.pid]
            _kill_and_leave_unreaped(child)
            memory, rows = sensor.read_snapshot(info)
            assert memory.used_bytes == 0 and rows == ()
            assert sensor.read_tree_peak_bytes(info, child.pid) is None
        assert host.process_peak(child.pid) == 2 * GiB + 300 * MiB


def _pidfds() -> list[int]:
    """This process's open pidfds."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if "pidfd" in os.readlink(f"/proc/self/fd/{name}"):
                found.append(int(name))
        except OSError:
            continue  # the descriptor listdir read the directory through
    return found


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds on this system")
def test_a_pidfd_closed_behind_the_ledgers_back_is_never_closed_again_by_number():
    """A task closes every descriptor (``os.closerange``) and files take the numbers the
    ledger's pidfds had: the next readings leave those files open and still see the death."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        ledger = Ledger(host.ledger_path)
        placed: list[int] = []
        try:
            with _holder("2GiB") as child:
                assert ledger.view()["devices"][0]["procs"][str(child.pid)]["held"] == 2 * GiB
                placed = _pidfds()
                assert placed, "the ledger watches its holder through a pidfd"
                null = os.open(os.devnull, os.O_RDONLY)
                try:
                    for fd in placed:
                        os.close(fd)
                        os.dup2(null, fd)  # another file on the pidfd's number
                finally:
                    os.close(null)
                ledger.view()
                ledger.view()
                for fd in placed:
                    assert os.path.samestat(os.fstat(fd), os.stat(os.devnull)), fd
                _kill_and_leave_unreaped(child)
                assert str(child.pid) not in ledger.view()["devices"][0]["procs"]
        finally:
            for fd in placed:
                with contextlib.suppress(OSError):
                    os.close(fd)
            ledger.close()


def _descriptors_of(path: str) -> list[int]:
    """This process's descriptors open on ``path``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == path:
                found.append(int(name))
        except OSError:
            continue  # the descriptor listdir read the directory through
    return found


def test_a_ledger_descriptor_closed_behind_its_back_is_reopened_and_never_closed_by_number():
    """A task closes every descriptor and a file takes the ledger's number: the ledger is
    read and changed through a descriptor of its own, and closing it leaves that file open."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        ledger = Ledger(host.ledger_path)
        placed: list[int] = []
        try:
            ledger.view()
            placed = _descriptors_of(os.path.realpath(host.ledger_path))
            assert len(placed) == 1
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                os.close(placed[0])
                os.dup2(null, placed[0])  # another file on the ledger's number
            finally:
                os.close(null)
            assert ledger.allocate(0, os.getpid(), GiB) is None
            assert ledger.view()["devices"][0]["procs"][str(os.getpid())]["held"] == GiB
            ledger.release(0, os.getpid(), GiB)
            ledger.close()
            assert os.path.samestat(os.fstat(placed[0]), os.stat(os.devnull))
        finally:
            for fd in placed:
                with contextlib.suppress(OSError):
                    os.close(fd)
            ledger.close()


#: Read the ledger argv[1] with a limit of 64 descriptors; open files after; say how many it named.
_TIGHT_READER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from gpupool._sensors.simulated import Ledger
ledger = Ledger(sys.argv[1])
named = len(ledger.view()["devices"][0]["procs"])
named = len(ledger.view()["devices"][0]["procs"])
files = [open(sys.argv[1], "rb") for _ in range(16)]
print(named, flush=True)
"""


def test_a_ledger_naming_more_processes_than_descriptors_leaves_the_reader_room():
    """A ledger names 80 running processes; a process allowed 64 descriptors reads it twice
    and still opens 16 files: its pidfds never fill its descriptor table."""
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(80)]
    try:
        with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
            ledger = Ledger(host.ledger_path)
            try:
                ledger.allocate(0, os.getpid(), GiB)  # the ledger's own way of naming one
                with open(host.ledger_path, encoding="utf-8") as file:
                    state = json.load(file)
                own = state["devices"][0]["procs"][str(os.getpid())]
                for sleeper in sleepers:
                    token = read_start_token(sleeper.pid)
                    assert token is not None
                    state["devices"][0]["procs"][str(sleeper.pid)] = {**own, "start": token}
                with open(host.ledger_path, "w", encoding="utf-8") as file:
                    json.dump(state, file)
                done = subprocess.run(
                    [sys.executable, "-c", _TIGHT_READER, host.ledger_path],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert done.returncode == 0, done.stderr
                assert done.stdout.split() == ["81"]
            finally:
                ledger.close()
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
