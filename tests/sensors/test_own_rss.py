"""A process's own RSS high-water, as the probe reads it after each task."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpupool._sensors.process import read_rss_high_water


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"Name:\tpython\nVmPeak:\t 9 kB\nVmHWM:\t    1234 kB\nVmRSS:\t 3 kB\n", 1234 * 1024),
        (b"VmHWM:\t5 kB", 5 * 1024),  # the last line, without its newline
        (b"Name:\tx\nVmHWM:\t x kB\n", None),  # not a number
        (b"Name:\tx\nVmHWM:\n", None),
        (b"Name:\tx\nVmRSS:\t 3 kB\n", None),  # no high-water
        (b"", None),
    ],
)
def test_the_high_water_of_a_status_file(tmp_path: Path, text: bytes, expected: int | None) -> None:
    """``VmHWM`` of a status file given as ``path``, in bytes; ``None`` when it says none."""
    status = tmp_path / "status"
    status.write_bytes(text)
    assert read_rss_high_water(status) == expected


def test_a_missing_status_file_is_no_figure(tmp_path: Path) -> None:
    """A status file that cannot be read is no figure, never 0."""
    assert read_rss_high_water(tmp_path / "gone") is None


def test_this_process_reads_its_own_high_water() -> None:
    """This process's figure is its ``VmHWM`` (it only grows between the two reads)."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc on this system")
    figure = read_rss_high_water()
    after = read_rss_high_water(status)
    assert figure is not None and after is not None
    assert figure <= after


def test_a_status_descriptor_a_task_replaced_is_opened_again(tmp_path: Path) -> None:
    """The status file kept open is opened again where a task closed its descriptor and put
    a file of its own on that number (which is left open, and never read as the status)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc on this system")
    from gpupool._sensors import process

    kept = process._STATUS_FILE
    assert kept.read() is not None
    os.close(kept._fd)
    other = tmp_path / "other"
    other.write_bytes(b"VmHWM:\t1 kB\n")
    fd = os.open(other, os.O_RDONLY)
    try:
        text = kept.read()
        assert text is not None and b"Name:" in text  # this process's status, not the file
        assert os.read(fd, 64) == b"VmHWM:\t1 kB\n"  # the task's file is still its own
    finally:
        os.close(fd)


def test_a_high_water_read_again_sees_what_was_kept_at_once_and_a_freed_peak_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the status file is read (a worker whose ru_maxrss is its pool's), the last
    reading is given again only while it is younger than ``VMHWM_MAX_AGE_S`` and the
    resident set now is not above it; else (memory kept since: the resident set above it;
    a peak freed since: the reading old; another process's reading) it is read anew."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("no /proc on this system")
    from gpupool._sensors import process

    real = process._read_vmhwm("/proc/self/status")
    assert real is not None
    huge, pid, now_s = 2**50, os.getpid(), time.monotonic()
    monkeypatch.setattr(process, "_last_vmhwm", (pid, huge, now_s))
    assert process._own_high_water() == huge  # young, and the resident set below it
    monkeypatch.setattr(process, "_last_vmhwm", (pid, 1, now_s))
    kept = process._own_high_water()  # the resident set is above it: read anew
    monkeypatch.setattr(process, "_last_vmhwm", (pid, huge, now_s - 2 * process.VMHWM_MAX_AGE_S))
    old = process._own_high_water()  # old: read anew
    monkeypatch.setattr(process, "_last_vmhwm", (pid + 1, huge, now_s))
    other = process._own_high_water()  # another process's: read anew
    after = process._read_vmhwm("/proc/self/status")
    assert after is not None
    for figure in (kept, old, other):
        assert figure is not None and real <= figure <= after
