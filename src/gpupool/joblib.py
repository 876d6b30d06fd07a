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
``max_workers`` (``-1``: the pool's own default; ``-2``: all CPUs but one, as
in joblib; ``None`` and ``1``: the calling process, as in joblib). As joblib's
loky backend keeps one executor, the backend keeps the pool it builds for the
next ``Parallel`` call with the same options (see :func:`shutdown_pools`),
and caps the workers' BLAS and OpenMP threads at ``cpus // n_jobs``.

``import gpupool`` never imports this module, nor ``joblib``.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from joblib import cpu_count, register_parallel_backend
from joblib._parallel_backends import FallbackToBackend, SequentialBackend
from joblib.parallel import ParallelBackendBase

from gpupool._errors import ConfigurationError

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor

__all__ = ["BACKEND_NAME", "GpuPoolBackend", "register", "shutdown_pools"]

#: The name :func:`register` gives the backend by default.
BACKEND_NAME = "gpupool"

#: The fewest concurrent calls the backend reports to joblib for a pool given as
#: ``executor=``: joblib runs a ``Parallel`` of one job in the calling process.
_MIN_REPORTED_JOBS = 2

#: How many kept pools no call is using stay alive (the most recently used).
IDLE_POOLS_KEPT = 2

#: How long a kept pool no call is using lives on (loky's ``idle_worker_timeout``).
IDLE_POOL_TIMEOUT_S = 300.0


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


def _frozen(value: object) -> Hashable:
    """``value`` as a hashable key part (mappings and sequences by content); raises
    TypeError for a value that has none."""
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(_frozen(v) for v in value))
    if isinstance(value, os.PathLike):
        return ("path", os.fspath(value))
    hash(value)
    return value  # hash() checked it


def _pool_key(max_workers: int | None, kwargs: Mapping[str, Any]) -> Hashable | None:
    """What makes two calls' pools the same: the process, ``max_workers``, the pool's
    parameters and the ``GPUPOOL_*`` variables it reads; ``None`` where a parameter
    cannot be compared (such a call gets a pool of its own)."""
    environment = {k: v for k, v in os.environ.items() if k.startswith("GPUPOOL_")}
    try:
        return (os.getpid(), max_workers, _frozen(kwargs), _frozen(environment))
    except TypeError:
        return None


@dataclass(eq=False)
class _Kept:
    """A pool the backend keeps between calls, with the count of calls using it."""

    key: Hashable
    pool: GpuPoolExecutor
    users: int = 0
    idle_timer: threading.Timer | None = field(default=None, repr=False)


