"""``gpupool forget [KEY]``: clears what pools remember of earlier runs, all of it or one task
key's, and says what it removed (a real pool writes the memory; the command runs as a user runs
it, in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import predict_tasks
import pytest
import sized_tasks

import gpupool.testing as gt
from gpupool import GpuPoolExecutor, forget_peaks

GiB = 1024**3


def remember_two_keys(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One run of two task keys, measured and remembered in ``path``."""
    with monkeypatch.context() as patch:
        patch.setenv("GPUPOOL_MEMORY", str(path))
        with gt.SimulatedHost([gt.SimulatedDevice("16GiB")], cpus=4, host_ram="32GiB"):
            with GpuPoolExecutor(max_workers=2, task_peak="4GiB") as ex:
                first = [ex.submit(predict_tasks.hold_spec, i, f"{GiB:020d}") for i in range(2)]
                second = [ex.submit(sized_tasks.hold_for_size, i, 0.5) for i in range(2)]
                assert [f.result(timeout=120) for f in first + second] == [0, 1, 0, 1]


def keys_in(path: Path) -> list[str]:
    return sorted(str(entry["key"]) for entry in json.loads(path.read_text())["entries"])


def gpupool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m gpupool ARGS`` in its own process (this tree's code first on the path)."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[2] / "src"), environ.get("PYTHONPATH", "")]
    )
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gpupool", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )


def test_forget_one_key_then_all_says_what_it_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a run of two functions: ``gpupool forget predict_tasks.hold_spec`` removes that
    function's entry only and names it with its card model and peak; ``gpupool forget`` then
    removes the rest and the file; a third call finds nothing, and exits 0."""
    path = tmp_path / "peaks.json"
    remember_two_keys(path, monkeypatch)
    before = keys_in(path)
    assert [key.rpartition("@")[0] for key in before] == [
        "predict_tasks.hold_spec",
        "sized_tasks.hold_for_size",
    ]

    one = gpupool("forget", "predict_tasks.hold_spec", "--file", str(path))
    assert one.returncode == 0, one.stderr
    assert f"forgot 1 remembered peak of predict_tasks.hold_spec in {path}:" in one.stdout
    assert before[0] in one.stdout and "on Simulated GPU: 1." in one.stdout
    assert "over 2 tasks" in one.stdout
    assert keys_in(path) == [before[1]]

    # The default file is GPUPOOL_MEMORY's, as for a pool.
    everything = gpupool("forget", "--json", env={"GPUPOOL_MEMORY": str(path)})
    assert everything.returncode == 0, everything.stderr
    said = json.loads(everything.stdout)
    assert said["path"] == str(path) and said["existed"] is True
    assert [entry["key"] for entry in said["removed"]] == [before[1]]
    assert not path.exists()

    again = gpupool("forget", "--file", str(path))
    assert again.returncode == 0 and "nothing remembered" in again.stdout


def test_forget_with_memory_off_and_a_hostile_file(tmp_path: Path) -> None:
    """With ``GPUPOOL_MEMORY=off`` it says there is nothing to forget; a file that is not one
    of peaks is left alone when only a key's entries were to go (exit 1, saying how to remove
    it), and removed by a plain ``forget``; ``forget_peaks(key=...)`` refuses it too."""
    off = gpupool("forget", env={"GPUPOOL_MEMORY": "off"})
    assert off.returncode == 0 and "remembering is off" in off.stdout
    path = tmp_path / "peaks.json"
    path.write_bytes(b"\xff not json")
    keyed = gpupool("forget", "some.key", "--file", str(path))
    assert keyed.returncode == 1
    assert "not a file of peaks; run gpupool forget without a key" in keyed.stderr
    assert path.exists()
    with pytest.raises(ValueError, match="not a file of peaks"):
        forget_peaks(path, key="some.key")
    whole = gpupool("forget", "--file", str(path))
    assert whole.returncode == 0 and "(not a file of peaks)" in whole.stdout
    assert not path.exists()


def test_odd_keys_and_names_from_a_hand_edited_file(tmp_path: Path) -> None:
    """A hand-edited file: an entry without a digest is not what ``forget ""`` names (it was
    removed, as its empty head matched), and a key or model with control characters is printed
    escaped (an escape sequence reached the terminal as it was)."""
    path = tmp_path / "peaks.json"
    entry = {"model": "M", "peak_bytes": GiB, "samples": 2, "saved_s": 1.0}
    entries = [{**entry, "key": "plain"}, {**entry, "key": "odd\nname@3", "model": "M\x1b[31m"}]
    path.write_text(json.dumps({"version": 1, "entries": entries}))
    empty = gpupool("forget", "", "--file", str(path))
    assert empty.returncode == 0 and "nothing remembered" in empty.stdout, empty
    assert keys_in(path) == ["odd\nname@3", "plain"]
    done = gpupool("forget", "--file", str(path))
    assert done.returncode == 0 and "odd\\nname@3 on M\\x1b[31m: 1.00 GiB" in done.stdout, done
    assert "\x1b" not in done.stdout and not path.exists()
