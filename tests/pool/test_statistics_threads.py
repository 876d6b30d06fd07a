"""Readers on other threads: ``statistics()``, ``ex.width`` and ``track`` read the snapshot the
dispatcher thread publishes, never its live planner, on real processes and the simulated host."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import inspect
import json
import pickle
import sys
import threading
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from types import CodeType, FrameType

import pytest
import tasks

from gpupool import GpuPoolExecutor, PoolStatistics, track
from gpupool._core.planner import Planner
from gpupool._core.policy import AskTable
from gpupool._pool.snapshot import ReadOnlyDict
from gpupool.testing import SimulatedDevice, SimulatedHost

#: Seven task keys, as a pipeline that mixes models submits them.
KEYS = tuple(f"model-{i}" for i in range(7))

#: Tiny tasks: enough dispatcher turns for the readers to meet every change of the
#: planner, few enough to finish well inside a minute on a loaded 2-core host.
RACE_TASKS = 1400

#: Threads that read the pool while it runs.
READERS = 2

#: The interpreter's thread switch interval during the race, in seconds (default
#: 0.005). Short, so the readers are switched out in the middle of what they read
#: thousands of times, and the dispatcher, waiting for the interpreter lock after
#: each pipe read, is not slowed tenfold by three busy readers.
SWITCH_INTERVAL_S = 1e-4

DISPATCHER_THREAD = "gpupool-dispatcher"


@pytest.fixture
def host() -> Iterator[SimulatedHost]:
    with SimulatedHost(
        devices=[SimulatedDevice(total="40GiB")], cpus=2, host_ram="64GiB", context=0
    ) as h:
        yield h


@pytest.fixture
def dense_switches() -> Iterator[None]:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def _submit_all(ex: GpuPoolExecutor, count: int) -> list[concurrent.futures.Future[int]]:
    """``count`` instant tasks, spread over the seven keys in turn."""
    views = [ex.options(key=key) for key in KEYS]
    return [views[i % len(KEYS)].submit(tasks.sleep_return, i, 0.0) for i in range(count)]


def _wrong(stats: PoolStatistics, width: int) -> list[str]:
    """What does not add up in one reading (empty: nothing)."""
    wrong = []
    ended = stats.tasks_completed + stats.tasks_failed + stats.tasks_cancelled
    if ended > stats.tasks_submitted:
        wrong.append(f"{ended} ended of {stats.tasks_submitted} submitted")
    if stats.width < 1 or width < 1:
        wrong.append(f"width {stats.width}, ex.width {width}")
    if any(w < 1 for w in stats.widths_by_key.values()):
        wrong.append(f"widths_by_key {dict(stats.widths_by_key)}")
    if list(stats.widths) != sorted(stats.widths):
        wrong.append(f"widths out of order: {stats.widths}")
    return wrong


def _read_until(
    ex: GpuPoolExecutor, stop: threading.Event, errors: list[str], readings: list[int]
) -> None:
    """Read ``statistics()`` and ``width`` until ``stop``; note every exception and bad reading."""
    count = 0
    try:
        while not stop.is_set():
            try:
                stats = ex.statistics()
                width = ex.width
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            errors.extend(_wrong(stats, width))
            count += 1
    finally:
        readings.append(count)


def test_readers_on_other_threads_never_meet_the_dispatcher_mid_change(host, dense_switches):
    """Two threads read statistics() and width through 1,400 tasks of 7 keys: no exception,
    every reading adds up, and after shutdown the counts add up to what was submitted."""
    errors: list[str] = []
    readings: list[int] = []
    stop = threading.Event()
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        readers = [
            threading.Thread(target=_read_until, args=(ex, stop, errors, readings))
            for _ in range(READERS)
        ]
        for reader in readers:
            reader.start()
        try:
            futures = _submit_all(ex, RACE_TASKS)
            _, not_done = concurrent.futures.wait(futures, timeout=240)
        finally:
            stop.set()
            for reader in readers:
                reader.join()
    assert not not_done
    assert [f.result() for f in futures] == list(range(RACE_TASKS))
    assert errors[:3] == [], f"{len(errors)} failed readings of {sum(readings) + len(errors)}"
    assert len(readings) == READERS and all(count > 0 for count in readings)
    stats = ex.statistics()
    assert stats.tasks_submitted == RACE_TASKS
    assert stats.tasks_completed == RACE_TASKS
    assert stats.tasks_failed == stats.tasks_cancelled == 0
    assert set(stats.asks) == set(KEYS)
    assert stats.widths_by_key == {}  # nothing pending or running once shut down


def test_a_future_seen_done_is_counted_by_the_statistics_read_after_it(host):
    """Each result taken from as_completed is already in statistics(): completed counts it,
    and its key has an ask."""
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures = _submit_all(ex, 70)
        behind = []
        for seen, future in enumerate(concurrent.futures.as_completed(futures, timeout=120), 1):
            stats = ex.statistics()
            key = KEYS[future.result() % len(KEYS)]
            if stats.tasks_completed < seen or key not in stats.asks:
                behind.append((seen, stats.tasks_completed, key, sorted(stats.asks)))
    assert behind == []


def test_after_shutdown_statistics_read_one_unchanging_snapshot(host):
    """Once the pool has shut down, statistics() reads the last snapshot as it is: the same
    asks and widths_by_key objects every time (nothing derives them again on the caller's
    thread), and counts that add up to what was submitted."""
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        futures = _submit_all(ex, 21)
        assert [f.result(timeout=60) for f in futures] == list(range(21))
    first, second = ex.statistics(), ex.statistics()
    assert first == second
    assert first.asks is second.asks
    assert first.widths_by_key is second.widths_by_key
    assert first.widths is second.widths
    assert first.tasks_completed + first.tasks_failed + first.tasks_cancelled == 21
    assert first.tasks_submitted == 21
    assert ex.width == first.width >= 1


def test_statistics_pickle_copy_and_go_through_asdict_to_json_read_only(host):
    """A snapshot's mappings cannot be written, and yet statistics pickle (to a file, a
    queue, another process), deep-copy and go through ``dataclasses.asdict`` to JSON, as
    the records they are. As read-only views (``MappingProxyType``), each of those raised
    ``TypeError: cannot pickle 'mappingproxy' object``."""
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        assert [f.result(timeout=60) for f in _submit_all(ex, 5)] == list(range(5))
    stats = ex.statistics()
    assert stats.asks  # a mapping with something in it
    for back in (pickle.loads(pickle.dumps(stats)), copy.deepcopy(stats)):
        assert back == stats
        assert isinstance(back.asks, ReadOnlyDict)
        assert isinstance(back.widths_by_key, ReadOnlyDict)
    plain = dataclasses.asdict(stats)
    assert json.loads(json.dumps(plain))["asks"].keys() == stats.asks.keys()
    key = next(iter(stats.asks))
    with pytest.raises(TypeError, match="read-only"):
        stats.asks[key] = stats.asks[key]  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        stats.widths_by_key.update({"another": 1})  # type: ignore[attr-defined]


def test_a_broken_pool_counts_every_future_it_failed(host):
    """An initializer that raises breaks the pool: after shutdown each future is counted once,
    as failed or cancelled, and the counts add up to what was submitted."""
    ex = GpuPoolExecutor(
        max_workers=1, task_peak="1GiB", initializer=tasks.fail, initargs=("no init",)
    )
    futures: list[concurrent.futures.Future[int]] = []
    try:
        for i in range(6):
            futures.append(ex.submit(tasks.sleep_return, i, 0.0))
        futures[-1].cancel()
    except BrokenProcessPool:
        pass  # broken already: what was submitted is counted below
    finally:
        ex.shutdown()
    _, not_done = concurrent.futures.wait(futures, timeout=60)
    assert not not_done and futures
    failed = [f for f in futures if not f.cancelled() and f.exception() is not None]
    cancelled = [f for f in futures if f.cancelled()]
    stats = ex.statistics()
    assert stats.tasks_submitted == len(futures)
    assert stats.tasks_failed == len(failed) >= 1
    assert stats.tasks_cancelled == len(cancelled)
    assert stats.tasks_completed + stats.tasks_failed + stats.tasks_cancelled == len(futures)


def _codes_of(*classes: type) -> set[CodeType]:
    """The code of every method and property of ``classes``."""
    codes: set[CodeType] = set()
    for cls in classes:
        for member in vars(cls).values():
            functions = [member.fget, member.fset] if isinstance(member, property) else [member]
            codes.update(f.__code__ for f in functions if inspect.isfunction(f))
    return codes


def test_only_the_dispatcher_thread_runs_the_planner_and_its_ask_table(host):
    """While the pool runs, statistics(), width and track on the caller's thread and another
    never run a Planner or AskTable method (whose memo the dispatcher fills): only the
    dispatcher thread does."""
    pytest.importorskip("tqdm")
    watched = _codes_of(Planner, AskTable)
    callers: dict[str, set[str]] = {}
    watching = threading.Event()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in watched and watching.is_set():
            name = threading.current_thread().name
            callers.setdefault(name, set()).add(frame.f_code.co_name)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            watching.set()  # the constructor prices the census on this thread, before the thread
            stop = threading.Event()
            errors: list[str] = []
            readings: list[int] = []
            reader = threading.Thread(
                target=_read_until, args=(ex, stop, errors, readings), name="reader"
            )
            reader.start()
            try:
                futures = _submit_all(ex, 140)
                done = concurrent.futures.as_completed(futures, timeout=120)
                seen = list(track(done, total=len(futures), executor=ex, enabled=True))
                width = ex.width
                stats = ex.statistics()
            finally:
                stop.set()
                reader.join()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert DISPATCHER_THREAD in callers  # the profile saw the planner at work
    others = {name: sorted(codes) for name, codes in callers.items() if name != DISPATCHER_THREAD}
    assert others == {}
    assert len(seen) == 140 and errors == [] and readings[0] > 0
    assert width >= 1 and stats.tasks_completed == 140
