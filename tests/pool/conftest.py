"""Fixtures of the process layer's tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gpupool._pool import wire
from gpupool._pool.channel import Channel


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Channel]]:
    """The worker's end (blocking) and the parent's channel on the other end."""
    worker, parent = socket.socketpair()
    channel = Channel(parent, magic=wire.ANSWER_MAGIC, min_frame_bytes=wire.MIN_ANSWER_BYTES)
    try:
        yield worker, channel
    finally:
        worker.close()
        parent.close()
