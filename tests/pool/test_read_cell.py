"""The read cell (acks) and the worker's check of a frame's first bytes (wire)."""

from __future__ import annotations

import os
import socket

import pytest

from gpupool._pool import wire
from gpupool._pool.acks import ReadCell
from gpupool._pool.channel import frame_header


@pytest.fixture
def cell() -> ReadCell:
    made, fd = ReadCell.create()
    os.close(fd)
    return made


def test_a_frame_not_read_yet_reads_as_none(cell: ReadCell):
    assert cell.read(0, [7]) is None
    cell.note(1, 7)
    assert cell.read(1, [8]) is None  # task 7 answered; 8's frame not read yet


def test_the_head_read_and_frames_read_past_it(cell: ReadCell):
    cell.note(1, 7)
    assert cell.read(0, [7, 8]) is True
    cell.note(2, 8)  # it answered 7 (not yet seen by the pool) and read 8
    assert cell.read(0, [7, 8]) is True
    assert cell.read(1, [8]) is True


def test_a_frame_read_in_the_head_s_place_is_seen_for_good(cell: ReadCell):
    """Frame 7 taken by another reader: the worker's first read is 8's, then 9's."""
    cell.note(1, 8)
    assert cell.read(0, [7, 8, 9]) is False
    cell.note(2, 9)
    assert cell.read(0, [7, 8, 9]) is False
    assert cell.read(0, [7]) is False  # more frames read than were sent


def test_the_count_wraps(cell: ReadCell):
    cell.note(2**24 + 3, 5)
    assert cell.read(2**24 + 2, [5]) is True
    assert cell.read(2**24 + 3, [6]) is None


def test_the_worker_refuses_a_frame_that_is_not_the_pool_s_from_its_first_bytes():
    """A stream another reader cut into: bytes that claim a frame of 2 GiB cost nothing."""
    worker, parent = socket.socketpair()
    with worker, parent:
        parent.sendall(frame_header(2**31 - 1) + b"\x93\x00junk")
        with pytest.raises(OSError, match="not the pool's"):
            wire.read_frame(worker.fileno())


def test_the_worker_reads_the_pool_s_frames():
    worker, parent = socket.socketpair()
    with worker, parent:
        task = wire.task_prefix(41) + b"call"
        parent.sendall(frame_header(len(task)) + task + frame_header(0))
        frame = wire.read_frame(worker.fileno())
        assert frame is not None and bytes(frame) == task
        assert wire.task_id_of(frame) == 41
        assert wire.read_frame(worker.fileno()) == bytearray()
        assert wire.task_id_of(b"gpupool-allocator-cap:1") == wire.NO_TASK
