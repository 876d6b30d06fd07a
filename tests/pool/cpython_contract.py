"""Run CPython's own ProcessPoolExecutor tests against GpuPoolExecutor (helpers).

The tests are Debian's ``libpython3.11-testsuite`` copy of CPython 3.11.2's
``Lib/test/test_concurrent_futures.py`` (a single file; 3.11.6+ split it into a
package, and pyenv's 3.11.7 ships neither). Nothing of it is copied into this
repository: the file is imported by path as the top-level module
``test_concurrent_futures`` and its mixins are subclassed with our executor
type, as its own ``create_executor_tests`` does for ``ProcessPoolExecutor``.

Workers must be able to re-import that module (tasks are module-level
functions of it, pickled by reference) and the module that defines the
generated test classes (``test_traceback`` submits a classmethod bound to
one). gpupool's workers are spawn children, whose preparation replaces the
child's ``sys.path`` with the parent's before it unpickles anything, so a
``PYTHONPATH`` passed with ``env=`` would be overwritten; the parent's
``sys.path`` is the carrier instead. :func:`importable` puts a private
directory holding a symlink to the file on it for the duration of the test
module, and takes it off again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

#: Where Debian's libpython3.11-testsuite installs CPython 3.11.2's tests.
CPYTHON_TESTS = Path("/usr/lib/python3.11/test/test_concurrent_futures.py")

#: The top-level name the file is imported under (workers import it by this name).
MODULE_NAME = "test_concurrent_futures"

#: What a task of these tests is priced at: far below the simulated card, so
#: the memory bound never narrows the pool below the tests' worker_count (5).
TASK_PEAK = "512MiB"


def unavailable_reason() -> str | None:
    """Why CPython's tests cannot run here, or ``None`` when they can."""
    if sys.version_info[:2] != (3, 11):
        return (
            "CPython's concurrent.futures tests on disk are 3.11.2's (Debian "
            "libpython3.11-testsuite); they need a 3.11 interpreter, this is "
            f"{sys.version_info.major}.{sys.version_info.minor}"
        )
    if not CPYTHON_TESTS.is_file():
        return (
            f"{CPYTHON_TESTS} is missing: install Debian's libpython3.11-testsuite "
            "(apt-get install libpython3.11-testsuite), as .ci/run does"
        )
    return None


def load() -> ModuleType:
    """CPython's test module, imported by path as the top-level ``test_concurrent_futures``.

    A worker that already imported it by name (through :func:`importable`'s
    directory) gets that module back, so both sides use one copy.
    """
    module = sys.modules.get(MODULE_NAME)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(MODULE_NAME, CPYTHON_TESTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module


@contextlib.contextmanager
def importable(*extra: str) -> Iterator[str]:
    """Make ``test_concurrent_futures`` (and the ``extra`` directories) importable by workers.

    Yields the private directory; on exit it, and any ``extra`` entry this
    added, leave ``sys.path`` again and the directory is removed.
    """
    with tempfile.TemporaryDirectory(prefix="gpupool-cpython-tests-") as directory:
        os.symlink(CPYTHON_TESTS, os.path.join(directory, f"{MODULE_NAME}.py"))
        added = [directory, *(p for p in extra if p not in sys.path)]
        sys.path[:0] = added
        try:
            yield directory
        finally:
            for entry in added:
                with contextlib.suppress(ValueError):
                    sys.path.remove(entry)


def simulated_host() -> SimulatedHost:
    """A host wide enough that neither bound narrows below the tests' ``worker_count`` (5).

    One 80 GiB card prices 512 MiB tasks far above 5; 16 CPUs and 128 GiB of
    RAM keep the host ceiling above 5 too (on a 2-core machine the real host
    would cap the pool at 2, which ``test_saturation``-style tests don't expect).
    """
    return SimulatedHost(
        devices=[SimulatedDevice(total="80GiB")],
        cpus=16,
        host_ram="128GiB",
        context="0MiB",
    )


class ContractExecutor(GpuPoolExecutor):
    """GpuPoolExecutor with what CPython's tests do not pass filled in (a ``task_peak``)."""

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Any = None,
        initargs: tuple[Any, ...] = (),
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("task_peak", TASK_PEAK)
        super().__init__(max_workers, mp_context, initializer, initargs, **kwargs)
