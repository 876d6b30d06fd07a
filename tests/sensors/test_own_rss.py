"""A process's own RSS high-water, as the probe reads it after each task."""

from __future__ import annotations

import os
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


def test_after_a_task_the_high_water_is_read_again_once_its_reading_is_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a task, a reading younger than ``RSS_READ_INTERVAL_S`` is reported again, and an
    older one is read anew (the interval set here to an hour, then to 0, so that no timing
    of this host decides); a reading of another process (a fork's) is never given."""
    import time

    from gpupool._sensors import process

    monkeypatch.setattr(process, "RSS_READ_INTERVAL_S", 3600.0)
    monkeypatch.setattr(process, "_last_after_task", (os.getpid(), 12345, time.monotonic()))
    assert process.rss_high_water_after_task() == 12345  # young: given again
    monkeypatch.setattr(process, "_last_after_task", (os.getpid() + 1, 12345, time.monotonic()))
    fresh = process.rss_high_water_after_task()  # another process's reading: read anew
    assert fresh is not None and fresh > 12345
    assert process.rss_high_water_after_task() == fresh
    monkeypatch.setattr(process, "RSS_READ_INTERVAL_S", 0.0)
    monkeypatch.setattr(process, "_last_after_task", (os.getpid(), 12345, time.monotonic()))
    later = process.rss_high_water_after_task()  # old: read anew
    now = process.read_rss_high_water()
    assert later is not None and now is not None
    assert fresh <= later <= now
