"""Reading the simulated host's ledger: parsed once per content, never stale about the dead."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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
#: A safety net so that a broken run fails instead of hanging; never asserted on.
PATIENCE_S = 120.0


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


def _info(host: SimulatedHost) -> DeviceInfo:
    return DeviceInfo(index=0, uuid=host.device_uuid(0), name="sim")


def test_a_card_reading_is_made_once_per_ledger_content_and_again_when_it_changes():
    """Two readings of an unchanged card are one object (the memory and the rows read alone
    too); another process's hold, and its exit, each make a new reading with the new figures."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        sensor, info = host.sensor(), _info(host)
        first = sensor.read_snapshot(info)
        assert sensor.read_snapshot(info) is first
        assert first[0].used_bytes == 0 and first[1] == ()
        with _holder("2GiB") as child:
            memory, rows = sensor.read_snapshot(info)
            assert memory.used_bytes == 2 * GiB + 300 * MiB
            assert rows is not None and [(r.pid, r.used_bytes) for r in rows] == [
                (child.pid, 2 * GiB + 300 * MiB)
            ]
            # The memory and the rows asked for alone come from that same reading.
            assert sensor.read_memory(info) is memory and sensor.read_processes(info) is rows
            _kill_and_leave_unreaped(child)
            memory, rows = sensor.read_snapshot(info)
            assert memory.used_bytes == 0 and rows == ()


