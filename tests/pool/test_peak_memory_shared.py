"""The memory of peaks as a team's nightly runs meet it: two pools on one file at once, a task's
code digest the same in every interpreter, a callable object's new version a new key, and a file
that cannot be written."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import predict_tasks
import pytest

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._pool.memory import (
    MAX_ENTRIES,
    PeakMemory,
    code_digest,
    forget_peaks,
    memory_path,
)

GiB = 1024**3
SPEC = "{:020d}".format


def keys_in(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    return sorted(str(entry["key"]).partition("@")[0] for entry in data["entries"])


def test_two_pools_running_at_once_both_keep_what_they_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both built before either ends, each measuring its own key: the file keeps both (the
    second to end used to write the file as it read it at construction, losing the first's)."""
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("GPUPOOL_MEMORY", str(path))
    with gt.SimulatedHost([gt.SimulatedDevice("32GiB")], cpus=8, host_ram="64GiB"):
        first = GpuPoolExecutor(max_workers=1, task_peak="4GiB")
        second = GpuPoolExecutor(max_workers=1, task_peak="4GiB")
        try:
            assert first.submit(predict_tasks.hold_spec, 0, SPEC(GiB)).result(timeout=120) == 0
            assert second.submit(predict_tasks.hold_items, 1, [1]).result(timeout=120) == 1
        finally:
            first.shutdown()
            second.shutdown()
    assert keys_in(path) == ["predict_tasks.hold_items", "predict_tasks.hold_spec"]


SET_TASK = """
from gpupool._pool.memory import (
    MAX_ENTRIES,
    PeakMemory,
    code_digest,
    forget_peaks,
    memory_path,
)
def task(x, mode):
    if mode in {"alpha", "beta", "gamma", "delta", "epsilon"}:
        return x
    return -x
print(code_digest(task))
"""


def test_a_task_s_digest_is_the_same_in_every_interpreter() -> None:
    """A set literal compiles to a frozenset constant whose repr follows the strings' hashes,
    which each interpreter seeds anew: the digest (and so the remembered key) changed from run
    to run, and such a task was never recalled."""
    source = SET_TASK
    digests = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", source], env=env, capture_output=True, text=True, check=True
        )
        digests.add(done.stdout.strip())
    assert len(digests) == 1 and "" not in digests, digests


def test_a_callable_object_s_new_version_is_a_new_key() -> None:
    """A task given as an instance with ``__call__`` is keyed by its class's code: a changed
    ``__call__`` is a new key (it had no digest, so every version shared one price)."""
    namespace: dict[str, object] = {}
    exec("class Step:\n    def __call__(self, x):\n        return x + 1\n", namespace)
    before = code_digest(namespace["Step"]())  # type: ignore[operator]
    exec("class Step:\n    def __call__(self, x):\n        return x + 2\n", namespace)
    after = code_digest(namespace["Step"]())  # type: ignore[operator]
    assert before and after and before != after
    assert code_digest(namespace["Step"]) == ""  # type: ignore[arg-type]


def test_a_changed_default_is_a_new_version() -> None:
    """``def task(x, scale=2)`` changed to ``scale=3`` holds other memory: a new key. A default
    that is an object (whose repr holds its address) keys by its type, the same every run."""
    namespace: dict[str, object] = {}
    digests = []
    for source in (
        "def task(x, scale=2, *, mode='fp16'):\n    return x * scale\n",
        "def task(x, scale=3, *, mode='fp16'):\n    return x * scale\n",
        "def task(x, scale=2, *, mode='fp32'):\n    return x * scale\n",
        "def task(x, scale=2, *, mode='fp16'):\n    return x * scale\n",
    ):
        exec(source, namespace)
        digests.append(code_digest(namespace["task"]))  # type: ignore[arg-type]
    assert len(set(digests[:3])) == 3 and digests[0] == digests[3], digests
    objects = []
    for _ in range(2):
        exec("def task(x, model=object(), big=10**5000):\n    return x\n", namespace)
        objects.append(code_digest(namespace["task"]))  # type: ignore[arg-type]
    assert objects[0] == objects[1] != ""


def test_a_pool_running_while_you_forget_writes_back_only_its_own_keys(tmp_path: Path) -> None:
    """The docs' promise: forgotten while a pool runs, another key's entry stays forgotten (the
    pool used to write back every entry it had read when it was built)."""
    path = tmp_path / "peaks.json"
    earlier = PeakMemory(path, ("Simulated GPU",))
    earlier.learned("pipeline.other@0", 3 * GiB, 4)
    earlier.save()
    running = PeakMemory(path, ("Simulated GPU",))
    assert running.recall("pipeline.other@0") == 3 * GiB
    assert forget_peaks(path) is True
    running.learned("pipeline.mine@0", GiB, 2)
    running.save()
    assert keys_in(path) == ["pipeline.mine"]


