"""Tasks that fork, and workers that send what is not an answer to the task they run.

Every answer a worker sends names the task it is about and the worker's PID,
and the parent checks both: a forked child of a task cannot answer in its
worker's place (it cannot even write on the worker's channel), and whatever
arrives that is not the running task's one answer is a protocol fault of that
worker: its task fails with :class:`gpupool.WorkerProtocolError`, the worker
is replaced, and no other task gets a wrong result. Each test here failed
before (wrong results, a crashed dispatcher and a broken pool, or a hang).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fork_tasks
import pytest
from leakguard import LeakGuard, exited, wait_until

from gpupool import GpuPoolExecutor, WorkerLostError, WorkerProtocolError
from gpupool.testing import SimulatedDevice, SimulatedHost

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="the tasks fork"),
]

#: A guard against a hang, never a measurement: every wait here ends far sooner.
HANG_S = 60

#: Tasks per run: a third fork, a third are ``ident``, a third ``pow(2, i)``.
TASKS = 30


def _host() -> SimulatedHost:
    return SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB")


def _submit_mixed(
    ex: GpuPoolExecutor, odd: Callable[..., Any], odd_args: Callable[[int], tuple[Any, ...]]
) -> tuple[list[concurrent.futures.Future[Any]], list[object]]:
    """Submit :data:`TASKS` tasks: ``odd(*odd_args(i))`` for every third ``i``, ordinary
    ones between; return the futures and what the ordinary ones must return (``None`` for
    the odd ones)."""
    futures: list[concurrent.futures.Future[Any]] = []
    expected: list[object] = []
    for i in range(TASKS):
        if i % 3 == 0:
            futures.append(ex.submit(odd, *odd_args(i)))
            expected.append(None)
        elif i % 3 == 1:
            futures.append(ex.submit(fork_tasks.ident, i))
            expected.append(("ident", i))
        else:
            futures.append(ex.submit(pow, 2, i))
            expected.append(2**i)
    return futures, expected


def _all_done(futures: list[concurrent.futures.Future[Any]]) -> None:
    _, not_done = concurrent.futures.wait(futures, timeout=HANG_S)
    assert not not_done, f"{len(not_done)} futures still pending"


def _still_works(ex: GpuPoolExecutor) -> None:
    assert list(ex.map(pow, [3] * 12, range(12), timeout=HANG_S)) == [3**i for i in range(12)]


def _forking_run(task: Callable[[int], object], expect: Callable[[int], object]) -> None:
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures, expected = _submit_mixed(ex, task, lambda i: (i,))
        _all_done(futures)
        results = [f.result() for f in futures]
        _still_works(ex)
        assert ex.statistics().workers_started == 2  # no worker was lost
    assert results == [expect(i) if e is None else e for i, e in enumerate(expected)]


# -- tasks that fork ---------------------------------------------------------------------


def test_a_forked_child_that_returns_from_the_task_sends_nothing(guard: LeakGuard):
    """Ten tasks fork and their children return from the task too: every one of 30 results
    is right and the pool goes on (before: a later task got the child's answer, or the
    dispatcher crashed and the pool broke)."""
    _forking_run(fork_tasks.child_returns, lambda i: ("parent", i))
    guard.assert_clean()


def test_a_forked_child_that_returns_exits_instead_of_running_tasks(tmp_path: Path):
    """The child that returns from its task leaves: it does not go on to read the worker's
    next tasks (before: it stayed, taking tasks from the same socket)."""
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        assert ex.submit(fork_tasks.child_notes_pid_then_returns, 0, str(tmp_path)).result(
            timeout=HANG_S
        ) == ("parent", 0)
        pid_file = tmp_path / "0.pid"
        assert wait_until(pid_file.exists, HANG_S)
        child = int(pid_file.read_text())
        assert wait_until(lambda: exited(child), HANG_S), "the task's child did not exit"
        _still_works(ex)


def test_a_forked_child_that_exits_changes_nothing(guard: LeakGuard):
    """Ten tasks fork a child that leaves with ``os._exit``: every result is right."""
    _forking_run(fork_tasks.child_exits, lambda i: ("parent", i))
    guard.assert_clean()


def test_a_forked_child_writing_garbage_on_every_descriptor_reaches_no_answer(
    guard: LeakGuard,
):
    """Ten tasks fork a child that writes random bytes to every descriptor it inherited
    (sockets, pipes, devices): every result is right, no worker is lost (before: the
    garbage was read as answers, and the pool hung or broke)."""
    _forking_run(fork_tasks.child_writes_garbage, lambda i: ("parent", i, True))
    guard.assert_clean()


# -- protocol faults of a worker ---------------------------------------------------------


def _fault_run(
    task: Callable[..., object], args: Callable[[int], tuple[Any, ...]]
) -> list[BaseException]:
    """Run the mixed tasks with ``task`` as the odd one; check the ordinary results and that
    the pool goes on; return the odd tasks' errors."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures, expected = _submit_mixed(ex, task, args)
        _all_done(futures)
        for future, value in zip(futures, expected, strict=True):
            if value is not None:
                assert future.result() == value
        errors = [f.exception() for f, e in zip(futures, expected, strict=True) if e is None]
        _still_works(ex)
        lost = [d.to_dict() for d in ex.decisions if d.event == "worker_lost"]
        assert len(lost) == len(errors)
        assert all("protocol" in str(d["reason"]) for d in lost)
    assert all(isinstance(e, WorkerProtocolError) for e in errors), errors
    return [e for e in errors if e is not None]


