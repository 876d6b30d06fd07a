"""Tasks that leave their worker without descriptors or memory (children import them by name)."""

from __future__ import annotations

import os
import resource

#: What a leaking task keeps, for the worker's life (a leak, on purpose).
_KEPT: list[object] = []


def leak_descriptors(limit: int = 64) -> int:
    """Lower this worker's descriptor limit to ``limit``, then open descriptors until none is
    left, keeping them all; return this worker's PID, having failed at nothing."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        while True:
            _KEPT.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    return os.getpid()


def leak_memory(headroom_bytes: int = 64 << 20) -> int:
    """Cap this worker's address space at what it maps now plus ``headroom_bytes``, then fill
    the headroom, keeping it; return this worker's PID, having failed at nothing."""
    with open("/proc/self/statm") as file:
        mapped_bytes = int(file.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes + headroom_bytes, hard))
    try:
        while True:
            _KEPT.append(bytearray(1 << 20))
    except MemoryError:
        pass
    return os.getpid()


def open_and_read(path: str) -> tuple[int, int]:
    """This worker's PID, and the size of the file at ``path`` (a descriptor is needed)."""
    with open(path, "rb") as file:
        return os.getpid(), len(file.read())


def size_of(payload: bytes) -> tuple[int, int]:
    """This worker's PID and the payload's size (unpickling it needs memory)."""
    return os.getpid(), len(payload)
