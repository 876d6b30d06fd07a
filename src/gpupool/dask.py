"""gpupool on Dask distributed: one memory-priced GPU pool per worker, as a named executor.

Install with the ``dask`` extra (``pip install gpupool[dask]``). A worker
plugin builds one :class:`~gpupool.GpuPoolExecutor` on every worker (its
census taken on that worker's machine, when the plugin is set up) and
registers it in the worker's ``executors`` under a name, ``"gpu"`` by
default. Tasks annotated with that executor run in the pool::

    import dask
    import gpupool.dask

    gpupool.dask.register(client, task_peak="6GiB")      # every worker, now and later
    with dask.annotate(executor="gpu"):
        futures = client.map(compile_entry, entries)
    with dask.annotate(executor="gpu", gpupool_peak="12GiB", gpupool_key="big-model"):
        big = client.submit(compile_big, entry)
    reports = gpupool.dask.report(client)                # decisions and statistics per worker

A Dask worker starts at most ``nthreads`` tasks at once, so give GPU workers
as many threads as the widest pool should run (``--nthreads``); the pool then
decides, by memory, how many of them really run, and holds the others back.

Annotations the executor reads (the worker keeps them on the task):

``gpupool_peak``
    the task's estimated device peak (``"6GiB"`` or bytes), used until a
    task of the same key has been measured (:meth:`GpuPoolExecutor.options`).
``gpupool_key``
    the ask key the task is priced under; by default the Dask key's prefix
    (``key_split``: ``"compile_entry"`` for ``compile_entry-<token>``).

``import gpupool`` never imports this module, nor ``distributed``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import click
import distributed.worker
from dask.sizeof import sizeof
from dask.utils import key_split
from distributed.core import error_message
from distributed.diagnostics.plugin import WorkerPlugin

from gpupool._child.dask import run_task
from gpupool._errors import ConfigurationError
from gpupool._integration import check_pool_keywords, jsonable
from gpupool._integration import pool_report as _pool_report

#: What Dask's worker hands an executor that is not a thread pool; a future
#: distributed without it still works, its tasks reaching the pool unchanged.
_RUN_TASK_SIMPLE: Callable[..., Any] | None = getattr(distributed.worker, "_run_task_simple", None)

if TYPE_CHECKING:
    from distributed import Client, Worker

    from gpupool._pool.executor import GpuPoolExecutor
    from gpupool.testing import SimulatedHost

__all__ = [
    "PEAK_ANNOTATION",
    "KEY_ANNOTATION",
    "DaskGpuExecutor",
    "GpuPoolPlugin",
    "dask_setup",
    "pool_report",
    "register",
    "report",
    "unregister",
]

logger = logging.getLogger("gpupool")

#: The annotation carrying a task's device-peak hint.
PEAK_ANNOTATION = "gpupool_peak"

#: The annotation naming the ask key a task is priced under.
KEY_ANNOTATION = "gpupool_key"

#: Executor names the worker itself owns.
_RESERVED = frozenset({"default", "offload", "actor"})

_DAEMONIC = (
    "worker {address} runs in a daemonic process (a nanny's default), which may not start "
    "the pool's worker processes. Start the cluster with the Dask setting "
    "distributed.worker.daemon = False: dask.config.set({{'distributed.worker.daemon': False}}) "
    "before LocalCluster(...), or DASK_DISTRIBUTED__WORKER__DAEMON=False in the environment "
    "of `dask worker`."
)

#: Seconds a teardown waits for running tasks before terminating the pool's workers.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def _plugin_name(name: str) -> str:
    return f"gpupool-{name}"


class _LinkedFuture(Future[Any]):
    """The future Dask awaits; cancelling it cancels the pool's task while that has not started.

    It completes with the message Dask's worker expects from
    ``_run_task_simple`` once the pool's future (``inner``) is done.
    """

    def __init__(self, inner: Future[Any], delay: float, submitted: float) -> None:
        super().__init__()
        self._inner = inner
        self._delay = delay
        self._submitted = submitted
        self._cancelling = False

    def cancel(self) -> bool:
        """Cancel the pool's task too; ``False`` once it runs (a process cannot be stopped)."""
        self._cancelling = True
        if self._inner.cancel():
            return super().cancel()
        self._cancelling = False
        if self._inner.done():  # it finished while this call looked: settle it here
            self.complete(self._inner)
        return False

    def complete(self, inner: Future[Any]) -> None:
        """Settle with the pool's outcome (a done callback of ``inner``)."""
        if not self._cancelling and not self.done():
            _complete(self, self._delay, self._submitted, inner)


