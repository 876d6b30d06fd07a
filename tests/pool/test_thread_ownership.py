"""Which thread may touch which state, checked on a real pool rather than said in prose.

Caller threads reach the inbox (:class:`gpupool._pool.inbox.Inbox`) and what the
dispatcher thread publishes whole (``PUBLISHED`` on each part: the snapshot and the
thread's end, the processes). Every other attribute of the dispatcher's parts (the loop,
the worker set and its clocks, the outcomes, the card reader, the booking link, the run
memory, the public room's bookkeeping, the planner)
belongs to the dispatcher thread once it runs: here a ``__getattribute__`` guard,
installed on those classes for the test only, fails any other thread that reads one.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tasks

from gpupool import GpuPoolExecutor
from gpupool._core.planner import Planner
from gpupool._pool import inbox, outcomes, workers
from gpupool._pool.booking_link import BookingLink
from gpupool._pool.dispatcher import CardReader, Dispatcher
from gpupool._pool.memory import RunMemory
from gpupool._pool.outcomes import Outcomes
from gpupool._pool.snapshot import Public
from gpupool._pool.workers import WorkerClocks, WorkerSet
from gpupool.testing import SimulatedDevice, SimulatedHost

#: The dispatcher thread's parts, as the loop names them (its own attribute for each).
PARTS = {
    "workers": WorkerSet,
    "outcomes": Outcomes,
    "cards": CardReader,
    "link": BookingLink,
    "memory": RunMemory,
    "public": Public,
}
#: The rooms of a part, as the part names them (the worker set's clocks).
ROOMS = {"workers": ("clocks", WorkerClocks)}
OWNED: tuple[type, ...] = (
    Dispatcher,
    Planner,
    *PARTS.values(),
    *(cls for _, cls in ROOMS.values()),
)


class Ownership:
    """Owner threads by object, and what other threads reached that they may not."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}
        self.keep: list[object] = []  # the owned objects stay alive while their ids are keys
        self.violations: list[str] = []

    def claim(self, owner: object) -> None:
        self.owners[id(owner)] = threading.get_ident()
        self.keep.append(owner)

    def check(self, obj: object, name: str) -> None:
        owner = self.owners.get(id(obj))
        if owner is None or owner == threading.get_ident() or name.startswith("__"):
            return
        if name in getattr(type(obj), "PUBLISHED", ()):
            return
        where = f"{type(obj).__name__}.{name} from {threading.current_thread().name}"
        self.violations.append(where)
        raise AssertionError(f"{where}: not the owner thread's")


@pytest.fixture
def ownership(monkeypatch: pytest.MonkeyPatch) -> Ownership:
    """Guard the parts' classes; the dispatcher thread claims its parts as it starts."""
    watch = Ownership()
    for cls in OWNED:

        def guarded(self: Any, name: str) -> Any:
            watch.check(self, name)
            return object.__getattribute__(self, name)

        monkeypatch.setattr(cls, "__getattribute__", guarded)
    run = Dispatcher._run

    def claimed_run(self: Dispatcher) -> None:
        watch.claim(self)
        watch.claim(self.planner)
        for name in PARTS:
            part = getattr(self, name)
            if part is not None:
                watch.claim(part)
                if name in ROOMS:
                    watch.claim(getattr(part, ROOMS[name][0]))
        run(self)

    monkeypatch.setattr(Dispatcher, "_run", claimed_run)
    return watch


@pytest.fixture
def host() -> Iterator[SimulatedHost]:
    with SimulatedHost(
        devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB", context=0
    ) as h:
        yield h


