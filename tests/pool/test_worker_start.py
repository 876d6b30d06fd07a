"""How a worker starts: a fresh interpreter that loads what its task loop needs and nothing of
the parent's side, holds no descriptor of the parent's but its own, and leaves the parent's
multiprocessing settings as they were."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import start_tasks

from gpupool import GpuPoolExecutor, InitializerError
from gpupool.testing import SimulatedDevice, SimulatedHost

#: Modules only the parent needs: the planner and its pricing, the dispatcher, the decision
#: log, the census (its records and the host's readers), and the libraries the parent reads
#: processes and draws with. A worker importing any of them pays for it on every start.
PARENT_SIDE = (
    "gpupool._core.census",
    "gpupool._core.planner",
    "gpupool._core.policy",
    "gpupool._core.bound",
    "gpupool._core.events",
    "gpupool._pool.dispatcher",
    "gpupool._pool.executor",
    "gpupool._observe.log",
    "gpupool._sensors.host",
    "gpupool._core.host",
    "loky",
    "psutil",
    "rich",
)


@contextlib.contextmanager
def _where(path: str) -> Iterator[dict[str, Any]]:
    """A pool's options on a simulated card, or on the host (no card)."""
    if path == "card":
        with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=4, host_ram="16GiB"):
            yield {"task_peak": "1GiB"}
    else:
        yield {}


#: Modules a worker loads only when a task needs them: cloudpickle (a call, result or
#: exception that goes by value), the standard pool's module and what comes with it
#: (concurrent.futures, logging, traceback), the errors that are a BrokenProcessPool,
#: pathlib (the probe and the sensors read ``/proc`` without it), dataclasses with the
#: inspect and ast it loads (the worker's records are written out: most of its imports), and
#: numbers (what parses a size loads it: a worker parses none to start).
ON_FIRST_USE = (
    "cloudpickle",
    "concurrent.futures",
    "logging",
    "traceback",
    "gpupool._broken",
    "pathlib",
    "dataclasses",
    "inspect",
    "ast",
    "numbers",
)


#: What a worker has loaded, asked in a fresh interpreter whose script is ``-c`` code: a
#: worker imports the parent's script as its ``__mp_main__`` (pytest's own, where it was
#: started as the ``pytest`` command), and what that script imports is no part of a worker's
#: start. Prints, as JSON: what the first task by name found loaded, what a task by value
#: found, and the error of a task that raises (its type, its words, its cause's words).
_LOADED_SCRIPT = """
import contextlib, json, sys
if __name__ == "__main__":
    sys.path.insert(0, sys.argv[3])
    import start_tasks
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost
    names = tuple(json.loads(sys.argv[2]))
    if sys.argv[1] == "card":
        where = SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=4, host_ram="16GiB")
        options = {"task_peak": "1GiB"}
    else:
        where, options = contextlib.nullcontext(), {}
    with where, GpuPoolExecutor(max_workers=1, **options) as ex:
        first = ex.submit(start_tasks.loaded, names).result()
        by_value = ex.submit(lambda: start_tasks.loaded(names)).result()
        error = ex.submit(start_tasks.loaded, names, "no_such_module_here").exception()
    print(json.dumps([first, by_value, [type(error).__name__, str(error), str(error.__cause__)]]))
"""


def _loaded_in_a_worker(path: str, names: tuple[str, ...]) -> list[Any]:
    """:data:`_LOADED_SCRIPT`'s findings on ``path`` (``"card"`` or ``"host"``) for ``names``."""
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOADED_SCRIPT,
            path,
            json.dumps(names),
            str(Path(start_tasks.__file__).parent),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    found: list[Any] = json.loads(completed.stdout.splitlines()[-1])
    return found


@pytest.mark.parametrize("path", ["card", "host"])
def test_a_worker_starts_without_what_only_some_tasks_need(path: str) -> None:
    """A worker's first task by name, with a plain result, finds none of cloudpickle,
    concurrent.futures, logging, traceback, the BrokenProcessPool errors, pathlib, or
    dataclasses (with the inspect and ast it loads) loaded; a task by value loads cloudpickle
    there, and a task that raises comes back with its traceback (in a fresh interpreter)."""
    first, by_value, (kind, words, cause) = _loaded_in_a_worker(path, ON_FIRST_USE)
    assert first == []
    assert "cloudpickle" in by_value
    assert kind == "ModuleNotFoundError"
    assert "no_such_module_here" in words
    assert "start_tasks.py" in cause  # the worker's traceback, as text


