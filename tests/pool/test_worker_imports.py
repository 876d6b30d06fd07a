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
    """Its modules are imported then, and register exit hooks as CPython's pool module does,
    which threading refuses once the interpreter exits: the pool says so, in the words
    CPython's ``submit`` uses then, not threading's."""
    done = run_script(tmp_path, "first_pool_at_exit.py", AT_EXIT_SCRIPT, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "RuntimeError: cannot schedule new futures after interpreter shutdown"
    ), done.stdout
    assert "ran" not in done.stdout
