"""Task functions for ``bench/soak.py`` (module level: workers import them by name)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time


class SoakError(ValueError):
    """The exception a soak task raises on purpose."""


def soak(i: int, fault: str, payload: bytes = b"") -> object:
    """Return ``(i * 3, payload)``, or commit ``fault``."""
    if fault == "raise":
        raise SoakError(f"task {i} raised on purpose")
    if fault == "unpicklable_result":
        return threading.Lock()
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    if fault == "segfault":
        ctypes.string_at(0)
    return i * 3, payload