@pytest.mark.parametrize("how", ["path", "files"])
def test_a_task_that_raises_where_nothing_imports_fails_with_its_own_error(how: str) -> None:
    """A task that raises after emptying ``sys.path``, or with every descriptor in use, fails
    with its own exception and its traceback, on a card (before: the worker's first failure
    imported traceback and cloudpickle, that import failed, and the worker died: the task
    failed with WorkerLostError)."""
    with _where("card") as options, GpuPoolExecutor(max_workers=1, **options) as ex:
        error = ex.submit(start_tasks.raise_where_nothing_imports, how).exception(timeout=120)
    assert isinstance(error, ValueError), repr(error)
    assert str(error).startswith("raised with")
    assert "start_tasks.py" in str(error.__cause__)  # the worker's traceback, as text
    assert "raise_where_nothing_imports" in str(error.__cause__)


def test_an_initializer_that_raises_where_nothing_imports_is_the_pools_cause() -> None:
    """An initializer that raises after emptying ``sys.path`` breaks the pool with its own
    exception as the cause (before: logging and traceback were imported after it raised,
    that import failed, and the worker died: no cause)."""
    with GpuPoolExecutor(
        max_workers=1, initializer=start_tasks.raise_where_nothing_imports, initargs=("path",)
    ) as ex:
        error = ex.submit(abs, -1).exception(timeout=120)
    assert isinstance(error, InitializerError), repr(error)
    assert isinstance(error.__cause__, ValueError), repr(error.__cause__)
    assert str(error.__cause__) == "raised with sys.path emptied"


#: A ``sitecustomize`` that records the text typing compiles (an audit hook on ``compile``
#: events): put on a worker's ``PYTHONPATH``, it runs before the worker
#: imports anything of gpupool.
_RECORD_COMPILES = """
import os, sys
COMPILED = []

def _record(event, args):
    # What typing compiles: a string annotation or bound made into a forward reference (a
    # named tuple's own code, which collections compiles, is the standard library's cost).
    if event != "compile":
        return  # (sys._getframe is audited too: asked only here)
    caller = sys._getframe().f_back  # none for the command line, compiled from C
    if caller is not None and os.path.basename(caller.f_code.co_filename) == "typing.py":
        source = args[0]
        COMPILED.append(source.decode() if isinstance(source, bytes) else str(source))

sys.addaudithook(_record)
"""

_COMPILED_SCRIPT = """
import contextlib, json, sys
if __name__ == "__main__":
    sys.path.insert(0, sys.argv[2])
    import start_tasks
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost
    if sys.argv[1] == "card":
        where = SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=4, host_ram="16GiB")
        options = {"task_peak": "1GiB"}
    else:
        where, options = contextlib.nullcontext(), {}
    with where, GpuPoolExecutor(max_workers=1, env={"PYTHONPATH": sys.argv[3]}, **options) as ex:
        print(json.dumps(ex.submit(start_tasks.compiled_at_start).result()))
"""