_TEXT = b"garbage, in a frame the size of an answer or more"

#: Bytes a task writes on its worker's channel, and what the error must quote of them.
GARBAGE = {
    "a frame that is not an answer": (
        len(_TEXT).to_bytes(4, "big") + _TEXT,
        "beginning b'garbage, in a frame",
    ),
    "random bytes": (random.Random(7).randbytes(64), "not an answer"),
    "a negative length": (b"\xff\xff\xff\xf0garbage!", "negative length -16"),
    "a short frame": (b"\x00\x00\x00\x02ab", "2 bytes (b'ab')"),
}


@pytest.mark.parametrize(("data", "quoted"), list(GARBAGE.values()), ids=list(GARBAGE))
def test_bytes_that_are_not_an_answer_fail_only_the_task_of_that_worker(
    guard: LeakGuard, data: bytes, quoted: str
):
    """A task writes bytes that are not an answer on its worker's channel: that task fails
    with a WorkerProtocolError quoting what arrived, its worker is replaced, every other
    result is right (before: the dispatcher crashed and the pool broke, or it hung)."""
    errors = _fault_run(fork_tasks.write_on_own_channel, lambda i: (i, data))
    assert len(errors) == TASKS // 3
    for error in errors:
        assert isinstance(error, WorkerProtocolError)
        assert quoted in error.received and quoted in str(error)
        assert error.signal_name == "SIGKILL"
    guard.assert_clean()


def test_an_answer_for_a_task_the_worker_is_not_running_fails_its_own_task(guard: LeakGuard):
    """A worker answers for a task it was not running, then for its own: the task it ran
    fails with a WorkerProtocolError naming the stray task; no result goes astray."""
    errors = _fault_run(fork_tasks.answer_for_another_task, lambda i: (i, 10**9))
    assert len(errors) == TASKS // 3
    assert all("task 1000000000" in str(e) for e in errors)
    assert all(isinstance(e, WorkerProtocolError) and e.pid is not None for e in errors)
    guard.assert_clean()


def test_an_answer_from_another_process_on_the_channel_is_the_workers_fault(tmp_path: Path):
    """A task's child keeps a copy of the channel's descriptor (out of the fork guard's
    reach) and answers on it with its own PID: the task fails naming that PID."""
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        error = ex.submit(fork_tasks.child_answers_on_a_copy, 5, str(tmp_path)).exception(
            timeout=HANG_S
        )
        child = int((tmp_path / "child.pid").read_text())
        _still_works(ex)
    assert isinstance(error, WorkerProtocolError)
    assert f"pid {child}" in str(error)


def test_a_fault_while_the_worker_is_idle_fails_no_task(tmp_path: Path):
    """Garbage arriving from an idle worker's channel (a task's child wrote it after the
    task ended): that worker is killed and replaced, and no task fails."""
    with _host(), GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        worker = ex.submit(fork_tasks.child_scribbles_later, str(tmp_path)).result(HANG_S)
        (tmp_path / "go").touch()
        assert wait_until((tmp_path / "done").exists, HANG_S)
        assert wait_until(lambda: exited(worker), HANG_S), "the faulty worker was not killed"
        _still_works(ex)
        assert ex.statistics().workers_started == 2
        assert not [d for d in ex.decisions if d.event == "worker_lost"]


def test_a_task_that_puts_a_socket_on_the_channels_number_fails_only_itself(guard: LeakGuard):
    """Ten tasks put a socket of their own on the number of the worker's channel and keep it
    open: each of them fails with a WorkerLostError, every other result is right, the pool
    goes on (before: the worker sent its answer into the task's socket and then waited on
    it for its next task, and the task's future, and every one queued behind, stayed
    pending)."""
    with _host(), GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures, expected = _submit_mixed(ex, fork_tasks.reuse_channel_number, lambda i: (i,))
        _, not_done = concurrent.futures.wait(futures, timeout=HANG_S)
        if not_done:
            ex.kill_workers()  # so that the pool can shut down, and the test fail, not hang
        assert not not_done, f"{len(not_done)} futures still pending"
        for future, value in zip(futures, expected, strict=True):
            if value is None:
                assert isinstance(future.exception(), WorkerLostError)
            else:
                assert future.result() == value
        _still_works(ex)
    guard.assert_clean()
