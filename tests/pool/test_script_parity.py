"""The script runs in workers as the standard spawn pool runs it (real processes).

Each script below is run as ``python script.py`` in a child process; it runs the same calls on
``ProcessPoolExecutor(mp_context=get_context("spawn"))`` and on gpupool (a simulated card) and
prints both pools' answers. Measured on the by-value design this replaced: an initializer's
class attribute read ``'parent'`` in tasks, a singleton loaded 10 times in 10 tasks, the
logging level 30 (stdlib 20), the decimal precision 28 (stdlib 50), and a task that starts a
``multiprocessing.Process`` on a script function failed with ``PicklingError``.
"""

from __future__ import annotations

import json
from pathlib import Path

from support import run_script

_BOTH_POOLS = """\
if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, initializer=init) as ex:
        standard = calls(ex)
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(1, task_peak="1GiB", initializer=init) as ex:
            ours = calls(ex)
    print(json.dumps({"standard": standard, "gpupool": ours}))
"""

PARITY_SCRIPT = (
    """\
import concurrent.futures
import decimal
import json
import logging
import multiprocessing
import os

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

# Top-level configuration, as a training script sets cudnn.benchmark or matmul precision.
logging.basicConfig(level=logging.INFO, format="%(message)s")
logging.getLogger("gpupool").setLevel(logging.WARNING)
decimal.getcontext().prec = 50
TOP_LEVEL_PID = os.getpid()  # the process that ran the script's top level


class Cfg:
    mode = "parent"


class Model:
    instance = None

    @classmethod
    def get(cls):
        if cls.instance is None:  # a singleton loaded once per worker
            # Counted in the process's environment, which outlives any copy of the class.
            os.environ["MODEL_LOADS"] = str(int(os.environ.get("MODEL_LOADS", "0")) + 1)
            cls.instance = object()
        return int(os.environ["MODEL_LOADS"])


class Point:
    def __init__(self, x):
        self.x = x


def init():
    Cfg.mode = "initializer"


def probe(_):
    return {
        "mode": Cfg.mode,
        "level": logging.getLogger().getEffectiveLevel(),
        "prec": decimal.getcontext().prec,
        "loads": Model.get(),
        "top_level_ran_here": TOP_LEVEL_PID == os.getpid(),
    }


def child_target(queue):
    queue.put(Cfg.mode)


def start_process(_):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child_target, args=(queue,))
    process.start()
    value = queue.get(timeout=120)
    process.join()
    return [value, process.exitcode]


def moved(point):
    return Point(point.x + 1)


def answer(fn, arg, ex):
    try:
        return ex.submit(fn, arg).result()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def calls(ex):
    point = answer(moved, Point(1), ex)
    return {
        "probes": list(ex.map(probe, range(10))),
        "process": answer(start_process, 0, ex),
        "point": [type(point).__name__, getattr(point, "x", None), type(point) is Point],
    }


"""
    + _BOTH_POOLS
)


def _both(tmp_path: Path, name: str, text: str) -> tuple[dict, dict]:
    done = run_script(tmp_path, name, text)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return results["standard"], results["gpupool"]


def test_the_script_runs_in_workers_as_the_spawn_pool_runs_it(tmp_path: Path):
    """Class state an initializer sets, top-level configuration (logging level, decimal
    precision), a singleton loaded once per worker, a script class returned, and a
    ``multiprocessing.Process`` a task starts on a script function: the same answers as the
    standard spawn pool's."""
    standard, ours = _both(tmp_path, "parity_script.py", PARITY_SCRIPT)
    expected_probe = {
        "mode": "initializer",
        "level": 20,
        "prec": 50,
        "loads": 1,
        "top_level_ran_here": True,
    }
    assert standard["probes"] == [expected_probe] * 10
    assert ours["probes"] == standard["probes"]
    # The process a task starts imports the script afresh: the class's own value.
    assert standard["process"] == ours["process"] == ["parent", 0]
    assert standard["point"] == ours["point"] == ["Point", 2, True]


BY_VALUE_SCRIPT = """\
import concurrent.futures
import json
import multiprocessing

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


class Counter:
    seen = 0


def init():
    Counter.seen = 100


def calls(ex):
    out = {}
    out["lambda"] = ex.submit(lambda: Counter.seen + 1).result()
    step = 5
    out["closure"] = ex.submit(lambda: Counter.seen + step).result()
    try:
        out["guarded"] = ex.submit(guarded, 1).result()
    except Exception as exc:
        out["guarded"] = type(exc).__name__
    return out


if __name__ == "__main__":
    def guarded(x):  # defined only under the guard: a worker's import does not define it
        Counter.seen += x
        return Counter.seen

    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(1, task_peak="1GiB", initializer=init) as ex:
            ours = calls(ex)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, initializer=init) as ex:
        try:
            standard = ex.submit(guarded, 1).result()
        except Exception as exc:
            standard = type(exc).__name__
    print(json.dumps({"standard": standard, "gpupool": ours}))
"""


def test_what_a_worker_cannot_import_goes_by_value_and_sees_the_workers_classes(tmp_path: Path):
    """A lambda, a closure and a function defined only under ``if __name__ == "__main__":``
    reach the worker by value (the standard pool cannot send the last at all), and read the
    worker's own script classes, with the state the initializer gave them."""
    standard, ours = _both(tmp_path, "by_value_script.py", BY_VALUE_SCRIPT)
    assert standard in ("AttributeError", "BrokenProcessPool")
    assert ours == {"lambda": 101, "closure": 105, "guarded": 101}


