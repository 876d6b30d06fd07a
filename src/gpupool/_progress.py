"""A progress bar over a pool's results, with its width and asks (optional extra ``progress``).

:func:`track` wraps any iterator of results (``executor.map(...)``, or
``as_completed`` over futures) and, when tqdm is installed and the bar is on,
shows on stderr how many results have come back, the pool's current width,
and each task key's ask with its basis::

    gpupool: 12/36 [00:01<00:02] width=2, ask entry=6.94 GiB measured

It reads the executor only through ``statistics()``, once per result: the
width and the asks come from one snapshot the pool's dispatcher thread
published, never from its live scheduler, and it does not import the pool
(nor loky). The bar is off when stderr is not a terminal,
unless asked for; without tqdm it is silent. Either way the results pass
through unchanged and in order.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from gpupool._core.units import format_size

if TYPE_CHECKING:
    from gpupool._pool.executor import GpuPoolExecutor

__all__ = ["describe_asks", "progress_enabled", "track"]

T = TypeVar("T")


class _Ask(Protocol):
    @property
    def ask_bytes(self) -> int: ...

    @property
    def basis(self) -> str: ...


class _Statistics(Protocol):
    @property
    def width(self) -> int: ...

    @property
    def asks(self) -> Mapping[str, Any]: ...


class _Observed(Protocol):
    """What :func:`track` reads of an executor (``GpuPoolExecutor`` has it)."""

    def statistics(self) -> _Statistics: ...


def progress_enabled(enabled: bool | None, stream: Any = None) -> bool:
    """Whether a bar should show: ``enabled`` if given, else whether ``stream`` is a terminal.

    Args:
        enabled: ``True`` or ``False`` to force; ``None`` for automatic.
        stream: the bar's stream (default: ``sys.stderr``).
    """
    if enabled is not None:
        return enabled
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False


#: The bar's line: the count, the bar, the times and the pool's terms.
_BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining} {postfix}"
#: The widest the bar's line grows, so that it never wraps an 80-column terminal.
_MAX_COLUMNS = 80
#: The most characters of the pool's terms after the bar.
_POSTFIX_CHARS = 40


def describe_asks(asks: Mapping[str, Any]) -> str:
    """The asks in a few characters: one key's ``"6.94 GiB measured"``, else the largest's."""
    if not asks:
        return ""
    if len(asks) == 1:
        (ask,) = asks.values()
        return f"ask {format_size(ask.ask_bytes)} {ask.basis}"
    largest = max(asks.values(), key=lambda a: a.ask_bytes)
    return f"{len(asks)} keys, largest ask {format_size(largest.ask_bytes)}"


def _failed(item: object) -> bool:
    """Whether ``item`` is a finished future that holds an exception."""
    if not isinstance(item, Future) or not item.done() or item.cancelled():
        return False
    return item.exception() is not None


def track(
    results: Iterable[T],
    *,
    total: int | None = None,
    executor: GpuPoolExecutor | None = None,
    enabled: bool | None = None,
    desc: str = "gpupool",
) -> Iterator[T]:
    """Yield ``results`` unchanged, showing a tqdm bar with failures, the width and the ask.

    ::

        futures = [ex.submit(work, item) for item in items]
        for future in gpupool.track(as_completed(futures), total=len(futures), executor=ex):
            ...

    Args:
        results: the results to pass through (consumed lazily); when they are
            futures (``as_completed``), the bar counts the failed ones.
        total: how many there will be, if known.
        executor: the pool to describe (its ``statistics()``: the width and
            the asks); ``None`` shows only the counts.
        enabled: ``True`` shows the bar even when stderr is not a terminal;
            ``False`` never; ``None`` (default) when stderr is a terminal.
        desc: the bar's label.

    Yields:
        Each result, in the order ``results`` gives them.
    """
    if not progress_enabled(enabled):
        yield from results
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from results
        return
    import shutil

    columns = min(_MAX_COLUMNS, shutil.get_terminal_size((_MAX_COLUMNS, 24)).columns)
    bar = tqdm(
        total=total,
        desc=desc,
        file=sys.stderr,
        unit="task",
        ncols=columns,
        bar_format=_BAR_FORMAT,
    )
    failed = 0
    try:
        for result in results:
            failed += _failed(result)
            terms = [f"failed {failed}"]
            if executor is not None:
                stats = executor.statistics()
                terms.append(f"width {stats.width}")
                asks = describe_asks(stats.asks)
                if asks:
                    terms.append(asks)
            bar.set_postfix_str(", ".join(terms)[:_POSTFIX_CHARS], refresh=False)
            bar.update(1)
            yield result
    finally:
        bar.close()
        # Stopping early must reach the pool's map (it cancels what has not started).
        close = getattr(results, "close", None)
        if callable(close):
            close()
