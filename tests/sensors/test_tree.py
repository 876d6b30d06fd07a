"""A process's descendants and their host memory, read from /proc."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool._child.probe_tree import TreeSummary, TreeWatch
from gpupool._sensors.host import read_ancestors
from gpupool._sensors.tree import (
    read_descendants,
    read_rss_high_water_of,
)
from support import answered_in_a_fork

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


@contextlib.contextmanager
def _orphaned(script: str) -> Iterator[tuple[TreeWatch, subprocess.Popen[str], int]]:
    """Open a window and run ``script``, which prints the PID of a process it started; see
    that process in the tree, then kill ``script``'s own process, which leaves it
    re-parented away. Yields the watch, the killed child (its stdin open) and that PID;
    closing the child's stdin at the end ends what it started."""
    watch = TreeWatch(os.getpid())
    watch.open()
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        pid = int(child.stdout.readline())
        try:
            assert pid in watch.members()  # seen while its parent lives
            child.kill()
            child.wait()
            assert pid not in read_descendants(os.getpid())  # re-parented away
            yield watch, child, pid
        finally:
            child.stdin.close()  # what it started reads the same pipe: it ends


def test_a_descendant_seen_in_the_window_stays_in_the_tree_when_orphaned():
    """A grandchild seen under this process stays a member, and is reported as left running,
    after its parent exits and it is re-parented away (``sh -c "cmd &"``, a launcher)."""
    with _orphaned(_ORPHANING_PARENT) as (watch, _child, grandchild):
        assert grandchild in watch.members()
        summary = watch.close(None)
    assert summary.outliving_pids == (grandchild,)


#: A launcher: given a line on stdin, it starts a process of its own, prints its PID, and
#: waits for stdin to close (its process reads the same stdin).
_LAUNCHER = (
    "import subprocess, sys\n"
    "sys.stdin.readline()\n"
    "started = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'])\n"
    "print(started.pid, flush=True)\n"
    "sys.stdin.read()\n"
)

#: A child that starts the launcher, prints its PID, and waits for a signal.
_LAUNCHING_PARENT = f"""
import signal, subprocess, sys
launcher = subprocess.Popen([sys.executable, "-c", {_LAUNCHER!r}])
print(launcher.pid, flush=True)
signal.pause()
"""


def test_a_process_an_orphaned_descendant_starts_is_in_the_tree():
    """A launcher seen under this process is re-parented away, then starts a process (as
    ``nohup torchrun`` does): that process is a member too, and is reported as left running."""
    with _orphaned(_LAUNCHING_PARENT) as (watch, child, launcher):
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        started = int(child.stdout.readline())  # by the launcher, once orphaned
        assert started in watch.members()
        summary = watch.close(None)
    assert summary.outliving_pids == tuple(sorted((launcher, started)))


#: Fake PIDs above Linux's PID_MAX_LIMIT (2**22): no real process has them.
_ROOT, _CHILD = 5_000_010, 5_000_011


def _fake_root(proc: Path, children: str = "") -> Path:
    """A fake root process whose only thread's ``children`` file lists ``children``."""
    (proc / str(_ROOT) / "task" / str(_ROOT)).mkdir(parents=True)
    listing = proc / str(_ROOT) / "task" / str(_ROOT) / "children"
    listing.write_text(children)
    return listing


def _fifo_status(proc: Path, pid: int) -> Path:
    """``pid``'s ``status`` as a FIFO: whoever reads it waits until the test writes it."""
    (proc / str(pid)).mkdir(parents=True)
    status = proc / str(pid) / "status"
    os.mkfifo(status)
    return status


def _open_when_read(fifo: Path) -> int:
    """Open ``fifo`` to write once a reader has opened it: the sampler is then in flight."""
    opened: list[int] = []
    opener = threading.Thread(target=lambda: opened.append(os.open(fifo, os.O_WRONLY)))
    opener.start()
    opener.join(120)
    if not opened:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the opener go
        opener.join()
        raise AssertionError("the sampler never read the tree while the window was open")
    return opened[0]


def _finish(fd: int, text: str) -> None:
    """Give the reader of a FIFO opened by :func:`_open_when_read` its text, and end it."""
    os.write(fd, text.encode())
    os.close(fd)


def test_one_sampler_thread_serves_every_window(tmp_path: Path):
    """Many windows, one sampler thread: it is started with the first window and kept."""

    def samplers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "gpupool-tree"}

    _fake_root(tmp_path)
    watch = TreeWatch(_ROOT, proc=tmp_path)
    before = samplers()  # other watches' samplers, ending or not
    for _ in range(200):
        watch.open()
        summary = watch.close(None)
        assert summary.descendants == 0 and summary.rss_peak_bytes is None
    assert len(samplers() - before) == 1


def test_a_sample_in_flight_when_the_window_closes_counts_in_it(tmp_path: Path):
    """A descendant only the sampler saw (started and gone between the window's opening and
    its closing) counts in the window: closing waits for the sample in flight."""
    listing = _fake_root(tmp_path)
    status = _fifo_status(tmp_path, _CHILD)
    watch = TreeWatch(_ROOT, proc=tmp_path)
    watch.open()
    assert _closed_over_a_child_only_the_sampler_saw(watch, listing, status) == 4096 * 1024


