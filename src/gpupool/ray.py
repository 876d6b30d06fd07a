"""gpupool on Ray: one memory-priced pool per GPU node, tasks routed by their measured asks.

Install with the ``ray`` extra (``pip install gpupool[ray]``). A
:class:`RayGpuExecutor` places one Ray actor on every GPU node of the cluster
(reserving all of that node's GPUs from Ray's accounting); each actor holds a
:class:`~gpupool.GpuPoolExecutor` over its node's cards. The executor sends
each task to a node whose pool has room for its key's ask now, as the pools'
snapshots state the asks, and keeps it queued on the driver while none has::

    import gpupool.ray

    with gpupool.ray.RayGpuExecutor(task_peak="6GiB") as ex:     # ray.init() if needed
        results = list(ex.map(compile_entry, entries))
        big = ex.options(key="big-model", task_peak="12GiB").submit(compile_big, entry)

Results come back through Ray's object store; a task's exception reaches its
future with its type. A key's ask is what its tasks were measured to hold on
any node: the driver prices a task at the largest measured ask any node
published for its key, and gives that price to a node that has not measured
the key yet as the task's peak hint. See ``docs/ray.md``.

``import gpupool`` never imports this module, nor ``ray``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import queue
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gpupool._broken import WorkerLostError
from gpupool._core.units import parse_pool_size
from gpupool._errors import ConfigurationError
from gpupool._integration import check_pool_keywords, pool_report
from gpupool._pool.dispatcher import callable_name
from gpupool._pool.executor import _OptionsView, map_calls, task_options

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor
    from gpupool.testing import SimulatedHost

__all__ = ["NodeLostError", "RayGpuExecutor", "RayNode"]

logger = logging.getLogger("gpupool")

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Seconds a node's pool gets at shutdown to finish its running tasks before its
#: workers are terminated.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0

#: Seconds the executor waits for every node's actor to start (Ray must place it
#: on its node, with the node's GPUs free) before it gives up with an error.
DEFAULT_START_TIMEOUT_S = 120.0

#: The most bytes of one node's decision log the driver copies into the run's account.
MAX_NODE_LOG_BYTES = 256 * 1024 * 1024

#: Actor options the executor sets itself (each has its own argument or is its design).
_OWN_ACTOR_OPTIONS = frozenset(
    {"num_gpus", "scheduling_strategy", "max_concurrency", "name", "namespace", "runtime_env"}
)

#: Pool keywords the executor owns (the driver's account, the driver's side).
_OWN_POOL_KEYWORDS = frozenset({"log_path", "progress", "on_interrupt"})


@dataclass(frozen=True, slots=True)
class RayNode:
    """A node of the Ray cluster that gets a pool.

    Attributes:
        node_id: Ray's node id (hex).
        address: the node's IP address.
        name: how records, reports and errors name it: ``"<address>/<node_id[:8]>"``.
        resources: the node's Ray resources (``{"GPU": 2.0, "CPU": 16.0, ...}``).
        gpus: the whole GPUs the node's pool reserves.
    """

    node_id: str
    address: str
    name: str
    resources: Mapping[str, float]
    gpus: int


class NodeLostError(WorkerLostError):
    """The Ray node (its pool's actor) that ran a task died; only its tasks fail.

    Attributes:
        node: the node's name (:attr:`RayNode.name`).
    """

    def __init__(self, message: str, *, node: str) -> None:
        super().__init__(message)
        self.node = node

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_node_lost, (str(self), self.node))


def _rebuild_node_lost(message: str, node: str) -> NodeLostError:
    return NodeLostError(message, node=node)


# -- the node's side: one actor holding one pool ------------------------------------------


class _NodePool:
    """A Ray actor (async): one :class:`~gpupool.GpuPoolExecutor` over its node's cards."""

    def __init__(
        self,
        node: RayNode,
        keywords: dict[str, Any],
        simulate: Callable[[RayNode], SimulatedHost | None] | None,
        log_dir: str | None,
        run: str,
    ) -> None:
        from gpupool._pool.executor import GpuPoolExecutor

        self.node = node
        directory = Path(log_dir) if log_dir else Path(tempfile.gettempdir(), "gpupool-ray")
        directory.mkdir(parents=True, exist_ok=True)
        self.log_path = str(directory / f"gpupool-{run}-{node.node_id[:8]}.jsonl")
        self.host = simulate(node) if simulate is not None else None
        if self.host is not None:
            self.host.__enter__()
        try:
            self.pool: GpuPoolExecutor = GpuPoolExecutor(
                **keywords, log_path=self.log_path, progress=False
            )
        except BaseException:
            if self.host is not None:
                self.host.__exit__(None, None, None)
            raise
        self.futures: dict[int, Future[Any]] = {}

    def info(self) -> dict[str, Any]:
        """Each card's room for tasks and the node's width ceiling, from the construction."""
        rooms: dict[int, int] = {}
        ceiling = 1
        for decision in self.pool.decisions:
            record = decision.to_dict()
            if record.get("event") != "constructed":
                continue
            device, room = record.get("device"), record.get("room_bytes")
            if isinstance(device, int) and isinstance(room, int):
                rooms[device] = room
            value = record.get("ceiling")
            if isinstance(value, int):
                ceiling = max(ceiling, value)
        return {
            "rooms_bytes": [rooms[d] for d in sorted(rooms)],
            "slots": ceiling,
            "pid": os.getpid(),
            "log_path": self.log_path,
            "snapshot": self.snapshot(),
        }

    def snapshot(self) -> dict[str, Any]:
        """Each key's ask as the pool last published it: ``(ask_bytes, basis)``."""
        stats = self.pool.statistics()
        return {
            "asks": {key: (ask.ask_bytes, ask.basis) for key, ask in stats.asks.items()},
            "width": stats.width,
        }

    async def run(
        self,
        task_id: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str,
        hint_bytes: int | None,
        size: float | None,
        label: str | None = None,
    ) -> tuple[str, Any, dict[str, Any]]:
        """Run one task in the pool; ``("ok" | "error" | "cancelled", value, snapshot)``."""
        try:
            view = self.pool.options(key=key, task_peak=hint_bytes, size=size, label=label)
            future = view.submit(fn, *args, **kwargs)
        except BaseException as exc:  # the pool is shut down or broken: the task's error
            return "error", exc, self.snapshot()
        self.futures[task_id] = future
        try:
            await asyncio.wait([asyncio.wrap_future(future)])
        finally:
            self.futures.pop(task_id, None)
        if future.cancelled():
            return "cancelled", None, self.snapshot()
        error = future.exception()
        if error is not None:
            return "error", error, self.snapshot()
        return "ok", future.result(), self.snapshot()

    def cancel(self, task_id: int) -> bool:
        """Cancel the task if the pool has not started it."""
        future = self.futures.get(task_id)
        return future is not None and future.cancel()

    def report(self) -> dict[str, Any]:
        """The pool as :func:`gpupool.dask.pool_report` states one, with the node."""
        return {
            "node": self.node.name,
            "log_path": self.log_path,
            **pool_report(self.pool, self.host),
        }

    async def close(self, timeout_s: float) -> bytes:
        """Shut the pool down (cancel what has not started), then return its decision log."""
        pool = self.pool
        pool.shutdown(wait=False, cancel_futures=True)
        try:
            await asyncio.wait_for(asyncio.to_thread(pool.shutdown), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("gpupool.ray: node %s: tasks still running; terminating", self.node.name)
            pool.terminate_workers()
            await asyncio.to_thread(pool.shutdown)
        finally:
            if self.host is not None:
                self.host.__exit__(None, None, None)
                self.host = None
        try:
            with open(self.log_path, "rb") as handle:
                return handle.read(MAX_NODE_LOG_BYTES)
        except OSError:
            return b""


# -- the driver's side ---------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Task:
    """One submitted task, owned by the executor's lock."""

    task_id: int
    future: _RayFuture[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str
    hint_bytes: int | None
    size: float | None
    label: str | None = None
    tries: int = 0
    node: str | None = None
    card: int = 0
    booked_bytes: int = 0


@dataclass(slots=True, eq=False)
class _Node:
    """A node's pool as the driver sees it: its rooms, what it routed there, its asks."""

    node: RayNode
    actor: Any
    rooms_bytes: list[int]
    slots: int
    booked_bytes: list[int]
    asks: dict[str, tuple[int, str]] = field(default_factory=dict)
    running: dict[int, _Task] = field(default_factory=dict)
    alive: bool = True

    def card_for(self, need_bytes: int) -> int | None:
        """The card with the least free room that holds ``need_bytes`` now, if any."""
        if len(self.running) >= self.slots:
            return None
        free = [
            room - booked for room, booked in zip(self.rooms_bytes, self.booked_bytes, strict=True)
        ]
        fits = [c for c, f in enumerate(free) if f >= need_bytes]
        if fits:
            return min(fits, key=lambda c: free[c])
        if not self.running and need_bytes > max(self.rooms_bytes, default=0):
            # Larger than every card: alone on the largest, as the pool's serial path runs it.
            return max(range(len(self.rooms_bytes)), key=lambda c: self.rooms_bytes[c])
        return None


class _RayFuture(Future[_R]):
    """A task's future: cancelling it cancels the task on its node if it has not started."""

    def __init__(self, owner: RayGpuExecutor, task_id: int) -> None:
        super().__init__()
        self._owner = owner
        self._task_id = task_id

    def cancel(self) -> bool:
        """Cancel the task where it waits (on the driver or in its node's pool); ``False``
        once it runs (a process cannot be stopped halfway) or has ended."""
        if self.done():
            return self.cancelled()
        return self._owner._cancel(self)

    def _cancel_here(self) -> bool:
        return super().cancel()


class RayGpuExecutor(concurrent.futures.Executor):
    """A ``concurrent.futures`` executor over a Ray cluster: one memory-priced pool per GPU node.

    The first four parameters and every keyword of :class:`~gpupool.GpuPoolExecutor`
    (``task_peak``, ``reserve``, ``margin``, ``retry_oom``, ``max_retries``, ``env``,
    ``devices``, ...) mean what they mean there and apply to each node's pool;
    ``max_workers`` is each node's width ceiling.

    Args:
        max_workers: each node's width ceiling (default: that node's usable CPUs).
        mp_context: as in ``GpuPoolExecutor`` (only spawn semantics).
        initializer: called in each pool worker before its first task.
        initargs: arguments for ``initializer``.
        address: the Ray cluster to connect to when Ray is not initialised yet
            (``ray.init(address=...)``; default: Ray's own choice).
        namespace: the Ray namespace of the node actors (and of ``ray.init`` when this
            executor calls it); the actors are named ``gpupool-<run>-<node>`` in it.
        runtime_env: the node actors' Ray ``runtime_env`` (the pool's workers are
            started by the actor, so they run in it too).
        nodes: which GPU nodes get a pool: node ids, node names or addresses, or a
            function of a :class:`RayNode` returning whether it does. Default: every
            alive node with a ``GPU`` resource.
        actor_options: further Ray options for each node actor (``resources``,
            ``memory``, ``label_selector``, ...); the executor sets ``num_gpus``,
            ``scheduling_strategy``, ``max_concurrency``, ``name``, ``namespace`` and
            ``runtime_env`` itself.
        simulate: a testing aid: called with the :class:`RayNode` in its actor's own
            process, it returns a :class:`gpupool.testing.SimulatedHost` (or ``None``)
            that the actor enters before its pool takes the census.
        log_path: the run's account: at shutdown, every node's decision log is
            appended here, each record carrying its ``node``; ``gpupool postmortem``
            and ``gpupool plot`` read it (a run per node).
        node_log_dir: the directory, on each node, of that node's own decision log
            (default: ``<tmp>/gpupool-ray``).
        retry_lost: times a task whose node died is sent again to another node before
            its future fails with :class:`NodeLostError` (default 0: it fails, as a
            task whose worker died does).
        start_timeout_s: seconds to wait for every node's actor to start.
        shutdown_timeout_s: seconds each node's pool gets at shutdown to finish its
            running tasks before its workers are terminated.
        **pool_keywords: the other keywords of ``GpuPoolExecutor``.

    Raises:
        ConfigurationError: a keyword is wrong, the cluster has no GPU node (among
            ``nodes``), or a node's pool did not start (its error, or the timeout).
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        address: str | None = None,
        namespace: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        nodes: Iterable[str] | Callable[[RayNode], bool] | None = None,
        actor_options: Mapping[str, Any] | None = None,
        simulate: Callable[[RayNode], SimulatedHost | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        node_log_dir: str | None = None,
        retry_lost: int = 0,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        **pool_keywords: Any,
    ) -> None:
        keywords = _pool_keywords(max_workers, mp_context, initializer, initargs, pool_keywords)
        options = _actor_options(actor_options)
        _check_ray_keywords(simulate, retry_lost)
        task_peak = keywords.get("task_peak")
        self._default_bytes = (
            None
            if task_peak is None
            else parse_pool_size(task_peak, name="task_peak", allow_zero=False)
        )
        self._retry_lost = retry_lost
        self._log_path = None if log_path is None else Path(log_path)
        self._shutdown_timeout_s = float(shutdown_timeout_s)
        self._run = uuid.uuid4().hex[:12]
        _connect(address, namespace, runtime_env)
        chosen = _gpu_nodes(nodes)
        self._lock = threading.Condition(threading.RLock())
        self._ids = itertools.count()
        self._queue: collections.deque[_Task] = collections.deque()
        self._tasks: dict[int, _Task] = {}
        # Outcomes as Ray's callback thread hands them over: it takes no lock of ours (a
        # callback that waited for the router, while the router waited in a Ray call, would
        # hang both), only this queue and the router's wake-up event.
        self._landed: queue.SimpleQueue[tuple[int, str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._shutdown = False
        self._closed = False
        self._nodes = _start_nodes(
            chosen,
            keywords,
            options,
            simulate=simulate,
            node_log_dir=node_log_dir,
            run=self._run,
            namespace=namespace,
            runtime_env=runtime_env,
            timeout_s=float(start_timeout_s),
        )
        self._router = threading.Thread(target=self._route, name="gpupool-ray-router", daemon=True)
        self._router.start()

    # -- the executor contract ------------------------------------------------------------

    @property
    def nodes(self) -> tuple[RayNode, ...]:
        """The nodes this executor placed a pool on (alive or not)."""
        return tuple(n.node for n in self._nodes.values())

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        """Schedule ``fn(*args, **kwargs)`` on the cluster; returns a ``concurrent.futures.Future``.

        Raises:
            RuntimeError: the executor was shut down.
        """
        return self._submit(fn, args, kwargs, None)

    def options(
        self,
        *,
        key: str | None = None,
        task_peak: str | int | None = None,
        size: float | None = None,
        label: str | None = None,
    ) -> _OptionsView:
        """``submit``/``map`` with a task key, a peak hint, an input size and a label, as
        :meth:`GpuPoolExecutor.options <gpupool.GpuPoolExecutor.options>` (the node's pool
        writes the label on its records).

        Raises:
            ConfigurationError: ``task_peak`` is not a positive size, ``key`` is not a
                non-empty str, ``size`` is not a positive, finite number, or ``label`` is
                not a non-empty str of at most 200 characters without control characters.
        """
        options, hint_bytes = task_options(key=key, task_peak=task_peak, size=size, label=label)
        return _OptionsView(self, options, hint_bytes)

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        view: _OptionsView | None,
        key: str | None = None,
    ) -> Future[Any]:
        options = view._options if view is not None else None
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            task_id = next(self._ids)
            future: _RayFuture[Any] = _RayFuture(self, task_id)
            task = _Task(
                task_id=task_id,
                future=future,
                fn=fn,
                args=args,
                kwargs=kwargs,
                key=(options.key if options is not None else None) or key or callable_name(fn),
                hint_bytes=view._hint_bytes if view is not None else None,
                size=(options.size if options is not None and not callable(options.size) else None),
                label=options.label if options is not None else None,
            )
            self._tasks[task.task_id] = task
            self._queue.append(task)
            self._wake.set()
            return future

    def map(
        self,
        fn: Callable[..., _R],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[_R]:
        """Like :func:`map`, each call a task on the cluster; results come back in input order.

        Raises:
            ValueError: ``chunksize < 1`` or ``buffersize < 1``.
            TypeError: ``buffersize`` is not an integer (as :meth:`GpuPoolExecutor.map
                <gpupool.GpuPoolExecutor.map>`).
        """
        return self._map(fn, iterables, timeout, chunksize, buffersize, None)

    def _map(
        self,
        fn: Callable[..., Any],
        iterables: Sequence[Iterable[Any]],
        timeout: float | None,
        chunksize: int,
        buffersize: int | None,
        view: _OptionsView | None,
    ) -> Iterator[Any]:
        key = callable_name(fn)

        def submit(
            call: Callable[..., Any], args: tuple[Any, ...], _entry: int, _entries: int
        ) -> Future[Any]:
            return self._submit(call, args, {}, view, key)

        return map_calls(submit, fn, iterables, timeout, chunksize, buffersize)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; by default wait for every task, then shut each node's pool down.

        The node actors end once their pools have shut down; with ``log_path``, their
        decision logs are appended to it then.

        Args:
            wait: block until every task has ended and the pools are shut down.
            cancel_futures: cancel every task that has not started (on the driver
                and in the nodes' pools).
        """
        cancelled: list[_Task] = []
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                cancelled = list(self._queue)
                self._queue.clear()
                for task in cancelled:
                    self._tasks.pop(task.task_id, None)
            running = [t for n in self._nodes.values() if n.alive for t in n.running.values()]
            self._lock.notify_all()
        for task in cancelled:
            task.future._cancel_here()
        if cancel_futures:
            for task in running:
                task.future.cancel()
        if wait:
            self._close()
        else:
            threading.Thread(target=self._close, name="gpupool-ray-close", daemon=True).start()

    def reports(self) -> dict[str, dict[str, Any]]:
        """Each alive node's pool, by node name: ``node``, ``log_path``, ``width``,
        ``census``, ``decisions``, ``statistics``, ``simulated`` (as
        :func:`gpupool.dask.pool_report` states them)."""
        alive = [n for n in self._nodes.values() if n.alive]
        refs = [n.actor.report.remote() for n in alive]
        return {n.node.name: r for n, r in zip(alive, ray.get(refs), strict=True)}

    # -- the router: one thread sends tasks where they fit --------------------------------

    def _route(self) -> None:
        try:
            self._route_until_closed()
        except BaseException as exc:
            # A bug here must not leave futures pending: every task not ended fails with it.
            logger.exception("gpupool.ray: the router stopped")
            with self._lock:
                self._closed = True
                tasks = list(self._tasks.values())
                self._tasks.clear()
                self._queue.clear()
                self._lock.notify_all()
            for task in tasks:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    task.future.set_exception(exc)
            raise

    def _route_until_closed(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._landed.empty():
                self._settle(*self._landed.get())
            with self._lock:
                if self._closed:
                    return
                self._place()

    def _price(self, task: _Task) -> int | None:
        """The task's ask: the largest measured ask any node published for its key; else the
        largest of its hint and the nodes' estimates; ``None``: unknown (runs alone)."""
        measured = [
            ask[0]
            for n in self._nodes.values()
            if (ask := n.asks.get(task.key)) is not None and ask[1] == "measured"
        ]
        if measured:
            return max(measured)
        estimates = [ask[0] for n in self._nodes.values() if (ask := n.asks.get(task.key))]
        hint = task.hint_bytes if task.hint_bytes is not None else self._default_bytes
        if hint is not None:
            estimates.append(hint)
        return max(estimates) if estimates else None

    def _place(self) -> None:
        """Send each queued task, oldest first, to the node with the most room left for it;
        while the oldest fits nowhere, hold the node it would fit on first."""
        held: set[str] = set()
        alive = [n for n in self._nodes.values() if n.alive]
        if not alive:
            self._fail_queue()
            return
        for task in list(self._queue):
            price = self._price(task)
            best: tuple[int, _Node, int, int] | None = None
            for node in alive:
                if node.node.name in held:
                    continue
                need = price if price is not None else max(node.rooms_bytes)
                card = node.card_for(need)
                if card is None:
                    continue
                left = node.rooms_bytes[card] - node.booked_bytes[card] - need
                if best is None or left > best[0]:
                    best = (left, node, card, need)
            if best is None:
                if task is self._queue[0]:
                    held.add(self._hold_for(alive, price))
                continue
            _, node, card, need = best
            self._queue.remove(task)
            self._send(task, node, card, min(need, node.rooms_bytes[card]), price)

    def _hold_for(self, alive: list[_Node], price: int | None) -> str:
        """The node the oldest task waits for: one whose cards hold it, least booked first."""

        def booked(n: _Node) -> tuple[bool, int]:
            need = price if price is not None else max(n.rooms_bytes)
            return (need > max(n.rooms_bytes), sum(n.booked_bytes))

        return min(alive, key=booked).node.name

    def _send(self, task: _Task, node: _Node, card: int, booked: int, price: int | None) -> None:
        task.node, task.card, task.booked_bytes = node.node.name, card, booked
        node.booked_bytes[card] += booked
        node.running[task.task_id] = task
        own = node.asks.get(task.key)
        # A node that has not measured the key is told the price learned elsewhere.
        hint = task.hint_bytes
        if price is not None and (own is None or own[1] != "measured"):
            hint = price if hint is None else max(hint, price)
        try:
            ref = node.actor.run.remote(
                task.task_id, task.fn, task.args, task.kwargs, task.key, hint, task.size, task.label
            )
        except Exception as exc:  # the call did not pickle: only this task fails
            self._release(node, task.task_id)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                task.future.set_exception(exc)
            return
        name = node.node.name
        ref.future().add_done_callback(lambda _: self._land(task.task_id, name, ref))

    def _land(self, task_id: int, name: str, ref: Any) -> None:
        self._landed.put((task_id, name, ref))
        self._wake.set()

    def _settle(self, task_id: int, name: str, ref: Any) -> None:
        """Deliver one task's outcome from its node (off the lock: results may be large)."""
        try:
            kind, value, snapshot = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self._node_lost(task_id, name, exc)
            return
        except ray.exceptions.RayError as exc:  # e.g. a result Ray could not store
            kind, value, snapshot = "error", exc, None
        with self._lock:
            node = self._nodes[name]
            task = self._release(node, task_id)
            if snapshot is not None:
                node.asks = dict(snapshot["asks"])
            self._lock.notify_all()
        if task is None:
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if kind == "ok":
                task.future.set_result(value)
            elif kind == "error":
                task.future.set_exception(value)
            else:
                task.future._cancel_here()

    def _release(self, node: _Node, task_id: int) -> _Task | None:
        task = node.running.pop(task_id, None)
        if task is not None:
            node.booked_bytes[task.card] -= task.booked_bytes
            self._tasks.pop(task_id, None)
        return task

    def _node_lost(self, task_id: int, name: str, exc: BaseException) -> None:
        """The node's actor died: retry the task elsewhere (``retry_lost``) or fail it."""
        with self._lock:
            node = self._nodes[name]
            if node.alive:
                node.alive = False
                logger.warning("gpupool.ray: node %s lost: %s", name, exc)
            task = self._release(node, task_id)
            if task is None:
                return
            others = any(n.alive for n in self._nodes.values())
            if task.tries < self._retry_lost and others and not task.future.cancelled():
                task.tries += 1
                task.node = None
                self._tasks[task.task_id] = task
                self._queue.appendleft(task)
                self._wake.set()
                self._lock.notify_all()
                return
            self._wake.set()
            self._lock.notify_all()
        tries = f" after {task.tries + 1} tries" if task.tries else ""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            task.future.set_exception(
                NodeLostError(
                    f"the Ray node {name} running this task was lost{tries} "
                    f"({exc.__class__.__name__}); "
                    f"only its tasks fail (retry_lost={self._retry_lost})",
                    node=name,
                )
            )

    def _fail_queue(self) -> None:
        """No node is left: every queued task fails (called under the lock)."""
        names = ", ".join(self._nodes)
        while self._queue:
            task = self._queue.popleft()
            self._tasks.pop(task.task_id, None)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                task.future.set_exception(
                    NodeLostError(f"every node of the pool was lost ({names})", node=names)
                )

    def _cancel(self, future: _RayFuture[Any]) -> bool:
        with self._lock:
            task = self._tasks.get(future._task_id)
            if task is None:
                return future._cancel_here() if not future.done() else future.cancelled()
            if task.node is None:
                with contextlib.suppress(ValueError):
                    self._queue.remove(task)
                self._tasks.pop(task.task_id, None)
                return future._cancel_here()
            node = self._nodes[task.node]
            if not node.alive:
                return False
            ref = node.actor.cancel.remote(task.task_id)
        try:
            cancelled = bool(ray.get(ref, timeout=30))
        except ray.exceptions.RayError:
            return False
        return future._cancel_here() if cancelled else False

    # -- shutdown --------------------------------------------------------------------------

    def _close(self) -> None:
        """Wait for every task, then shut every node's pool down and write the account."""
        with self._lock:
            # Every task ends: a node's outcome or its loss settles it, and with no node
            # left the router fails what waits.
            while self._tasks:
                self._lock.wait(1.0)
            if self._closed:
                return
            self._closed = True
            self._fail_queue()
            self._lock.notify_all()
        self._wake.set()
        alive = [n for n in self._nodes.values() if n.alive]
        refs = [n.actor.close.remote(self._shutdown_timeout_s) for n in alive]
        logs: list[tuple[str, bytes]] = []
        for node, ref in zip(alive, refs, strict=True):
            try:
                logs.append((node.node.name, ray.get(ref, timeout=self._shutdown_timeout_s + 60)))
            except ray.exceptions.RayError as exc:
                logger.warning("gpupool.ray: node %s did not close: %s", node.node.name, exc)
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(node.actor)
        if self._log_path is not None:
            _write_account(self._log_path, logs)
        self._router.join(timeout=10)

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        # Ctrl-C cancels what has not started; any other exit waits for every task.
        interrupted = isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt)
        self.shutdown(wait=True, cancel_futures=interrupted)


# -- construction --------------------------------------------------------------------------


def _pool_keywords(
    max_workers: int | None,
    mp_context: Any,
    initializer: Callable[..., object] | None,
    initargs: tuple[Any, ...],
    rest: Mapping[str, Any],
) -> dict[str, Any]:
    own = sorted(set(rest) & _OWN_POOL_KEYWORDS)
    if own:
        raise ConfigurationError(
            f"{', '.join(own)}: the Ray executor sets this itself (log_path is the run's "
            "account on the driver, written at shutdown; node_log_dir places each node's own "
            "log; progress and on_interrupt belong to a local pool)."
        )
    check_pool_keywords(rest)
    keywords = dict(rest)
    keywords.update(
        max_workers=max_workers, mp_context=mp_context, initializer=initializer, initargs=initargs
    )
    return keywords


def _check_ray_keywords(simulate: object, retry_lost: object) -> None:
    """Refuse a ``simulate`` that is no function, and a ``retry_lost`` that is no count."""
    if simulate is not None and not callable(simulate):
        raise ConfigurationError(
            "simulate must be a function of the RayNode returning a SimulatedHost "
            "(a SimulatedHost object itself does not pickle)."
        )
    if not isinstance(retry_lost, int) or isinstance(retry_lost, bool) or retry_lost < 0:
        raise ConfigurationError(f"retry_lost={retry_lost!r}: give a count, 0 or more.")


def _connect(
    address: str | None, namespace: str | None, runtime_env: Mapping[str, Any] | None
) -> None:
    """Join the Ray cluster at ``address`` (``None``: Ray's own choice), unless this process
    has joined one already."""
    if not ray.is_initialized():
        ray.init(
            address=address,
            namespace=namespace,
            runtime_env=dict(runtime_env) if runtime_env is not None else None,
        )


def _actor_options(actor_options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(actor_options or {})
    own = sorted(set(options) & _OWN_ACTOR_OPTIONS)
    if own:
        raise ConfigurationError(
            f"actor_options {', '.join(own)}: the Ray executor sets this itself (each node's "
            "actor takes all of its node's GPUs, pinned to it; pass namespace= and "
            "runtime_env= as the executor's own arguments)."
        )
    return options


def _gpu_nodes(select: Iterable[str] | Callable[[RayNode], bool] | None) -> list[RayNode]:
    """The alive nodes with a GPU that ``select`` keeps; a clear error when there is none."""
    alive: list[RayNode] = []
    for info in ray.nodes():  # type: ignore[no-untyped-call]
        if not info.get("Alive"):
            continue
        resources = {str(k): float(v) for k, v in dict(info.get("Resources", {})).items()}
        node_id = str(info["NodeID"])
        address = str(info.get("NodeManagerAddress", ""))
        alive.append(
            RayNode(
                node_id=node_id,
                address=address,
                name=f"{address}/{node_id[:8]}",
                resources=resources,
                gpus=int(resources.get("GPU", 0.0)),
            )
        )
    if select is None:
        chosen = alive
    elif callable(select):
        chosen = [n for n in alive if select(n)]
    else:
        wanted = {select} if isinstance(select, str) else set(select)
        chosen = [n for n in alive if wanted & {n.node_id, n.name, n.address}]
    with_gpus = [n for n in chosen if n.gpus >= 1]
    if not with_gpus:
        listing = "; ".join(f"{n.name}: GPU {n.resources.get('GPU', 0):g}" for n in chosen)
        which = "the Ray cluster" if select is None else "the nodes selected by nodes="
        raise ConfigurationError(
            f"{which} has no node with a whole GPU ({len(chosen)} alive node"
            f"{'s' if len(chosen) != 1 else ''}: {listing or 'none'}), so there is nowhere to "
            "run a GPU pool. Start GPU nodes with `ray start --num-gpus N` (Ray counts the "
            "cards it detects), or select nodes that have GPUs."
        )
    return with_gpus


def _start_nodes(
    chosen: list[RayNode],
    keywords: dict[str, Any],
    options: dict[str, Any],
    *,
    simulate: Callable[[RayNode], SimulatedHost | None] | None,
    node_log_dir: str | None,
    run: str,
    namespace: str | None,
    runtime_env: Mapping[str, Any] | None,
    timeout_s: float,
) -> dict[str, _Node]:
    """One actor per node, each holding all its node's GPUs; wait until every one answers."""
    actor_class: Any = ray.remote(_NodePool)
    actors: list[Any] = [
        actor_class.options(**_settings(node, options, run, namespace, runtime_env)).remote(
            node, keywords, simulate, node_log_dir, run
        )
        for node in chosen
    ]
    refs = [actor.info.remote() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    problems: list[str] = []
    infos: list[dict[str, Any]] = []
    for node, ref in zip(chosen, refs, strict=True):
        if ref not in ready:
            problems.append(
                f"node {node.name}: its pool's actor did not start within {timeout_s:g} s "
                f"(Ray could not place it with the node's {node.gpus} GPU(s): held by other "
                "Ray work?)"
            )
            continue
        try:
            infos.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            problems.append(f"node {node.name}: its pool did not start: {exc}")
    if problems:
        for actor in actors:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor)
        raise ConfigurationError("; ".join(problems))
    return {
        node.name: _Node(
            node=node,
            actor=actor,
            rooms_bytes=list(info["rooms_bytes"]),
            slots=int(info["slots"]),
            booked_bytes=[0] * len(info["rooms_bytes"]),
            asks=dict(info["snapshot"]["asks"]),
        )
        for node, actor, info in zip(chosen, actors, infos, strict=True)
    }


def _settings(
    node: RayNode,
    options: dict[str, Any],
    run: str,
    namespace: str | None,
    runtime_env: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A node actor's Ray options: the user's, then all of the node's GPUs, pinned there."""
    settings = dict(options)
    settings.setdefault("num_cpus", 0)
    settings.update(
        num_gpus=node.gpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        max_concurrency=1000,
        name=f"gpupool-{run}-{node.node_id[:8]}",
    )
    if namespace is not None:
        settings["namespace"] = namespace
    if runtime_env is not None:
        settings["runtime_env"] = dict(runtime_env)
    return settings


def _write_account(path: Path, logs: list[tuple[str, bytes]]) -> None:
    """Append each node's records to ``path``, each naming its node."""
    with open(path, "a", encoding="utf-8") as handle:
        for name, data in logs:
            for line in data.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short: the node's own log keeps it
                    continue
                if isinstance(record, dict):
                    record["node"] = name
                    handle.write(json.dumps(record, separators=(",", ":")) + "\n")