class _KeptPools:
    """The pools kept between ``Parallel`` calls, one per key (as loky's reusable executor).

    A pool is shut down only when no call uses it: past :data:`IDLE_POOLS_KEPT`
    idle pools, after :data:`IDLE_POOL_TIMEOUT_S` idle, by :func:`shutdown_pools`,
    or at interpreter exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[Hashable, _Kept] = {}  # oldest use first

    def acquire(self, key: Hashable, build: Callable[[], GpuPoolExecutor]) -> _Kept:
        """The key's live pool (built now if there is none), counted as used by one more call."""
        with self._lock:
            kept = self._kept.pop(key, None)
            dead: list[GpuPoolExecutor] = []
            if kept is not None and (kept.pool._shutdown or kept.pool._broken):
                if kept.users == 0:  # ended now; one in use ends at its last release
                    dead.append(self._forget_popped(kept))
                kept = None  # broken: build anew
            if kept is None:
                kept = _Kept(key, build())
            if kept.idle_timer is not None:
                kept.idle_timer.cancel()
                kept.idle_timer = None
            kept.users += 1
            self._kept[key] = kept  # most recently used last
            retired = dead + self._over_idle_limit()
        _shut(retired)
        return kept

    def release(self, kept: _Kept) -> None:
        """One call stopped using ``kept``'s pool; an idle pool is timed out, or the oldest
        idle ones beyond the limit shut down."""
        with self._lock:
            kept.users -= 1
            if kept.users > 0:
                return
            taken = self._kept.get(kept.key) is not kept  # by an abort, or broken: end it
            retired = [kept.pool] if taken else self._idle(kept)
        _shut(retired)

    def _idle(self, kept: _Kept) -> list[GpuPoolExecutor]:
        """``kept`` has no user now: time it out, and retire what is over the idle limit."""
        timer = threading.Timer(IDLE_POOL_TIMEOUT_S, self._time_out, args=(kept,))
        timer.daemon = True
        kept.idle_timer = timer
        timer.start()
        return self._over_idle_limit()

    def take_if_sole_user(self, kept: _Kept) -> bool:
        """Forget ``kept`` (no later call gets its pool) when the caller is its only user."""
        with self._lock:
            if kept.users != 1 or self._kept.get(kept.key) is not kept:
                return False
            del self._kept[kept.key]
            return True

    def _over_idle_limit(self) -> list[GpuPoolExecutor]:
        idle = [k for k in self._kept.values() if k.users == 0]
        retired = idle[: max(len(idle) - IDLE_POOLS_KEPT, 0)]
        return [self._forget(k) for k in retired]

    def _forget(self, kept: _Kept) -> GpuPoolExecutor:
        del self._kept[kept.key]
        return self._forget_popped(kept)

    @staticmethod
    def _forget_popped(kept: _Kept) -> GpuPoolExecutor:
        if kept.idle_timer is not None:
            kept.idle_timer.cancel()
        return kept.pool

    def _time_out(self, kept: _Kept) -> None:
        with self._lock:
            if kept.users > 0 or self._kept.get(kept.key) is not kept:
                return
            pool = self._forget(kept)
        _shut([pool])

    def forget_all(self) -> None:
        """In a forked child: the parent's pools are not this process's to use or end."""
        self._lock = threading.Lock()
        self._kept = {}

    def shutdown_idle(self, wait: bool) -> int:
        """Shut down every pool no call is using; the count shut down."""
        with self._lock:
            retired = [self._forget(k) for k in list(self._kept.values()) if k.users == 0]
        _shut(retired, wait=wait)
        return len(retired)


def _shut(pools: list[GpuPoolExecutor], wait: bool = True) -> None:
    for pool in pools:
        pool.shutdown(wait=wait, cancel_futures=True)


_KEPT = _KeptPools()


def shutdown_pools(wait: bool = True) -> int:
    """Shut down the pools the backend keeps between ``Parallel`` calls, but those
    a call is using now; return how many were shut down.

    The backend keeps the pool it built for a call (its workers, and the peaks
    it measured) for the next call with the same ``n_jobs`` and pool options,
    as joblib's loky backend keeps its executor. A kept pool is also shut down
    after 300 s with no call using it, when more than two are idle, and at
    interpreter exit; call this to let go of its workers (and the memory their
    CUDA contexts hold on the cards) sooner.

    Args:
        wait: wait for the pools' workers to exit.
    """
    return _KEPT.shutdown_idle(wait)


threading._register_atexit(lambda: _KEPT.shutdown_idle(wait=False))  # type: ignore[attr-defined]
os.register_at_fork(after_in_child=_KEPT.forget_all)


def _in_daemonic_process() -> bool:
    return bool(multiprocessing.current_process().daemon)


