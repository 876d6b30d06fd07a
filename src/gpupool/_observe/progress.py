"""A progress bar over a pool's results, with its width and asks (optional extra ``progress``).

:func:`track` wraps any iterator of results (``executor.map(...)``, or
``as_completed`` over futures) and, when tqdm is installed and the bar is on,
shows how many results have come back, the failed ones, the pool's current
width, and the task key's ask with its basis::

    gpupool 12/36 |███      | 00:01<00:02, failed 0, width 2, ask 6.94 GiB measured

The bar is ``tqdm.auto``'s: a notebook widget in Jupyter (with ipywidgets),
text on stderr elsewhere. By default it shows where a user is looking: when
stderr is a terminal, or inside a Jupyter kernel (found as ``tqdm.auto``
finds one); elsewhere (a batch job, a pipe) only when asked for. While it
shows, the handlers that print the ``gpupool`` logger's lines to stderr or
stdout write through ``tqdm.write``, so a log line takes a line of its own
instead of breaking into the bar.

It reads the executor only through ``statistics()``, once per result: the
width and the asks come from one snapshot the pool's dispatcher thread
published, never from its live scheduler, and it does not import the pool
(nor loky). Without tqdm it is silent. Either way the results pass through
unchanged and in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from gpupool._core.units import format_size

if TYPE_CHECKING:  # a type only: the pool's module imports this one when a bar is asked for
    from gpupool._pool.executor import GpuPoolExecutor

__all__ = ["describe_asks", "progress_enabled", "track"]

T = TypeVar("T")


def progress_enabled(enabled: bool | None, stream: Any = None) -> bool:
    """Whether a bar should show: ``enabled`` if given, else whether a user is looking.

    A user is looking when ``stream`` is a terminal, or when this process is
    a Jupyter kernel (:func:`in_jupyter_kernel`).

    Args:
        enabled: ``True`` or ``False`` to force; ``None`` for automatic.
        stream: the bar's stream (default: ``sys.stderr``).
    """
    if enabled is not None:
        return enabled
    if in_jupyter_kernel():
        return True
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False


def in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel, by ``tqdm.autonotebook``'s own test.

    The kernel's shell module is loaded (``ipykernel.zmqshell``), or
    JupyterLite's; a Qt console or Spyder (``QT_API``, ``SPYDER*`` in the
    environment) counts as a console, as tqdm counts it.
    """
    if "ipykernel.zmqshell" in sys.modules:
        return not any(name == "QT_API" or name.startswith("SPYDER") for name in os.environ)
    return "IPython.utils._process_emscripten" in sys.modules


#: The bar's line: the count, the bar, the times and the pool's terms.
#: tqdm puts ", " before a non-empty ``{postfix}`` itself.
_BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
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
            ``False`` never; ``None`` (default) when stderr is a terminal or
            this process is a Jupyter kernel.
        desc: the bar's label.

    Yields:
        Each result, in the order ``results`` gives them.
    """
    bar_class = _bar_class() if progress_enabled(enabled) else None
    if bar_class is None:
        yield from results
        return
    bar = _open_bar(bar_class, total=total, desc=desc)
    failed = 0
    try:
        with _logs_through(bar_class):
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


def _bar_class() -> Any:
    """``tqdm.auto``'s bar (a notebook widget in Jupyter), or ``None`` without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


def _open_bar(bar_class: Any, *, total: int | None, desc: str) -> Any:
    """The bar on stderr; text bars within 80 columns (a notebook widget takes its cell's)."""
    import shutil

    notebook = any(c.__module__ == "tqdm.notebook" for c in bar_class.__mro__)
    columns = min(_MAX_COLUMNS, shutil.get_terminal_size((_MAX_COLUMNS, 24)).columns)
    return bar_class(
        total=total,
        desc=desc,
        file=sys.stderr,
        unit="task",
        ncols=None if notebook else columns,
        bar_format=_BAR_FORMAT,
    )


class _ThroughBar:
    """A stream that writes through ``tqdm.write``: the bar is cleared, the text written,
    the bar drawn again."""

    def __init__(self, bar_class: Any, stream: Any) -> None:
        self.bar_class = bar_class
        self.stream = stream

    def write(self, text: str) -> None:
        self.bar_class.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def _logs_through(bar_class: Any) -> Iterator[None]:
    """While a bar shows, the handlers that print ``gpupool``'s lines to stderr or stdout
    (on the logger or an ancestor it propagates to) write through ``tqdm.write``.

    Each handler keeps its level, filters and format; only its stream is
    swapped, and put back when the bar closes.
    """
    consoles = (sys.stderr, sys.stdout)
    swapped: list[tuple[logging.StreamHandler[Any], Any]] = []
    logger: logging.Logger | None = logging.getLogger("gpupool")
    while logger is not None:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and any(
                handler.stream is console for console in consoles
            ):
                old = handler.setStream(_ThroughBar(bar_class, handler.stream))
                swapped.append((handler, old))
        logger = logger.parent if logger.propagate else None
    try:
        yield
    finally:
        for handler, old in reversed(swapped):
            handler.setStream(old)