def _closed_over_a_child_only_the_sampler_saw(
    watch: TreeWatch, listing: Path, status: Path
) -> int | None:
    """In ``watch``'s open window, a child appears (its sampler finds it and waits on its
    status), is gone before the window closes, and its status says 4 MiB only then: the
    RSS peak the closed window sums."""
    listing.write_text(str(_CHILD))
    fd = _open_when_read(status)
    listing.write_text("")
    summaries: list[TreeSummary] = []
    closing = threading.Thread(target=lambda: summaries.append(watch.close(None)))
    closing.start()
    _finish(fd, "Name:\tchild\nVmHWM:\t  4096 kB\n")
    closing.join()
    return summaries[0].rss_peak_bytes


def test_a_sample_taken_for_one_window_never_counts_in_the_next(tmp_path: Path):
    """A sample in flight when the next window opens is dropped: that window never saw it."""
    listing = _fake_root(tmp_path)
    status = _fifo_status(tmp_path, _CHILD)
    watch = TreeWatch(_ROOT, proc=tmp_path)
    watch.open()
    listing.write_text(str(_CHILD))  # the sampler finds it, and waits on its status
    fd = _open_when_read(status)
    listing.write_text("")
    # The next window opens, without it, while the sampler still reads it for the first.
    opening = threading.Thread(target=watch.open)
    opening.start()
    _finish(fd, "Name:\tchild\nVmHWM:\t  8192 kB\n")
    opening.join()
    summary = watch.close(None)
    assert summary.rss_peak_bytes is None
    assert summary.descendants == 0


def test_a_child_started_by_a_thread_that_ended_is_still_a_descendant():
    """Whichever thread started a child, and though that thread has ended, the child is
    listed; once it is reaped, this process has no descendant again."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        started.append(
            subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
        )

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    [child] = started
    try:
        assert child.pid in read_descendants(os.getpid())
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert child.pid not in read_descendants(os.getpid())


#: Fork argv[1] children that wait on one pipe, print their PIDs, and wait for stdin to close
#: (the pipe's writing end closes with this process: every child then exits).
_MANY = """
import os, sys
r, w = os.pipe()
pids = []
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    pids.append(pid)
os.close(r)
print(*pids, flush=True)
sys.stdin.read()
"""


def test_a_children_file_longer_than_one_read_is_read_to_its_end():
    """A process with more children than one page of its ``children`` file holds (the
    kernel hands such a file out a page per read): every child is a descendant."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _MANY, "1200"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        pids = {int(word) for word in parent.stdout.readline().split()}
        assert len(pids) == 1200
        with open(f"/proc/{parent.pid}/task/{parent.pid}/children", "rb") as file:
            assert len(file.read()) > os.sysconf("SC_PAGE_SIZE")  # more than one read gives
        assert set(read_descendants(parent.pid)) == pids
    finally:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.close()
        parent.wait()
        parent.stdout.close()


# The sampler's error is the point of the test: the thread's end is reported, and expected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sampler_that_ended_is_started_again_by_the_next_window(tmp_path: Path):
    """The sampler thread ends on an error of its own: the next window starts another, and
    that one samples (a descendant only it saw counts in the window). The error is set
    where no sample is in flight (before: one in flight set the next due time over it as it
    ended, the sampler never failed, and the test waited for ever under load)."""
    listing = _fake_root(tmp_path)
    status = _fifo_status(tmp_path, _CHILD)
    watch = TreeWatch(_ROOT, proc=tmp_path)
    watch.open()
    sampler = watch._sampler
    first = sampler.thread
    assert first is not None
    with sampler.lock:
        while sampler.sampling:  # a sample in flight sets the next due time as it ends
            sampler.wake.wait()
        sampler.due_s = None  # type: ignore[assignment]  # its next turn fails on this
    first.join()
    assert sampler.thread is None  # the thread said so as it ended
    watch.close(None)
    watch.open()
    assert watch._sampler is sampler  # the same process: the same sampler, a new thread
    assert sampler.thread is not None and sampler.thread is not first
    assert _closed_over_a_child_only_the_sampler_saw(watch, listing, status) == 4096 * 1024


# Python 3.12+ warns that forking a process with threads may deadlock: the parent's sampler
# runs; that the child never takes the parent's lock, which a thread may have held, is the point.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_forked_copy_of_a_watch_samples_with_a_sampler_of_its_own(tmp_path: Path):
    """A watch forked with its process makes its own sampler at its next window (its own
    lock and thread: the parent's thread does not run there); the parent's is unchanged."""
    _fake_root(tmp_path)
    watch = TreeWatch(_ROOT, proc=tmp_path)
    watch.open()
    watch.close(None)
    parents = watch._sampler

    def answer() -> bytes:
        watch.open()
        sampler = watch._sampler
        thread = sampler.thread
        fresh = (
            sampler is not parents
            and sampler.owner_pid == os.getpid()
            and sampler.lock is not parents.lock
            and thread is not None
            and thread.is_alive()
            and thread is not parents.thread
        )
        empty = watch.close(None).descendants == 0
        return b"ok" if fresh and empty else b"stale"

    _, answered = answered_in_a_fork(answer)
    assert answered == b"ok"
    assert watch._sampler is parents and parents.owner_pid == os.getpid()


def test_a_window_with_nothing_under_the_worker_sums_up_to_nothing(tmp_path: Path):
    """No descendant before, during or after the window: the summary is all empty."""
    _fake_root(tmp_path)
    watch = TreeWatch(_ROOT, proc=tmp_path)
    watch.open()
    summary = watch.close(None)
    assert summary == TreeSummary(
        descendants=0,
        outliving_pids=(),
        outliving_device_bytes=None,
        rss_peak_bytes=None,
        rejected=(),
    )