class GpuPoolBackend(ParallelBackendBase):  # type: ignore[misc]  # joblib is untyped
    """joblib's ``Parallel`` on a :class:`~gpupool.GpuPoolExecutor`.

    Each joblib task (a batch of ``delayed`` calls, one call unless
    ``Parallel`` is given a ``batch_size``) is one pool task, priced under
    its function's name, so a ``Parallel`` over ``compile_entry`` learns
    ``compile_entry``'s ask. joblib's ``n_jobs`` is the pool's ceiling,
    never a promise: the pool runs as many calls at once as the cards'
    memory holds, up to it. As with joblib's other backends, ``n_jobs=1``
    (and ``n_jobs=None`` outside a ``parallel_config`` that sets it) runs
    the calls in the calling process, and so does a call made inside a
    daemonic process (with a warning, as loky's backend gives).

    The pool built for a call is kept for the next call with the same options
    (see :func:`shutdown_pools`); a call never shuts down a pool another call
    is using. The workers' thread pools (OpenMP, BLAS, ...) are capped at
    ``cpus // n_jobs`` threads through joblib's variables, as joblib's loky
    backend does, unless ``inner_max_num_threads`` says otherwise, the
    calling process sets a variable already, or ``env`` sets it.

    Args:
        nesting_level: joblib's, set by joblib.
        inner_max_num_threads: the thread count of the workers' OpenMP, BLAS
            and similar pools, in place of ``cpus // n_jobs``.
        executor: a pool of your own to run on; the backend never shuts it
            down, and it then takes no pool parameters.
        **pool_kwargs: :class:`~gpupool.GpuPoolExecutor`'s parameters, but
            ``max_workers`` (that is ``n_jobs``).

    Raises:
        ConfigurationError: a keyword is not a pool parameter, is
            ``max_workers``, or comes with ``executor``.
    """

    default_n_jobs = 1
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
        # One entry per configured call not yet terminated, innermost last: a joblib
        # backend object is shared by every Parallel under one parallel_config, and
        # a call made while another is open (a managed ``with Parallel()``) must not
        # take the other's pool away when it ends.
        self._calls: list[_Kept | GpuPoolExecutor] = []
        self._futures: set[Future[Any]] = set()
        self._lock = threading.Lock()

    @property
    def pool(self) -> GpuPoolExecutor | None:
        """The pool tasks go to now: ``executor``, or the innermost open call's."""
        if self.executor is not None:
            return self.executor
        with self._lock:
            call = self._calls[-1] if self._calls else None
        return call.pool if isinstance(call, _Kept) else call

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """How many calls may run at once, as joblib counts them: the pool's
        ``max_workers``; 1 (the calling process) for ``n_jobs`` ``None`` or 1, or
        inside a daemonic process (with a warning, unless ``n_jobs`` is 1).

        A pool given as ``executor=`` always runs the calls, in its workers: a
        pool of one worker answers 2 (joblib then dispatches a few calls ahead,
        and the pool still runs one at a time).
        """
        if self.executor is not None:
            return max(int(self.executor._max_workers), _MIN_REPORTED_JOBS)
        if n_jobs == 0:
            raise ValueError(
                "n_jobs == 0 in Parallel has no meaning: pass a positive int, or -1 for "
                "the pool's default."
            )
        if n_jobs is None:
            return 1
        if _in_daemonic_process():
            if n_jobs != 1:
                warnings.warn(
                    "gpupool-backed parallel loops cannot start workers in a daemonic "
                    "process (such as a multiprocessing.Pool worker): setting n_jobs=1",
                    UserWarning,
                    stacklevel=3,
                )
            return 1
        max_workers = max_workers_for(n_jobs)
        return max_workers if max_workers is not None else int(cpu_count())

    def configure(
        self,
        n_jobs: int | None = 1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        **joblib_kwargs: Any,
    ) -> int:
        """Take the call's pool: ``executor``, a kept one with the same options, or
        a new one; return its ``max_workers``. Where joblib's contract runs the
        calls in the calling process (``n_jobs`` 1 or ``None``, a daemonic
        process), hand the call to joblib's sequential backend instead.

        ``joblib_kwargs`` are the keywords given to ``Parallel`` itself: the
        pool's parameters among them (``Parallel(backend="gpupool",
        task_peak="6GiB")``) are used for this call's pool, over the
        backend's own; joblib's memmapping keywords (``max_nbytes``,
        ``mmap_mode``, ``temp_folder``) do not apply: arguments travel pickled.

        Raises:
            ConfigurationError: ``max_workers`` among them, or pool parameters
                beside ``executor``.
        """
        self.parallel = parallel
        _check_max_workers(joblib_kwargs)
        given = {k: v for k, v in joblib_kwargs.items() if k in _pool_parameters()}
        if self.executor is not None:
            _check_no_pool_kwargs(given)
            if self.inner_max_num_threads is not None:
                raise ConfigurationError(
                    "inner_max_num_threads: given with executor=, whose workers are already "
                    "configured; pass env={'OMP_NUM_THREADS': ...} where that pool is "
                    "constructed."
                )
            return self.effective_n_jobs(n_jobs)
        effective = self.effective_n_jobs(n_jobs)
        if effective == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        max_workers = max_workers_for(n_jobs)
        call = self._take_pool(max_workers, self._pool_kwargs(given, effective))
        with self._lock:
            self._calls.append(call)
        pool = call.pool if isinstance(call, _Kept) else call
        return max(int(pool._max_workers), 1)

    @staticmethod
    def _take_pool(max_workers: int | None, kwargs: dict[str, Any]) -> _Kept | GpuPoolExecutor:
        from gpupool._pool.executor import GpuPoolExecutor

        key = _pool_key(max_workers, kwargs)
        if key is None:  # a parameter that cannot be compared: a pool for this call only
            return GpuPoolExecutor(max_workers, **kwargs)
        return _KEPT.acquire(key, lambda: GpuPoolExecutor(max_workers, **kwargs))

    def _pool_kwargs(self, given: Mapping[str, Any], n_jobs: int) -> dict[str, Any]:
        """The pool's parameters (``given`` over the backend's), with the workers'
        thread caps (:meth:`thread_limits`) under ``env``'s own variables."""
        kwargs = {**self.pool_kwargs, **given}
        env = kwargs.get("env") or {}
        if isinstance(env, Mapping):  # otherwise the pool refuses it, naming env
            kwargs["env"] = {**self.thread_limits(n_jobs), **env}
        return kwargs

    def thread_limits(self, n_jobs: int) -> dict[str, str]:
        """The workers' thread variables, as joblib's loky backend sets them: each of
        joblib's ``MAX_NUM_THREADS_VARS`` at ``inner_max_num_threads`` if given, else
        at the calling process's value, else at ``cpus // n_jobs`` (at least 1); and
        TBB's ``ENABLE_IPC=1`` unless the calling process sets it."""
        default_threads = max(int(cpu_count()) // max(n_jobs, 1), 1)
        limits: dict[str, str] = {}
        for name in self.MAX_NUM_THREADS_VARS:
            if self.inner_max_num_threads is not None:
                limits[name] = str(self.inner_max_num_threads)
            else:
                limits[name] = os.environ.get(name, str(default_threads))
        if self.TBB_ENABLE_IPC_VAR not in os.environ:
            limits[self.TBB_ENABLE_IPC_VAR] = "1"
        return limits

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

        When joblib will not reuse the backend (``ensure_ready=False``, a plain
        ``Parallel`` call) and no other call is using its pool, the running
        calls' workers are killed as well, as joblib's process backend does,
        so the error reaches the caller without waiting for them (the pool is
        then not kept). Otherwise (a pool given as ``executor=``, one another
        call is using, or ``with Parallel(...)``) running calls finish and
        their results are dropped.
        """
        with self._lock:
            futures = list(self._futures)
            call = self._calls[-1] if self._calls else None
        for future in futures:
            future.cancel()
        if ensure_ready or self.executor is not None or call is None:
            return
        if isinstance(call, _Kept):
            if _KEPT.take_if_sole_user(call):
                call.pool.kill_workers()
        else:
            call.kill_workers()

    def terminate(self) -> None:
        """The call is over: its pool is kept for the next call (a pool built for this
        call alone is shut down; a pool given as ``executor`` never is)."""
        with self._lock:
            call = self._calls.pop() if self._calls else None
        if isinstance(call, _Kept):
            _KEPT.release(call)
        elif call is not None:
            call.shutdown(wait=True, cancel_futures=True)


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
    """Register ``GpuPoolBackend`` with joblib under ``name`` (``import gpupool.joblib``
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
