"""What importing the pool's class costs a process that makes no pool (real processes).

A spawn worker imports the user's script, as the standard library's does, and a script
imports ``GpuPoolExecutor`` at its top level. Measured before the pool's machinery was
imported with the first pool instead (``bench/overhead.py --cold``): every worker of such
a script loaded the dispatcher, the planner and psutil again, some 150 ms of a 2-core
machine's time per worker start, and a script's first result took 3.1x the standard
pool's from a cold start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import run_script

#: The pool's machinery: what only a process that makes a pool needs.
MACHINERY = (
    "gpupool._pool.dispatcher",
    "gpupool._pool.options",
    "gpupool._pool.workers",
    "gpupool._core.planner",
    "gpupool._core.policy",
    "psutil",
    "cloudpickle",
)

_LOADED = f"sorted(m for m in {MACHINERY!r} if m in sys.modules)"

SCRIPT = f"""\
import json
import sys

from gpupool import GpuPoolExecutor, TaskOptions


def machinery_here(x):
    return x, {_LOADED}


if __name__ == "__main__":
    before = {_LOADED}
    with GpuPoolExecutor(1) as ex:
        answer, in_worker = ex.submit(machinery_here, 7).result()
    print(json.dumps({{"before": before, "parent": {_LOADED}, "worker": in_worker,
                      "answer": answer}}))
"""


def test_importing_the_class_loads_none_of_the_pools_machinery():
    code = f"import sys\nfrom gpupool import GpuPoolExecutor, TaskOptions\nprint({_LOADED})"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_a_worker_that_imports_the_script_loads_none_of_it_and_the_pool_still_runs(
    tmp_path: Path,
):
    done = run_script(tmp_path, "top_level_import.py", SCRIPT, timeout_s=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["answer"] == 7
    assert seen["before"] == []
    # Not vacuous: the process that made the pool loaded what the worker did not.
    assert set(seen["parent"]) >= {"gpupool._pool.dispatcher", "gpupool._core.planner"}
    assert seen["worker"] == []


AT_EXIT_SCRIPT = """\
import atexit

from gpupool import GpuPoolExecutor


def late():
    try:
        with GpuPoolExecutor(1) as ex:
            print("ran", ex.submit(abs, -1).result())
    except RuntimeError as exc:
        print("RuntimeError:", exc)


if __name__ == "__main__":
    atexit.register(late)
"""


def test_a_first_pool_made_as_the_interpreter_exits_is_refused_with_the_standard_words(
    tmp_path: Path,
):
    """Its modules are imported then, and CPython's pool module with them, which registers an
    exit hook as CPython's pool module does, which threading refuses once the interpreter
    exits: the pool says so, in the words CPython's ``submit`` uses then, not threading's."""
    done = run_script(tmp_path, "first_pool_at_exit.py", AT_EXIT_SCRIPT, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "RuntimeError: cannot schedule new futures after interpreter shutdown"
    ), done.stdout
    assert "ran" not in done.stdout


RELAY_AT_EXIT_SCRIPT = """\
import time

from gpupool import GpuPoolExecutor

# Imported after the pool's class: its exit hook runs before the pool's.
from concurrent.futures import ThreadPoolExecutor


def relay(pool, x):
    time.sleep(0.3)
    try:
        print("relayed", pool.submit(abs, -x).result(), flush=True)
    except RuntimeError as exc:
        print("refused:", exc, flush=True)


if __name__ == "__main__":
    pool = GpuPoolExecutor(1)
    pool.submit(abs, 0).result()
    threads = ThreadPoolExecutor(2)
    for x in range(3):
        threads.submit(relay, pool, x)
"""


def test_a_thread_pool_imported_before_the_first_pool_still_relays_to_it_at_exit(
    tmp_path: Path,
):
    """The pool's exit hook is registered as its class is imported, as before its machinery
    was imported with the first pool (and as CPython's pool module's is): threading runs the
    hooks last registered first, so a ``ThreadPoolExecutor`` whose module was imported after
    the class finishes its tasks, which submit to the pool, before the pool stops taking work.
    Registered with the first pool instead, the pool's hook ran first and refused them."""
    done = run_script(tmp_path, "relay_at_exit.py", RELAY_AT_EXIT_SCRIPT, timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["relayed 0", "relayed 1", "relayed 2"], done.stdout


FAILING_IMPORT_SCRIPT = """\
import sys

from gpupool import GpuPoolExecutor


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "gpupool._pool.options":
            raise RuntimeError("some library's own RuntimeError at import")
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, Refuse())
    try:
        GpuPoolExecutor(1)
    except RuntimeError as exc:
        print(type(exc).__name__, exc, sep=": ")
"""


def test_a_runtime_error_while_the_first_pool_imports_is_not_called_the_interpreters_exit(
    tmp_path: Path,
):
    """A ``RuntimeError`` (a ``RecursionError``: a first pool made deep in a recursion, whose
    imports need some 40 frames more than the class did) raised while the first pool imports
    its machinery, with the interpreter nowhere near its exit, reaches the caller as it is."""
    done = run_script(tmp_path, "failing_import.py", FAILING_IMPORT_SCRIPT, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "RuntimeError: some library's own RuntimeError at import", (
        done.stdout
    )
