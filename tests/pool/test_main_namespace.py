"""Functions of the script run as ``__main__`` share one namespace per worker, as the standard
pool's do: a global the initializer sets is read by the tasks, and one a task sets by the tasks
after it on that worker.

Each script runs in a child process two ways: as ``python script.py`` (the workers import it
as ``__mp_main__``, as the standard pool's do, and its functions go by name), where it runs the
same calls on the standard pool (spawn) and prints both pools' results; and as ``python -c``
(``by-value``: no file a worker could import, so its functions travel by value, and the
standard pool cannot run them at all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpupool._pool import by_value
from support import run_script

HOW = ["script", "by-value"]


def run_main(directory: Path, name: str, text: str, how: str, *args: str):
    """Run ``text`` as ``__main__``: as a script file, or (``by-value``) through ``python -c``,
    where ``__main__`` has no file for a worker to import."""
    if how == "script":
        return run_script(directory, name, text, *args)
    path = directory / name
    path.write_text(text)
    source = f"open({str(path)!r}).read(), {str(path)!r}, 'exec'"
    code = f"import sys; sys.argv[1:] = {list(args)!r}; exec(compile({source}))"
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_SIMULATOR"}
    env["TMPDIR"] = str(directory)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=directory,
    )


SCRIPT = """\
import concurrent.futures
import json
import multiprocessing
import sys

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

MODEL = None  # set by the initializer in each worker
COUNT = 0  # counted up by the tasks of each worker
LIMIT = 3  # rebound by the parent between submissions


def load(scale):
    return lambda x: x * scale


def init(scale):
    global MODEL
    MODEL = load(scale)


def predict(x):
    return MODEL(x)


def bump(_):
    global COUNT
    COUNT += 1
    return COUNT


def set_flag(value):
    global FLAG
    FLAG = value


def get_flag(_):
    return FLAG


def read_limit(_):
    return LIMIT


def calls(ex):
    global LIMIT
    predicted = [ex.submit(predict, i).result() for i in range(3)]
    counted = [ex.submit(bump, 0).result() for _ in range(3)]
    ex.submit(set_flag, "on").result()
    flag = ex.submit(get_flag, 0).result()
    LIMIT = 5
    return {"predicted": predicted, "counted": counted, "flag": flag,
            "limit": ex.submit(read_limit, 0).result()}


def run(where):
    options = dict(max_workers=1, initializer=init, initargs=(10,))
    if where == "card":
        with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
            with GpuPoolExecutor(task_peak="1GiB", **options) as ex:
                return calls(ex)
    with GpuPoolExecutor(**options) as ex:
        return calls(ex)


if __name__ == "__main__":
    standard = None
    if "__file__" in globals():  # the standard pool cannot run a ``python -c`` script's
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(mp_context=spawn, **dict(
            max_workers=1, initializer=init, initargs=(10,))) as ex:
            standard = calls(ex)
    LIMIT = 3
    print(json.dumps({"standard": standard, "gpupool": run(sys.argv[1])}))