def _read(ex: GpuPoolExecutor, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        while not stop.is_set():
            ex.statistics()
            assert ex.width >= 1
            len(ex._processes)
    except BaseException as exc:
        errors.append(exc)


def test_caller_threads_reach_only_the_inbox_and_what_is_published(host, ownership, tmp_path):
    """Submits from three threads, map, cancel, a failing task, readers of statistics(),
    width and _processes, and shutdown(cancel_futures=True): no caller thread reads state of
    the dispatcher thread's parts, and every future ends."""
    errors: list[BaseException] = []
    stop = threading.Event()
    # Sharing on: the booking link is one of the parts.
    ex = GpuPoolExecutor(max_workers=2, task_peak="1GiB", bookings_dir=tmp_path)
    reader = threading.Thread(target=_read, args=(ex, stop, errors), name="reader")
    reader.start()
    futures: list[concurrent.futures.Future[Any]] = []

    def submit_some(offset: int) -> None:
        try:
            futures.extend(ex.submit(tasks.sleep_return, offset + i, 0.01) for i in range(20))
        except BaseException as exc:
            errors.append(exc)

    submitters = [
        threading.Thread(target=submit_some, args=(100 * n,), name=f"submitter-{n}")
        for n in range(3)
    ]
    try:
        for thread in submitters:
            thread.start()
        for thread in submitters:
            thread.join()
        assert list(ex.map(tasks.sleep_return, range(5), [0.0] * 5)) == list(range(5))
        failing = ex.submit(tasks.fail, "as asked")
        with pytest.raises(ValueError, match="as asked"):
            failing.result(timeout=60)
        late = [ex.submit(tasks.sleep_return, i, 0.05) for i in range(30)]
        late[-1].cancel()
        _, not_done = concurrent.futures.wait(futures, timeout=120)
        assert not not_done
        # The guard is not vacuous: the parts refuse this thread once the loop runs.
        with pytest.raises(AssertionError, match=r"Dispatcher\.outcomes"):
            _ = ex._dispatcher.outcomes
        with pytest.raises(AssertionError, match=r"WorkerSet\.by_card"):
            _ = ex._dispatcher.workers.by_card
        # A room is guarded as its part is (reached here past the part's own guard).
        room = object.__getattribute__(ex._dispatcher.workers, "clocks")
        with pytest.raises(AssertionError, match=r"WorkerClocks\.due_at_s"):
            _ = room.due_at_s
        with pytest.raises(AssertionError, match=r"Dispatcher\.planner"):
            _ = ex._dispatcher.planner
        with pytest.raises(AssertionError, match=r"Dispatcher\.memory"):
            _ = ex._dispatcher.memory
        # The public room shows its snapshot, and nothing else of its own.
        assert ex._dispatcher.public.snapshot.width >= 1
        with pytest.raises(AssertionError, match=r"Public\.unpublished_tasks"):
            _ = ex._dispatcher.public.unpublished_tasks
        with pytest.raises(AssertionError, match=r"Public\.planner"):
            _ = ex._dispatcher.public.planner
        memory = object.__getattribute__(ex._dispatcher, "memory")
        with pytest.raises(AssertionError, match=r"RunMemory\.names"):
            _ = memory.names
        ownership.violations.clear()
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
        stop.set()
        reader.join()
    assert errors == []
    assert ownership.violations == []
    _, not_done = concurrent.futures.wait(late, timeout=60)
    assert not not_done
    stats = ex.statistics()
    assert stats.tasks_submitted == 60 + 5 + 1 + 30
    ended = stats.tasks_completed + stats.tasks_failed + stats.tasks_cancelled
    assert ended == stats.tasks_submitted


def _names(module: object) -> set[str]:
    """Every name and attribute the code of ``module`` reads (docstrings aside)."""
    tree = ast.parse(Path(str(getattr(module, "__file__", ""))).read_text(encoding="utf-8"))
    return {
        node.attr if isinstance(node, ast.Attribute) else node.id
        for node in ast.walk(tree)
        if isinstance(node, (ast.Attribute, ast.Name))
    }


@pytest.mark.parametrize("module", [workers, outcomes, inbox], ids=lambda m: m.__name__)
def test_only_the_loop_asks_the_planner(module: object) -> None:
    """The worker set, the outcomes and the inbox name no planner: they return events and
    values, and the loop (the dispatcher) decides."""
    assert _names(module) & {"planner", "Planner"} == set()


@pytest.mark.parametrize("module", [workers, inbox], ids=lambda m: m.__name__)
def test_only_the_outcomes_set_a_future(module: object) -> None:
    """The worker set and the inbox never read or set a task's future."""
    found = _names(module) & {"future", "set_result", "set_exception", "cancel"}
    assert found <= ({"future"} if module is inbox else set())  # WorkItem's own field


def _worker_writes(source: str) -> list[str]:
    """The fields of a :class:`~gpupool._pool.workers.Worker` that ``source`` assigns
    (``worker.retiring = ...``), by field name."""
    fields = {f.name for f in dataclasses.fields(workers.Worker)}
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id in {"worker", "w"}
                and target.attr in fields
            ):
                found.append(target.attr)
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p for p in Path(workers.__file__).parent.glob("*.py") if p.name != "workers.py"),
    ids=lambda p: p.name,
)
def test_only_the_worker_set_writes_a_workers_fields(path: Path) -> None:
    """A worker's fields are written in its own module alone (the worker set and its
    clocks); the loop asks the worker set (``leaves``, ``retire``) instead."""
    assert _worker_writes(path.read_text(encoding="utf-8")) == []


def test_the_worker_field_check_is_not_vacuous() -> None:
    """It sees a write from outside, and the worker set's own."""
    assert _worker_writes("worker.retiring = True\nw.tasks_done += 1\nworker.x = 1") == [
        "retiring",
        "tasks_done",
    ]
    assert "retiring" in _worker_writes(Path(workers.__file__).read_text(encoding="utf-8"))