@pytest.mark.parametrize("path", ["card", "host"])
def test_a_worker_compiles_nothing_from_a_string_to_start(path: str, tmp_path: Path) -> None:
    """A worker's start compiles no text (a named tuple's or a typed dict's string
    annotations, a type variable's string bound: typing compiles each as it is made, and the
    first compile of a process costs a millisecond or more), on either path, in a fresh
    interpreter (before: 47 strings on a card, 11 on the host)."""
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(_RECORD_COMPILES)
    tasks_dir = str(Path(start_tasks.__file__).parent)
    completed = subprocess.run(
        [sys.executable, "-c", _COMPILED_SCRIPT, path, tasks_dir, str(boot)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout.splitlines()[-1]) == []


def test_a_worker_without_a_device_loads_no_sensor() -> None:
    """A worker on the host path (no card) loads neither a sensor's interface, its records,
    the tree's sensor view, the judging of a sensor's rows, nor json (the contexts file is the
    parent's to read), in a fresh interpreter."""
    sensor_side = (
        "gpupool._sensors.base",
        "gpupool._sensors.readings",
        "gpupool._child.tree_sensor",
        "gpupool._core.readings",
        "json",
    )
    first, _, _ = _loaded_in_a_worker("host", sensor_side)
    assert first == []


@pytest.mark.parametrize("path", ["card", "host"])
def test_a_worker_loads_nothing_of_the_parents_side(path: str) -> None:
    """A worker that ran a task has imported none of the planner, the dispatcher, the log,
    loky, psutil or rich; the same check sees a module the task imported."""
    with _where(path) as options, GpuPoolExecutor(max_workers=1, **options) as ex:
        assert ex.submit(start_tasks.loaded, PARENT_SIDE).result() == []
        assert ex.submit(start_tasks.loaded, PARENT_SIDE, "psutil").result() == ["psutil"]


def test_a_worker_holds_no_inheritable_descriptor_of_the_parent(tmp_path: Path) -> None:
    """A descriptor the parent made inheritable (as another library may) is closed in the
    worker: only the worker's own descriptors are passed to it."""
    marker = tmp_path / "parent-only"
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT)
    try:
        os.set_inheritable(fd, True)
        with GpuPoolExecutor(max_workers=1) as ex:
            paths = ex.submit(start_tasks.open_paths).result()
    finally:
        os.close(fd)
    assert paths, "the worker listed none of its descriptors"
    assert str(marker) not in paths