"""


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("where", ["card", "host"])
def test_initializer_and_tasks_of_main_share_the_worker_namespace(
    tmp_path: Path, where: str, how: str
):
    """The initializer's global is the tasks' (as the standard pool's), and a global a task
    sets is read by the next task on that worker (as the standard pool's). A global the parent
    rebinds between submissions: a worker that imported the script reads the script's own
    value, as the standard pool's; sent by value, the function brings the parent's."""
    done = run_main(tmp_path, "main_namespace_script.py", textwrap.dedent(SCRIPT), how, where)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    standard, ours = results["standard"], results["gpupool"]
    if how == "by-value":
        standard = {"predicted": [0, 10, 20], "counted": [1, 2, 3], "flag": "on", "limit": 5}
    assert ours["predicted"] == standard["predicted"] == [0, 10, 20]
    assert ours["counted"] == standard["counted"] == [1, 2, 3]
    assert ours["flag"] == standard["flag"] == "on"
    assert ours["limit"] == standard["limit"] == (3 if how == "script" else 5)


# The end of the scripts below: the same calls on the standard pool (spawn) and on ours, on a
# simulated card, each with the script's ``init``; both pools' results printed as JSON.
_BOTH_POOLS_MAIN = """\
if __name__ == "__main__":
    standard = None
    if "__file__" in globals():  # the standard pool cannot run a ``python -c`` script's
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, initializer=init) as ex:
            standard = calls(ex)
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(1, task_peak="1GiB", initializer=init) as ex:
            ours = calls(ex)
    print(json.dumps({"standard": standard, "gpupool": ours}))
"""


DELETE_SCRIPT = (
    """\
import concurrent.futures
import json
import multiprocessing

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

DOOMED = 5  # deleted by the initializer in each worker
LATER = 7  # deleted by a task


def init():
    global DOOMED
    del DOOMED


def read_doomed(_):
    try:
        return DOOMED
    except NameError:
        return "NameError"


def read_later(_):
    try:
        return LATER
    except NameError:
        return "NameError"


def drop_later(_):
    global LATER
    del LATER


def calls(ex):
    first = ex.submit(read_doomed, 0).result()
    before = ex.submit(read_later, 0).result()
    ex.submit(drop_later, 0).result()
    return [first, before, ex.submit(read_later, 0).result(), ex.submit(read_doomed, 0).result()]


"""
    + _BOTH_POOLS_MAIN
)


@pytest.mark.parametrize("how", HOW)
def test_a_global_the_initializer_or_a_task_deletes_stays_deleted(tmp_path: Path, how: str):
    """A script's global deleted in the worker (by the initializer, by a task) is not put
    back by the next task sent with it: those tasks raise NameError, as the standard pool's."""
    done = run_main(tmp_path, "delete_script.py", DELETE_SCRIPT, how)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    expected = ["NameError", 7, "NameError", "NameError"]
    assert results["standard"] == (expected if how == "script" else None)
    assert results["gpupool"] == expected


CACHE_SCRIPT = (
    """\
import concurrent.futures
import json
import multiprocessing

from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost

CACHE = {}  # filled in place: by the initializer, then by the tasks
SEEN = []  # appended to by the tasks
SCALE = 2  # rebound by the parent between submissions
CONFIG = {"i": -1}  # rebound by the parent to a new dict before each submission


def init():
    CACHE["model"] = "loaded"
    CACHE["scale"] = SCALE


def read_config(_):
    return CONFIG["i"]


def remember(x):
    SEEN.append(x)
    CACHE.setdefault("first", x)
    return [CACHE.get("model"), CACHE["first"], list(SEEN)]


def scaled(x):
    return x * SCALE


def calls(ex):
    global SCALE, CONFIG
    remembered = [ex.submit(remember, x).result() for x in (1, 2, 3)]
    SCALE = 10  # read by the initializer too: rebound since it was sent
    first = ex.submit(scaled, 1).result()
    SCALE = 3
    second = ex.submit(scaled, 1).result()
    SCALE = 2
    configs = []
    for i in range(20):
        CONFIG = {"i": i}  # a new dict each time, often where the last one was
        configs.append(ex.submit(read_config, 0).result())
    return {"remembered": remembered, "scaled": [first, second], "configs": configs}


"""
    + _BOTH_POOLS_MAIN
)


@pytest.mark.parametrize("how", HOW)
def test_a_global_filled_in_place_in_the_worker_is_kept_as_the_standard_pool_keeps_it(
    tmp_path: Path, how: str
):
    """A script's dict the initializer fills, and a list the tasks append to, are the
    worker's from then on: every task sees what was put in them, as in the standard pool. A
    global the script rebinds between submissions: the script's own value where the worker
    imported it (as the standard pool's), the parent's when the function went by value."""
    done = run_main(tmp_path, "cache_script.py", CACHE_SCRIPT, how)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    standard, ours = results["standard"], results["gpupool"]
    expected = [["loaded", 1, [1]], ["loaded", 1, [1, 2]], ["loaded", 1, [1, 2, 3]]]
    assert ours["remembered"] == expected
    if how == "script":
        assert standard == ours
        assert (ours["scaled"], ours["configs"]) == ([2, 2], [-1] * 20)
    else:
        # Sent by value, each time the parent rebound it, wherever the new object lies.
        assert standard is None
        assert (ours["scaled"], ours["configs"]) == ([10, 3], list(range(20)))


def test_a_rebound_global_gets_a_new_version_even_where_the_last_one_lay():
    """The sender tells a global sent again unchanged from one rebound to a new object, even
    one created where the last one was freed (its ``id`` reused)."""
    first = {"i": 0}
    version = by_value._version("a_rebound_global", first)
    assert by_value._version("a_rebound_global", first) == version
    address = id(first)
    del first
    new = {"i": 1}
    for _ in range(10_000):
        if id(new) == address:
            break
        new = {"i": 1}
    assert by_value._version("a_rebound_global", new) != version
    assert by_value._version("a_rebound_global", new) == by_value._version("a_rebound_global", new)