def test_a_fixed_width_pool_neither_reads_nor_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The docs' claim: ``width=`` pools leave the memory alone (an entry for the key there is
    not recalled, and the file is not rewritten)."""
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("GPUPOOL_MEMORY", str(path))
    name = f"predict_tasks.hold_spec@{code_digest(predict_tasks.hold_spec)}"
    earlier = PeakMemory(path, ("Simulated GPU",))
    earlier.learned(name, 3 * GiB, 4)
    earlier.save()
    before = path.read_bytes()
    with gt.SimulatedHost([gt.SimulatedDevice("16GiB")], cpus=4, host_ram="32GiB"):
        with GpuPoolExecutor(max_workers=2, width=2, task_peak="2GiB") as ex:
            assert ex.submit(predict_tasks.hold_spec, 0, SPEC(GiB)).result(timeout=120) == 0
            reasons = [d.reason for d in ex.decisions]
    assert not any("earlier run" in reason for reason in reasons)
    assert path.read_bytes() == before


def test_a_memory_that_cannot_be_written_loses_no_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``GPUPOOL_MEMORY`` under a plain file (as a read-only cache directory would): the tasks'
    results come back, and a warning says the peaks could not be remembered."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GPUPOOL_MEMORY", str(tmp_path / "file" / "peaks.json"))
    with gt.SimulatedHost([gt.SimulatedDevice("16GiB")], cpus=4, host_ram="32GiB"):
        with GpuPoolExecutor(max_workers=1, task_peak="2GiB") as ex:
            assert ex.submit(predict_tasks.hold_spec, 0, SPEC(GiB)).result(timeout=120) == 0
    assert any("could not remember" in record.getMessage() for record in caplog.records)


def save_keys(path: str, who: int) -> None:
    """One process's pools, one after another, each saving a key of its own."""
    for n in range(30):
        memory = PeakMemory(Path(path), ("Simulated GPU",))
        memory.learned(f"k{who}.{n}@0", GiB, 1)
        memory.save()


def test_pools_saving_at_the_same_moment_lose_no_key(tmp_path: Path) -> None:
    """Four processes saving 30 keys each into one file at once: all 120 kept (without the lock
    each read-merge-write raced the others', and 20-50 % of the keys were lost)."""
    path = tmp_path / "peaks.json"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.starmap(save_keys, [(str(path), who) for who in range(4)])
    assert len(keys_in(path)) == 120


def test_a_relative_cache_home_is_ignored(tmp_path: Path) -> None:
    """The XDG spec: a relative ``XDG_CACHE_HOME`` is invalid, so the memory is ``~/.cache``'s,
    not one per working directory."""
    home = Path.home() / ".cache" / "gpupool" / "peaks.json"
    assert memory_path({"XDG_CACHE_HOME": "cache"}) == home
    assert memory_path({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "gpupool" / "peaks.json"


def test_a_hand_written_file_keeps_its_newest_entries(tmp_path: Path) -> None:
    """The docs' "2,048 entries kept (the newest)", for a file listed oldest first and holding a
    key twice: the newest 2,048 are kept (the first 2,048 listed were), and of a key listed twice
    the newer entry."""
    path = tmp_path / "peaks.json"
    listed = [
        {"key": f"k{n}@0", "model": "M", "peak_bytes": GiB, "samples": 1, "saved_s": float(n)}
        for n in range(MAX_ENTRIES + 60)
    ]
    listed.append({"key": "k9999@0", "model": "M", "peak_bytes": GiB, "samples": 1, "saved_s": 1e6})
    listed.append({**listed[-1], "peak_bytes": 2 * GiB, "saved_s": 5e5})
    path.write_text(json.dumps({"version": 1, "entries": listed}))
    memory = PeakMemory(path, ("M",))
    assert memory.recall("k60@0") is None and memory.recall("k61@0") == GiB  # 61 oldest go
    assert memory.recall(f"k{MAX_ENTRIES + 59}@0") == GiB
    assert memory.recall("k9999@0") == GiB


def test_a_memory_twice_the_truth_is_dropped_at_the_first_measurement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The docs' lower bound: a first measurement under half the remembered peak contradicts it
    (yesterday's inputs were larger): the key's estimate is its ``task_peak`` again, and the
    file holds this run's peak."""
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("GPUPOOL_MEMORY", str(path))
    name = f"predict_tasks.hold_spec@{code_digest(predict_tasks.hold_spec)}"
    earlier = PeakMemory(path, ("Simulated GPU",))
    earlier.learned(name, 6 * GiB, 4)
    earlier.save()
    with gt.SimulatedHost([gt.SimulatedDevice("16GiB")], cpus=4, host_ram="32GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="2GiB") as ex:
            futures = [ex.submit(predict_tasks.hold_spec, i, SPEC(GiB)) for i in range(2)]
            assert [f.result(timeout=120) for f in futures] == [0, 1]
            reasons = [d.reason for d in ex.decisions]
            estimate = ex.statistics().asks["predict_tasks.hold_spec"].estimate_bytes
    assert any("earlier run" in reason and "6.00 GiB" in reason for reason in reasons), reasons
    assert estimate == 2 * GiB  # the memory dropped: back to task_peak
    (entry,) = json.loads(path.read_text())["entries"]
    assert GiB < entry["peak_bytes"] < 2 * GiB