def test_a_pool_leaves_the_default_start_method_unset() -> None:
    """After a pool ran, a program can still choose its start method: the pool neither set
    nor fixed multiprocessing's default context (run in a fresh interpreter)."""
    script = (
        "import multiprocessing\n"
        "from gpupool import GpuPoolExecutor\n"
        "if __name__ == '__main__':\n"
        "    with GpuPoolExecutor(max_workers=1) as ex:\n"
        "        assert ex.submit(abs, -2).result() == 2\n"
        "    print(multiprocessing.get_start_method(allow_none=True))\n"
        "    multiprocessing.set_start_method('forkserver')\n"
        "    print(multiprocessing.get_start_method())\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["None", "forkserver"]


_BOOT_DEATH_WITH_BIG_INITARGS = """
import concurrent.futures, os
from gpupool import GpuPoolExecutor, InitializerError

def init(blob):
    pass

if __name__ == "__main__":
    ex = GpuPoolExecutor(
        max_workers=1, env={{"PYTHONPATH": {boot!r}}}, initializer=init,
        initargs=(b"x" * {size_bytes},),
    )
    future = ex.submit(abs, -1)
    done, _ = concurrent.futures.wait([future], timeout=120)
    if not done:  # the pool would never answer: say so, and leave at once
        print("pending", flush=True)
        os._exit(1)
    print(type(future.exception()).__name__, flush=True)
    ex.shutdown()
"""


@pytest.mark.parametrize("size_bytes", [16, 4 * 2**20], ids=["small", "beyond-a-pipe"])
def test_a_worker_that_dies_before_reading_its_start_data_fails_like_any_boot_death(
    tmp_path: Path, size_bytes: int
) -> None:
    """A worker whose interpreter exits as it starts (a sitecustomize that exits) breaks
    the pool with InitializerError whatever the size of its start data (before: with
    initargs beyond a pipe's buffer, the parent kept the child's end of the pipe open
    while it wrote, and the pool hung for ever in that write)."""
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    script = _BOOT_DEATH_WITH_BIG_INITARGS.format(boot=str(boot), size_bytes=size_bytes)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert done.stdout.split() == ["InitializerError"]


def test_an_environment_the_kernel_refuses_fails_the_task_with_the_exec_error() -> None:
    """A variable beyond what ``execve`` takes (one string over 128 KiB on Linux) fails the
    task with the exec's own error, E2BIG (before: the pipe the child reports an exec
    failure on was closed in it before its exec, so the cause went unseen)."""
    with GpuPoolExecutor(max_workers=1, env={"HUGE": "a" * 2**18}) as ex:
        future = ex.submit(abs, -1)
        with pytest.raises(OSError, match="could not run") as caught:
            future.result(timeout=240)
    assert caught.value.errno == errno.E2BIG, caught.value


def test_a_worker_starts_when_the_parents_working_directory_was_removed(tmp_path: Path) -> None:
    """A program whose working directory was removed (a temporary directory cleaned up
    under it) still gets workers (before: every start failed in os.getcwd(), and every task
    with FileNotFoundError)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (
        "import os\n"
        "from gpupool import GpuPoolExecutor\n"
        "if __name__ == '__main__':\n"
        f"    os.chdir({str(gone)!r})\n"
        f"    os.rmdir({str(gone)!r})\n"
        "    with GpuPoolExecutor(max_workers=1) as ex:\n"
        "        print(ex.submit(abs, -2).result(timeout=120))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.split() == ["2"]


def test_initargs_that_cannot_be_pickled_break_the_pool_at_once() -> None:
    """initargs no worker can be sent (a thread lock) break the pool with InitializerError
    saying so, as an initializer that raises does, and no process is started (before: each
    task went through the start retries and failed alone with 'could not start a worker
    process', and the pool went on failing every task the same way)."""
    with GpuPoolExecutor(
        max_workers=1, initializer=start_tasks.loaded, initargs=(threading.Lock(),)
    ) as ex:
        future = ex.submit(abs, -1)
        with pytest.raises(InitializerError, match="cannot be sent to a worker process"):
            future.result(timeout=240)
        with pytest.raises(InitializerError):
            ex.submit(abs, -2)
        assert ex.statistics().workers_started == 0


def test_a_workers_rss_high_water_is_its_own_not_its_pools() -> None:
    """The host RSS a worker reports (which the host-RAM ceiling prices) is its own high-water,
    not its pool's process's: a parent that touched 256 MiB more than it held before runs a
    task on a simulated card, and the measurement's record states the worker's RSS, well
    under that (before: the worker's getrusage reported the high-water of the memory its
    exec replaced, the parent's, started by vfork: at least the 256 MiB)."""
    ballast = bytearray(256 * 2**20)
    ballast[::4096] = b"\x01" * len(range(0, len(ballast), 4096))  # every page resident
    parent_bytes = start_tasks.rss_high_water()
    assert parent_bytes is not None and parent_bytes >= len(ballast)
    with _where("card") as options, GpuPoolExecutor(max_workers=1, **options) as ex:
        worker_bytes = ex.submit(start_tasks.rss_high_water).result()
        records = [d for d in ex.decisions if d.event == "measured"]
    del ballast
    assert worker_bytes is not None and worker_bytes < parent_bytes - 128 * 2**20
    assert records, "no measured record"
    reported = records[0].extra["rss_peak_bytes"]
    assert isinstance(reported, int), records[0].extra
    # The probe's figure is the worker's own VmHWM, read after the task (it only grows).
    assert worker_bytes <= reported < parent_bytes - 128 * 2**20


def test_a_worker_compiles_the_out_of_memory_patterns_only_for_a_failure() -> None:
    """A worker that ran tasks that returned has not compiled the probe's out-of-memory
    patterns (some 1.5 ms of its start, before); once a task raised, it has, and a device
    out-of-memory is still recognised by its words."""
    with _where("card") as options, GpuPoolExecutor(max_workers=1, **options) as ex:
        assert ex.submit(start_tasks.oom_patterns_compiled).result() is False
        error = ex.submit(start_tasks.loaded, (), "no_such_module_here").exception()
        assert isinstance(error, ModuleNotFoundError)
        assert ex.submit(start_tasks.oom_patterns_compiled).result() is True
    from gpupool._child.probe import is_device_oom, oom_in_output

    assert is_device_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_oom(MemoryError("host memory"))
    assert oom_in_output("x\nRESOURCE_EXHAUSTED: Out of memory while trying to allocate\n")
