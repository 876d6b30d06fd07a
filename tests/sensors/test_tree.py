"""A process's descendants and their host memory, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpupool._probe_tree import TreeWatch
from gpupool._sensors.host import read_ancestors
from gpupool._sensors.tree import (
    read_descendants,
    read_rss_high_water_of,
)

#: A child that starts a grandchild, prints both PIDs, and waits for stdin to close.
_PARENT = """
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
print(grandchild.pid, flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def test_children_and_grandchildren_are_descendants():
    """A child and the process it started are listed under this process, and know their line."""
    with subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        grandchild = int(child.stdout.readline())
        found = read_descendants(os.getpid())
        assert {child.pid, grandchild} <= set(found)
        assert os.getpid() not in found
        assert read_descendants(grandchild) == ()
        assert read_ancestors(grandchild)[:2] == (child.pid, os.getpid())
        assert (read_rss_high_water_of(child.pid) or 0) > 0
        child.stdin.close()
    assert child.pid not in read_descendants(os.getpid())


def _fake_process(proc: Path, pid: int, ppid: int, *, hwm_kib: int | None = None) -> None:
    (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (odd) name) S {ppid} 1 1 0\n")
    if hwm_kib is not None:
        (proc / str(pid) / "status").write_text(f"Name:\todd\nVmHWM:\t  {hwm_kib} kB\n")


def test_without_children_files_every_stat_is_scanned(tmp_path: Path):
    """On a kernel without /proc/<pid>/task/<tid>/children, the parents in every stat are used."""
    proc = tmp_path / "proc"
    _fake_process(proc, 10, 1)
    _fake_process(proc, 11, 10)
    _fake_process(proc, 12, 11, hwm_kib=2048)
    _fake_process(proc, 13, 1)
    assert sorted(read_descendants(10, proc)) == [11, 12]
    assert read_ancestors(12, proc) == (11, 10)
    assert read_rss_high_water_of(12, proc) == 2048 * 1024
    assert read_rss_high_water_of(11, proc) is None  # no status: not a figure
    assert read_rss_high_water_of(99, proc) is None  # gone


#: A child that starts a grandchild reading this child's stdin, prints its PID and waits
#: to be killed: killed, it leaves the grandchild re-parented away from the test.
_ORPHANING_PARENT = """
import signal, subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"])
print(grandchild.pid, flush=True)
signal.pause()
"""


def test_a_descendant_seen_in_the_window_stays_in_the_tree_when_orphaned():
    """A grandchild seen under this process stays a member, and is reported as left running,
    after its parent exits and it is re-parented away (``sh -c "cmd &"``, a launcher)."""
    watch = TreeWatch(os.getpid())
    watch.open()
    with subprocess.Popen(
        [sys.executable, "-c", _ORPHANING_PARENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        grandchild = int(child.stdout.readline())
        try:
            assert grandchild in watch.members()  # seen while its parent lives
            child.kill()
            child.wait()
            assert grandchild not in read_descendants(os.getpid())  # re-parented away
            assert grandchild in watch.members()
            summary = watch.close(None)
        finally:
            child.stdin.close()  # the grandchild reads the same pipe: it ends
    assert summary.outliving_pids == (grandchild,)