def test_the_tree_high_water_and_the_card_come_from_one_reading():
    """``read_tree_snapshot`` answers what ``read_tree_peak_bytes`` and ``read_snapshot``
    answer one after the other, while the ledger stands still."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        sensor, info = host.sensor(), _info(host)
        with _holder("2GiB") as child:
            assert sensor.start_tree_window(info, child.pid) == 2 * GiB + 300 * MiB
            peak, memory, rows = sensor.read_tree_snapshot(info, child.pid)
            assert peak == sensor.read_tree_peak_bytes(info, child.pid) == 2 * GiB + 300 * MiB
            assert (memory, rows) == sensor.read_snapshot(info)
        assert sensor.read_tree_snapshot(info, os.getpid()) == (
            None,
            *sensor.read_snapshot(info),
        )


def test_on_an_unreadable_card_the_tree_high_water_still_answers():
    """The driver lists no rows (``readable=False``): no memory and no rows, the tree's
    exact high-water as ``read_tree_peak_bytes`` gives it."""
    with SimulatedHost([SimulatedDevice("16GiB", readable=False)], context="300MiB") as host:
        sensor, info = host.sensor(), _info(host)
        with _holder("1GiB") as child:
            assert sensor.start_tree_window(info, child.pid) == GiB + 300 * MiB
            assert sensor.read_tree_snapshot(info, child.pid) == (GiB + 300 * MiB, None, None)


def _read_beside(path: str, mode: int, read: Callable[[], object]) -> object:
    """``read()`` on a thread while another descriptor of this process holds ``path``'s
    flock in ``mode``; what it returned. A read that waits for the lock fails the test (the
    lock is let go then, so the thread ends)."""
    results: list[object] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, mode)
        reader = threading.Thread(target=lambda: results.append(read()), daemon=True)
        reader.start()
        reader.join(timeout=120)  # only a bound for a failing run: it never passes by waiting
        assert not reader.is_alive(), "the reading waited for the ledger's lock"
    finally:
        os.close(fd)
    return results[0]


def test_a_reading_of_an_unchanged_ledger_waits_for_no_lock():
    """Another process holds the ledger's lock to change it: a reading of the ledger as it
    stands needs no lock (it compares the file's bytes), and gives the reading it holds."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        ledger = Ledger(host.ledger_path)
        try:
            first = ledger.view()
            assert _read_beside(host.ledger_path, fcntl.LOCK_EX, ledger.view) is first
        finally:
            ledger.close()


def test_a_reading_of_a_changed_ledger_goes_on_beside_another_reader():
    """The ledger changed since this reader last read it, and another reader holds the lock
    shared: the reading takes it shared too, and sees the change."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        ledger, other = Ledger(host.ledger_path), Ledger(host.ledger_path)
        try:
            ledger.view()
            assert other.allocate(0, os.getpid(), GiB) is None
            state = _read_beside(host.ledger_path, fcntl.LOCK_SH, ledger.view)
            assert isinstance(state, dict)
            assert state["devices"][0]["procs"][str(os.getpid())]["held"] == GiB
            other.release(0, os.getpid(), GiB)
        finally:
            ledger.close()
            other.close()


def test_a_window_already_open_at_the_bytes_now_is_not_written_again():
    """Opening a tree window where it already stands (nothing allocated since) leaves the
    ledger's bytes as they were; one allocation later, it is written."""
    with SimulatedHost([SimulatedDevice("16GiB")], context="300MiB") as host:
        ledger = Ledger(host.ledger_path)
        try:
            assert ledger.open_tree(0, os.getpid()) == 0
            with open(host.ledger_path, "rb") as file:
                before = file.read()
            assert ledger.open_tree(0, os.getpid()) == 0
            with open(host.ledger_path, "rb") as file:
                assert file.read() == before
            assert ledger.allocate(0, os.getpid(), GiB) is None
            ledger.release(0, os.getpid(), GiB)
            assert ledger.open_tree(0, os.getpid()) == 300 * MiB
            window = ledger.view()["devices"][0]["trees"][str(os.getpid())]
            assert window["window"] == 300 * MiB
        finally:
            ledger.close()


def test_a_change_and_its_undoing_never_give_the_ledger_its_earlier_bytes_again():
    """A co-tenant that grows and shrinks back leaves the card as it was, but not the
    ledger's text: a reader that compares the bytes with those it read before never takes a
    later state for the earlier one."""
    with SimulatedHost([SimulatedDevice("16GiB", co_tenants={"b": "2GiB"})]) as host:
        host.grow("b", "5GiB")
        host.shrink("b", "5GiB")  # the device's peak stays at 7 GiB from here on
        with open(host.ledger_path, "rb") as file:
            before = file.read()
        host.grow("b", "1GiB")
        host.shrink("b", "1GiB")
        with open(host.ledger_path, "rb") as file:
            after = file.read()
        assert host.used(0) == 2 * GiB
    assert after != before


def test_a_lock_free_reading_overtaken_by_changes_is_never_an_earlier_state(
    monkeypatch: pytest.MonkeyPatch,
):
    """A lock-free reading that two changes overtake half-way through its read (a ``pread``
    is not atomic against a ``pwrite`` on Linux: the kernel copies page cache to the reader
    while a writer copies into it) answers a state the ledger held during the read, never
    the earlier one its old bytes came from (before: one co-tenant's old bytes read before
    the changes and the other's, restored by the second change, after them equalled the
    earlier text, and the reading said 4 GiB where the card held at least 5 all along)."""
    card = SimulatedDevice("16GiB", co_tenants={"a": "2GiB", "b": "2GiB"})
    with SimulatedHost([card]) as host:
        host.grow("b", "5GiB")
        host.shrink("b", "5GiB")  # the peak stays at 9 GiB: only the co-tenants move below
        reader = Ledger(host.ledger_path)
        real_pread = os.pread
        try:
            reader.view()  # the reader's earlier bytes: a and b at 2 GiB each
            host.grow("b", "1GiB")  # from here on a and b hold at least 5 GiB together
            earlier = reader._reading.raw
            assert earlier is not None
            split = earlier.index(b'"b":')

            def overtaken(fd: int, length: int, offset: int) -> bytes:
                if fd != reader._file.fd or offset != 0 or length != len(earlier) + 1:
                    return real_pread(fd, length, offset)
                monkeypatch.setattr(os, "pread", real_pread)
                head = real_pread(fd, split, 0)  # a's bytes, read before the two changes
                host.grow("a", "1GiB")
                host.shrink("b", "1GiB")  # b's bytes back to what they were before
                return head + real_pread(fd, length - split, split)

            monkeypatch.setattr(os, "pread", overtaken)
            tenants = reader.view()["devices"][0]["tenants"]
        finally:
            monkeypatch.setattr(os, "pread", real_pread)
            reader.close()
    assert tenants["a"][1] + tenants["b"][1] >= 5 * GiB, tenants


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="reads /proc/locks")
def test_a_child_forked_below_python_waits_for_the_lock_its_parent_holds():
    """A child forked by C code (``fork`` through ctypes: no fork hook runs in it) that
    allocates while its parent holds the ledger's exclusive lock waits for it (before: it
    went on with its parent's open ledger, whose lock it "held" too, and wrote the ledger
    inside its parent's operation). Run in a process of its own: a fork made by C code in
    this multi-threaded test process could hang on a lock another thread held."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("below_python_fork.py"))],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["peak_bytes"] == 1 * GiB + 300 * MiB
    assert not seen["allocated"]