UNGUARDED_SCRIPT = """\
import os

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

print("top level ran in", os.getpid(), flush=True)
host = SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB")
host.__enter__()


class Cfg:
    mode = "parent"


def init():
    Cfg.mode = "initializer"


def read(x):
    return [x, Cfg.mode]


def main():
    with GpuPoolExecutor(1, task_peak="1GiB", initializer=init) as ex:
        return list(ex.map(read, range(3)))


print("results", main())  # no __main__ guard: the pool is made by the top level
"""


def test_a_script_without_a_main_guard_is_sent_by_value(tmp_path: Path):
    """A script whose top level makes a pool outside ``if __name__ == "__main__":`` (the
    standard spawn pool breaks on it) is not imported by its workers, which would run that
    top level again: its functions and classes go by value, as for ``python -c``, so the
    class state the initializer set is not the tasks' (a difference docs/compatibility.md
    states), and the top level runs once, in the parent."""
    done = run_script(tmp_path, "unguarded_script.py", UNGUARDED_SCRIPT, timeout_s=120)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert [line for line in lines if line.startswith("top level ran")] == lines[:1]
    assert lines[-1] == "results [[0, 'parent'], [1, 'parent'], [2, 'parent']]"


GUARD_IN_FUNCTION_SCRIPT = """\
import concurrent.futures
import multiprocessing

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


class Cfg:
    mode = "parent"


def init():
    Cfg.mode = "initializer"


def read(x):
    return [x, Cfg.mode]


def main():
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(1, task_peak="1GiB", initializer=init) as ex:
            return list(ex.map(read, range(2)))


if __name__ == "__main__":
    print("results", main())
"""


def test_a_pool_made_under_the_guard_through_a_function_imports_the_script(tmp_path: Path):
    """A pool made by a function the guarded block calls: the workers import the script,
    and the initializer's class state is the tasks'."""
    done = run_script(tmp_path, "guarded_script.py", GUARD_IN_FUNCTION_SCRIPT, timeout_s=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "results [[0, 'initializer'], [1, 'initializer']]"
    )


GUARDED_INITIALIZER_SCRIPT = """\
import json

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

MODEL = None


class Cfg:
    mode = "parent"


def predict(x):
    return [x, MODEL, Cfg.mode]


if __name__ == "__main__":
    def init(scale):  # defined only under the guard: it travels by value
        global MODEL
        MODEL = scale
        Cfg.mode = "initializer"

    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(1, task_peak="1GiB", initializer=init, initargs=(10,)) as ex:
            print(json.dumps(list(ex.map(predict, range(2)))))
"""


def test_an_initializer_defined_under_the_guard_sets_the_workers_globals(tmp_path: Path):
    """An initializer the worker cannot import (defined under the guard) goes by value, and
    the global and the class attribute it sets are the ones the script's imported tasks read."""
    done = run_script(tmp_path, "guarded_init.py", GUARDED_INITIALIZER_SCRIPT, timeout_s=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        [0, 10, "initializer"],
        [1, 10, "initializer"],
    ]


REFUSING_TOP_LEVEL_SCRIPT = """\
import concurrent.futures

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

if __name__ == "__mp_main__":
    raise RuntimeError("this script's top level refuses to run in a worker")


def inc(x):
    return x + 1


if __name__ == "__main__":
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(1, task_peak="1GiB") as ex:
            try:
                print(ex.submit(inc, 1).result(timeout=120))
            except Exception as exc:
                print("FAILED", type(exc).__name__, exc)
"""


def test_a_top_level_that_fails_in_workers_breaks_the_pool_naming_it(tmp_path: Path):
    """A script whose top level raises when a worker imports it: no task runs, the future
    fails with BrokenProcessPool (as the standard pool's would) whose message points at the
    script's top level, the worker's traceback is on stderr, and the script ends."""
    done = run_script(tmp_path, "refusing.py", REFUSING_TOP_LEVEL_SCRIPT, timeout_s=120)
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED BrokenProcessPool"), last
    assert "the script's top level" in last
    assert "refuses to run in a worker" in done.stderr


LEFT_AT_EXIT_SCRIPT = """\
import sys

from gpupool import GpuPoolExecutor


def work(x):
    return x * 10


def said(future):
    print("result", future.result(), flush=True)


if __name__ == "__main__":
    pool = GpuPoolExecutor(2, max_tasks_per_child=int(sys.argv[1]))
    pool.submit(abs, -1).result()  # a worker started while the script runs
    for x in range(6):
        pool.submit(work, x).add_done_callback(said)
    # No shutdown: the pool finishes its work at the interpreter's exit, as CPython's does.
"""


def test_work_a_script_leaves_at_its_end_runs_in_workers_started_after_it(tmp_path: Path):
    """CPython removes ``__main__.__file__`` as the script's body ends: workers started after
    that (at the interpreter's exit, for work submitted last) were not told to import the
    script, and every task of a script function they were sent failed to unpickle there
    (with ``max_tasks_per_child=1``, 0 of 6 ran; the standard pool runs them all). They import
    it as the others did."""
    for per_worker in ("1", "100"):
        done = run_script(tmp_path, "left_at_exit.py", LEFT_AT_EXIT_SCRIPT, per_worker)
        assert done.returncode == 0, done.stderr[-4000:]
        assert sorted(done.stdout.split()) == sorted(
            [
                "result",
                "result",
                "result",
                "result",
                "result",
                "result",
                *map(str, range(0, 60, 10)),
            ]
        ), (per_worker, done.stdout, done.stderr[-2000:])