def _settle(outer: Future[Any], message: dict[str, Any]) -> None:
    """Give Dask its message unless the future was cancelled meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        outer.set_result(message)


def _failure(exc: BaseException, start: float, stop: float) -> dict[str, Any]:
    """Dask's task-erred message for ``exc``, with the child's traceback in the text."""
    message: dict[str, Any] = dict(error_message(exc))
    message["traceback_text"] = "".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__)
    )
    message.update(
        op="task-erred",
        actual_exception=exc,
        start=start,
        stop=stop,
        thread=threading.get_ident(),
    )
    return message


def _complete(outer: Future[Any], delay: float, submitted: float, inner: Future[Any]) -> None:
    """Turn the pool's future into the message Dask's worker expects from ``_run_task_simple``."""
    if inner.cancelled():
        # The pool shut down (plugin removed, worker closing) or Dask cancelled the
        # task before it started: an erred message, which a cancelled task ignores.
        cancelled = concurrent.futures.CancelledError(
            "the gpupool pool cancelled this task before it started "
            "(the task was cancelled, or the pool shut down)"
        )
        _settle(outer, _failure(cancelled, submitted + delay, time.time() + delay))
        return
    exc = inner.exception()
    if exc is not None:
        _settle(outer, _failure(exc, submitted + delay, time.time() + delay))
        return
    result, start, stop = inner.result()
    _settle(
        outer,
        {
            "op": "task-finished",
            "status": "OK",
            "result": result,
            "nbytes": sizeof(result),
            "type": type(result) if result is not None else None,
            "start": start + delay,
            "stop": stop + delay,
            "thread": threading.get_ident(),
        },
    )


class DaskGpuExecutor(concurrent.futures.Executor):
    """The executor a worker holds under the plugin's name: Dask's tasks, priced by the pool.

    Dask's worker calls ``submit(_run_task_simple, run_spec, data, delay)``
    (through ``loop.run_in_executor``). This executor runs the task itself in
    the pool instead, so that a device out-of-memory error reaches the pool
    (which retries it narrower) rather than being caught in the child, prices
    it under its annotations (``gpupool_peak``, ``gpupool_key``), and returns
    the message Dask expects. Any other callable goes to the pool unchanged.

    Args:
        pool: the worker's pool.
        worker: the Dask worker, whose task states carry the annotations.
        host: the simulated host the plugin entered, if any (a testing aid).
    """

    def __init__(
        self, pool: GpuPoolExecutor, worker: Worker, host: SimulatedHost | None = None
    ) -> None:
        self.pool = pool
        self.worker = worker
        self.host = host
        self._running: dict[str, _LinkedFuture] = {}
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run a Dask task in the pool (or, for any other callable, ``pool.submit``).

        Raises:
            ConfigurationError: a ``gpupool_peak`` annotation is not a size, or
                ``gpupool_key`` is not a str (the task errs with it).
            RuntimeError: the pool was shut down.
        """
        if _RUN_TASK_SIMPLE is None or fn is not _RUN_TASK_SIMPLE or len(args) != 3 or kwargs:
            return self.pool.submit(fn, *args, **kwargs)
        task, data, delay = args
        key = getattr(task, "key", None)
        annotations = self._annotations(key)
        ask_key = annotations.get(KEY_ANNOTATION)
        if ask_key is None:
            ask_key = key_split(key) if key is not None else None
        view = self.pool.options(key=ask_key, task_peak=annotations.get(PEAK_ANNOTATION))
        submitted = time.time()
        inner = view.submit(run_task, task, data)
        outer = _LinkedFuture(inner, float(delay), submitted)
        if key is not None:
            with self._lock:
                self._running[str(key)] = outer
            outer.add_done_callback(partial(self._forget, str(key)))
        inner.add_done_callback(outer.complete)
        return outer

    def _annotations(self, key: Any) -> Mapping[str, Any]:
        if key is None:
            return {}
        state = getattr(self.worker, "state", None)
        ts = getattr(state, "tasks", {}).get(key) if state is not None else None
        annotations = getattr(ts, "annotations", None)
        return annotations if isinstance(annotations, Mapping) else {}

    def _forget(self, key: str, future: Future[Any]) -> None:
        with self._lock:
            if self._running.get(key) is future:
                del self._running[key]

    def cancel(self, key: Any) -> bool:
        """Cancel the pool's task for Dask key ``key`` if it has not started.

        Returns:
            Whether a task was cancelled before it started.
        """
        with self._lock:
            outer = self._running.get(str(key))
        return outer is not None and outer._inner.cancel()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Shut the pool down (Dask's worker calls this when it closes)."""
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class GpuPoolPlugin(WorkerPlugin):
    """A worker plugin: one :class:`~gpupool.GpuPoolExecutor` per worker, as a named executor.

    On each worker, :meth:`setup` takes the census on that worker's machine,
    builds the pool and puts it in ``worker.executors[name]``; :meth:`teardown`
    removes it and shuts the pool down. Register it with :func:`register` or
    ``client.register_plugin(GpuPoolPlugin(...))``: workers that join later
    get it too.

    Args:
        name: the executor's name, as in ``dask.annotate(executor=name)``.
            The plugin itself is registered as ``"gpupool-<name>"``.
        simulate: a testing aid: called with the worker in its own process,
            it returns a :class:`gpupool.testing.SimulatedHost` (or ``None``)
            that the plugin enters before the census and leaves at teardown,
            so each worker can have its own simulated cards. Pass a function
            that builds the host (a host object does not pickle).
        shutdown_timeout: seconds a teardown waits for running tasks before
            terminating the pool's workers.
        **executor_kwargs: :class:`~gpupool.GpuPoolExecutor`'s parameters
            (``task_peak``, ``max_workers``, ``log_path``, ``env``,
            ``devices``, ...). ``max_workers`` defaults to the worker's
            ``nthreads``, the most tasks Dask hands it at once.

    Raises:
        ConfigurationError: the name is one the worker owns, or a keyword is
            not a parameter of ``GpuPoolExecutor``.
    """

    idempotent = False

    def __init__(
        self,
        name: str = "gpu",
        *,
        simulate: Callable[[Worker], SimulatedHost | None] | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        **executor_kwargs: Any,
    ) -> None:
        if not isinstance(name, str) or not name or name in _RESERVED:
            raise ConfigurationError(
                f"name={name!r}: pick an executor name the worker does not own "
                f"(not one of {sorted(_RESERVED)}), such as 'gpu'."
            )
        check_pool_keywords(executor_kwargs)
        if simulate is not None and not callable(simulate):
            raise ConfigurationError(
                "simulate must be a function of the worker returning a SimulatedHost "
                "(a SimulatedHost object itself does not pickle)."
            )
        self.executor_name = name
        self.name = _plugin_name(name)
        self.simulate = simulate
        self.shutdown_timeout = float(shutdown_timeout)
        self.executor_kwargs = dict(executor_kwargs)
        self._executor: DaskGpuExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_executor"] = None
        return state

    def setup(self, worker: Worker) -> None:
        """Take the census on this worker's machine, build the pool, register it as an executor.

        Raises:
            ConfigurationError: a pool parameter is wrong (the registration
                fails on the client with it).
        """
        from gpupool._pool.executor import GpuPoolExecutor

        if multiprocessing.current_process().daemon:
            raise ConfigurationError(_DAEMONIC.format(address=worker.address))
        host = self.simulate(worker) if self.simulate is not None else None
        if host is not None:
            host.__enter__()
        try:
            kwargs = dict(self.executor_kwargs)
            if kwargs.get("max_workers") is None:
                kwargs["max_workers"] = max(1, int(worker.state.nthreads))
            elif kwargs["max_workers"] > worker.state.nthreads:
                logger.warning(
                    "gpupool.dask: max_workers=%s on a worker with nthreads=%s: Dask starts "
                    "at most nthreads tasks at once, so the pool never runs more.",
                    kwargs["max_workers"],
                    worker.state.nthreads,
                )
            pool = GpuPoolExecutor(**kwargs)
        except BaseException:
            if host is not None:
                host.__exit__(None, None, None)
            raise
        self._executor = DaskGpuExecutor(pool, worker, host)
        worker.executors[self.executor_name] = self._executor
        logger.info(
            "gpupool.dask: executor %r on worker %s, width %d",
            self.executor_name,
            worker.address,
            pool.width,
        )

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """When Dask cancels an executing task, cancel it in the pool if it has not started."""
        if start == "executing" and finish in ("cancelled", "released") and self._executor:
            self._executor.cancel(key)

    async def teardown(self, worker: Worker) -> None:
        """Remove the executor, cancel what has not started, and shut the pool down."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        if worker.executors.get(self.executor_name) is executor:
            del worker.executors[self.executor_name]
        pool = executor.pool
        try:
            pool.shutdown(wait=False, cancel_futures=True)
            if not await _joined(pool, self.shutdown_timeout):
                logger.warning(
                    "gpupool.dask: tasks still running %.0f s after teardown began; "
                    "terminating the pool's workers",
                    self.shutdown_timeout,
                )
                pool.terminate_workers()
                if not await _joined(pool, _TERMINATE_GRACE_S):
                    logger.warning("gpupool.dask: workers ignored SIGTERM; killing them")
                    pool.kill_workers()
                    await _joined(pool, _TERMINATE_GRACE_S)
        except BaseException:
            # Cancelled or failed teardown: leave no worker behind.
            pool.kill_workers()
            raise
        finally:
            # Only now, with the workers gone, may the simulated ledger go.
            if executor.host is not None:
                executor.host.__exit__(None, None, None)


#: How long teardown waits after SIGTERM before it sends SIGKILL.
_TERMINATE_GRACE_S = 5.0


async def _joined(pool: GpuPoolExecutor, timeout_s: float) -> bool:
    """Wait (off the event loop) up to ``timeout_s`` for the pool to finish shutting down."""
    try:
        await asyncio.wait_for(asyncio.to_thread(pool.shutdown), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def register(client: Client, name: str = "gpu", **kwargs: Any) -> GpuPoolPlugin:
    """Register a :class:`GpuPoolPlugin` on every worker of ``client``'s cluster.

    Workers that join later are set up too. Registering the same name again
    replaces the pools (each is torn down first).

    Args:
        client: a connected ``distributed.Client``.
        name: the executor's name (``dask.annotate(executor=name)``).
        **kwargs: :class:`GpuPoolPlugin`'s keywords and
            :class:`~gpupool.GpuPoolExecutor`'s parameters.

    Returns:
        The plugin that was registered.

    Raises:
        ConfigurationError: a parameter is wrong (here, or in a worker's pool).
    """
    plugin = GpuPoolPlugin(name, **kwargs)
    client.register_plugin(plugin)
    return plugin


def unregister(client: Client, name: str = "gpu") -> None:
    """Remove the plugin from every worker; each pool shuts down (see ``teardown``)."""
    client.unregister_worker_plugin(_plugin_name(name))  # type: ignore[no-untyped-call]


def pool_report(dask_worker: Worker, name: str = "gpu") -> dict[str, Any]:
    """This worker's pool: census, width, decisions and statistics, as a JSON-able dict.

    Meant for ``client.run(gpupool.dask.pool_report)`` (Dask passes the
    worker as ``dask_worker``); :func:`report` does that for you.

    Args:
        dask_worker: the worker.
        name: the executor's name.

    Returns:
        ``worker``, ``worker_name``, ``executor``, ``width``, ``census`` (the
        cards and host as measured at setup), ``decisions`` (each a decision
        log record), ``statistics``; and ``simulated`` (each device's total
        and peak, and ``out_of_memory_events``) when the plugin runs on a
        simulated host, else ``None``.

    Raises:
        ConfigurationError: the worker has no gpupool executor of that name.
    """
    executor = dask_worker.executors.get(name)
    if not isinstance(executor, DaskGpuExecutor):
        raise ConfigurationError(
            f"worker {dask_worker.address} has no gpupool executor named {name!r}; "
            "register one with gpupool.dask.register(client, name=...)."
        )
    return {
        "worker": dask_worker.address,
        "worker_name": jsonable(dask_worker.name),
        "executor": name,
        **_pool_report(executor.pool, executor.host),
    }


def report(client: Client, name: str = "gpu") -> dict[str, dict[str, Any]]:
    """:func:`pool_report` from every worker, by worker address."""
    reports: dict[str, dict[str, Any]] = client.run(pool_report, name=name)
    return reports


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--gpupool-name", default="gpu", show_default=True, help="executor name")
@click.option("--gpupool-task-peak", default=None, help="estimated device peak of one task")
@click.option("--gpupool-max-workers", type=int, default=None, help="width ceiling")
@click.option("--gpupool-log-path", default=None, help="JSON Lines decision log")
def dask_setup(
    worker: Worker,
    gpupool_name: str,
    gpupool_task_peak: str | None,
    gpupool_max_workers: int | None,
    gpupool_log_path: str | None,
) -> Any:
    """Preload entry point: ``dask worker ADDRESS --preload gpupool.dask --gpupool-task-peak 6GiB``.

    Sets the plugin up on this worker alone, from its own command line (a
    client-side :func:`register` does the same for every worker at once).
    """
    kwargs: dict[str, Any] = {}
    if gpupool_task_peak is not None:
        kwargs["task_peak"] = gpupool_task_peak
    if gpupool_max_workers is not None:
        kwargs["max_workers"] = gpupool_max_workers
    if gpupool_log_path is not None:
        kwargs["log_path"] = gpupool_log_path
    return worker.plugin_add(GpuPoolPlugin(gpupool_name, **kwargs), catch_errors=False)
