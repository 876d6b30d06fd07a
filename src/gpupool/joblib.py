"""gpupool as a joblib backend: ``Parallel`` on a memory-priced GPU pool.

Install with the ``joblib`` extra (``pip install gpupool[joblib]``).
Importing this module registers the backend under the name ``"gpupool"``
(:func:`register` does it again, under another name if you like)::

    import joblib
    import gpupool.joblib  # registers the "gpupool" backend

    with joblib.parallel_config(backend="gpupool", n_jobs=4, task_peak="6GiB"):
        artefacts = joblib.Parallel()(joblib.delayed(compile_entry)(e) for e in entries)

Every keyword of ``parallel_config`` that is not joblib's own is a
:class:`~gpupool.GpuPoolExecutor` parameter (``task_peak``, ``reserve``,
``devices``, ``log_path``, ``env``, ...); ``n_jobs`` is the pool's
``max_workers`` (``-1``, the default: the pool's own default; ``-2``: all
CPUs but one, as in joblib). Each ``Parallel`` call builds its pool (its
census taken then) and shuts it down at the end; pass ``executor=`` a pool of
your own to keep one pool, and what it learned, across calls.

``import gpupool`` never imports this module, nor ``joblib``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from joblib import cpu_count, register_parallel_backend
from joblib.parallel import ParallelBackendBase

from gpupool._errors import ConfigurationError

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor

__all__ = ["BACKEND_NAME", "GpuPoolBackend", "register"]

#: The name :func:`register` gives the backend by default.
BACKEND_NAME = "gpupool"

#: The fewest concurrent calls the backend reports to joblib, which runs a
#: ``Parallel`` of one job in the calling process instead of the backend.
_MIN_REPORTED_JOBS = 2


def _pool_parameters() -> frozenset[str]:
    from gpupool._pool.executor import GpuPoolExecutor

    parameters = inspect.signature(GpuPoolExecutor.__init__).parameters
    return frozenset(name for name in parameters if name not in ("self", "max_workers"))


def max_workers_for(n_jobs: int | None) -> int | None:
    """The pool's ``max_workers`` for joblib's ``n_jobs``: ``None`` (the pool's default)
    for ``None`` and ``-1``, ``cpu_count() + 1 + n_jobs`` (at least 1) below ``-1``.

    Raises:
        ValueError: ``n_jobs`` is 0 or not an int.
    """
    if n_jobs is None or n_jobs == -1:
        return None
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int):
        raise ValueError(f"n_jobs={n_jobs!r}: pass a positive int, or -1 for the pool's default.")
    if n_jobs == 0:
        raise ValueError(
            "n_jobs == 0 in Parallel has no meaning: pass a positive int, or -1 for the "
            "pool's default."
        )
    if n_jobs < 0:
        return max(int(cpu_count()) + 1 + n_jobs, 1)
    return n_jobs


def _task_key(batch: object) -> str | None:
    """The ask key of a joblib batch: its function's name when all its calls share one."""
    from gpupool._pool.dispatcher import callable_name

    items = getattr(batch, "items", None)
    if not isinstance(items, list) or not items:
        return None
    names = {callable_name(item[0]) for item in items if isinstance(item, tuple) and item}
    return names.pop() if len(names) == 1 else None


class GpuPoolBackend(ParallelBackendBase):  # type: ignore[misc]  # joblib is untyped
    """joblib's ``Parallel`` on a :class:`~gpupool.GpuPoolExecutor`.

    Each joblib task (a batch of ``delayed`` calls, one call unless
    ``Parallel`` is given a ``batch_size``) is one pool task, priced under
    its function's name, so a ``Parallel`` over ``compile_entry`` learns
    ``compile_entry``'s ask. joblib's ``n_jobs`` is the pool's ceiling,
    never a promise: the pool runs as many calls at once as the cards'
    memory holds, up to it. ``n_jobs=1`` still runs in the pool (a worker
    process, priced on the card), never in the calling process.

    Args:
        nesting_level: joblib's, set by joblib.
        inner_max_num_threads: the thread count of the workers' OpenMP, BLAS
            and similar pools: joblib's variables (``OMP_NUM_THREADS``, ...) in
            the pool's ``env``, where ``env`` does not set them already.
        executor: a pool of your own to run on; the backend never shuts it
            down, and it then takes no pool parameters.
        **pool_kwargs: :class:`~gpupool.GpuPoolExecutor`'s parameters, but
            ``max_workers`` (that is ``n_jobs``).

    Raises:
        ConfigurationError: a keyword is not a pool parameter, is
            ``max_workers``, or comes with ``executor``.
    """

    default_n_jobs = -1
    supports_retrieve_callback = True
    supports_inner_max_num_threads = True
    supports_sharedmem = False
    uses_threads = False

    def __init__(
        self,
        nesting_level: int | None = None,
        inner_max_num_threads: int | None = None,
        *,
        executor: GpuPoolExecutor | None = None,
        **pool_kwargs: Any,
    ) -> None:
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        _check_max_workers(pool_kwargs)
        unknown = sorted(set(pool_kwargs) - _pool_parameters())
        if unknown:
            raise ConfigurationError(
                f"{', '.join(unknown)}: not a parameter of GpuPoolExecutor "
                f"(it takes {', '.join(sorted(_pool_parameters()))})."
            )
        if executor is not None:
            from gpupool._pool.executor import GpuPoolExecutor

            if not isinstance(executor, GpuPoolExecutor):
                raise ConfigurationError(
                    f"executor={executor!r}: pass a GpuPoolExecutor, or leave executor out "
                    "and give the pool's parameters."
                )
            _check_no_pool_kwargs(pool_kwargs)
        self.executor = executor
        self.pool_kwargs = dict(pool_kwargs)
        self._pool: GpuPoolExecutor | None = None
        self._futures: set[Future[Any]] = set()
        self._lock = threading.Lock()

    @property
    def pool(self) -> GpuPoolExecutor | None:
        """The pool tasks go to now: ``executor``, or the one the current call built."""
        return self.executor if self.executor is not None else self._pool

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """How many calls may run at once, as joblib counts them: the pool's
        ``max_workers``, but at least 2.

        joblib runs a ``Parallel`` whose backend answers 1 in the calling
        process; the pool's tasks must run in its workers, priced on the card,
        so a pool of one worker answers 2 (joblib then dispatches a few calls
        ahead, and the pool still runs one at a time).
        """
        pool = self.pool
        if pool is not None:
            return max(int(pool._max_workers), _MIN_REPORTED_JOBS)
        max_workers = max_workers_for(n_jobs)
        return max(max_workers if max_workers is not None else int(cpu_count()), _MIN_REPORTED_JOBS)

    def configure(
        self,
        n_jobs: int | None = -1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        **joblib_kwargs: Any,
    ) -> int:
        """Build the call's pool (unless ``executor`` was given); return its ``max_workers``.

        ``joblib_kwargs`` are the keywords given to ``Parallel`` itself: the
        pool's parameters among them (``Parallel(backend="gpupool",
        task_peak="6GiB")``) are used for this call's pool, over the
        backend's own; joblib's memmapping keywords (``max_nbytes``,
        ``mmap_mode``, ``temp_folder``) do not apply: arguments travel pickled.

        Raises:
            ConfigurationError: ``max_workers`` among them, or pool parameters
                beside ``executor``.
        """
        from gpupool._pool.executor import GpuPoolExecutor

        self.parallel = parallel
        _check_max_workers(joblib_kwargs)
        given = {k: v for k, v in joblib_kwargs.items() if k in _pool_parameters()}
        if self.executor is not None:
            _check_no_pool_kwargs(given)
        max_workers = max_workers_for(n_jobs)
        if self.executor is not None and self.inner_max_num_threads is not None:
            raise ConfigurationError(
                "inner_max_num_threads: given with executor=, whose workers are already "
                "configured; pass env={'OMP_NUM_THREADS': ...} where that pool is constructed."
            )
        if self.executor is None and self._pool is None:
            self._pool = GpuPoolExecutor(max_workers, **self._pool_kwargs(given))
        return self.effective_n_jobs(n_jobs)

    def _pool_kwargs(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The pool's parameters (``given`` over the backend's), with
        ``inner_max_num_threads`` as its threads' variables."""
        kwargs = {**self.pool_kwargs, **given}
        threads = self.inner_max_num_threads
        if threads is not None:
            given = kwargs.get("env") or {}
            limits = {name: str(threads) for name in self.MAX_NUM_THREADS_VARS}
            kwargs["env"] = {**limits, **given} if isinstance(given, Mapping) else given
        return kwargs

    def submit(self, func: Callable[[], Any], callback: Callable[..., Any] | None = None) -> Any:
        """Run one joblib batch in the pool, priced under its function's name."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("the gpupool joblib backend was used before joblib configured it")
        future = pool.options(key=_task_key(func)).submit(func)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._futures.discard(future)

    def retrieve_result_callback(self, future: Future[Any]) -> Any:
        """The batch's results, or its exception raised (with the child's traceback as cause)."""
        return future.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A call failed: its calls that have not started never start.

        When the backend built the pool and joblib will not reuse it
        (``ensure_ready=False``, a plain ``Parallel`` call), the running calls'
        workers are killed as well, as joblib's process backend does, so the
        error reaches the caller without waiting for them. Otherwise (a pool
        given as ``executor=``, or ``with Parallel(...)``) running calls
        finish and their results are dropped.
        """
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        if not ensure_ready and self.executor is None and self._pool is not None:
            self._pool.kill_workers()

    def terminate(self) -> None:
        """The call is over: shut the pool it built down (never a pool given as ``executor``)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _check_max_workers(kwargs: Mapping[str, Any]) -> None:
    if "max_workers" in kwargs:
        raise ConfigurationError(
            "max_workers: pass n_jobs to parallel_config or Parallel instead; it is the "
            "pool's max_workers (-1: the pool's default)."
        )


def _check_no_pool_kwargs(kwargs: Mapping[str, Any]) -> None:
    if kwargs:
        raise ConfigurationError(
            f"{', '.join(sorted(kwargs))}: given with executor=, whose pool is "
            "already built; set them where that pool is constructed."
        )


def register(name: str = BACKEND_NAME) -> None:
    """Register :class:`GpuPoolBackend` with joblib under ``name`` (``import gpupool.joblib``
    already registers it as ``"gpupool"``).

    Args:
        name: the backend name, as in ``joblib.parallel_config(backend=name)``.

    Raises:
        ConfigurationError: ``name`` is not a non-empty str.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name={name!r}: pass a non-empty backend name such as 'gpupool'.")
    register_parallel_backend(name, GpuPoolBackend)


register()
