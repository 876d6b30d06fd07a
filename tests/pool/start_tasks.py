"""Task functions for the worker start-up tests: this module imports nothing of gpupool, so
what a worker has loaded is what its own start loaded."""

from __future__ import annotations

import importlib
import os
import sys


def loaded(names: tuple[str, ...], first: str | None = None) -> list[str]:
    """Which of ``names`` this process has imported (after importing ``first``, if given)."""
    if first is not None:
        importlib.import_module(first)
    return [name for name in names if name in sys.modules]


def open_paths(_: object = None) -> list[str]:
    """What each descriptor of this process refers to (``/proc/self/fd``)."""
    paths = []
    for name in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return paths


def raise_where_nothing_imports(how: str) -> None:
    """Raise ``ValueError`` where no module can be imported any more: ``"path"``, with
    ``sys.path`` emptied; ``"files"``, with every descriptor this process may open in use
    (held by this frame, so still while the worker sends the error back)."""
    if how == "path":
        sys.path[:] = []
        sys.path_importer_cache.clear()
        raise ValueError("raised with sys.path emptied")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, open_now + 64), hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        raise ValueError(f"raised with every descriptor in use ({len(held)} opened)") from exc


def rss_high_water() -> int | None:
    """This process's own resident-set high-water (``VmHWM``), in bytes."""
    with open("/proc/self/status", encoding="ascii") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def oom_patterns_compiled() -> bool:
    """Whether this worker compiled the probe's out-of-memory patterns."""
    from gpupool._child import probe

    return probe._OOM_PATTERNS._compiled is not None


def compiled_at_start() -> list[str]:
    """The text this worker compiled from a string before this task ran (``compile`` audit
    events with the file name ``<string>``: a string annotation that typing turned into a
    forward reference, as a named tuple's are), as the ``sitecustomize`` that
    ``tests/pool/test_worker_start.py`` puts on the worker's path recorded them."""
    import sitecustomize  # the test's, which installed the audit hook

    return list(sitecustomize.COMPILED)
