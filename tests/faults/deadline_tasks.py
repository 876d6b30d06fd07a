"""Task functions of the deadline, stopped-worker and stolen-frame tests (imported by name)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import threading
import time


def square(x: int) -> int:
    return x * x


def nap(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def child_then_wait(path: str, seconds: float) -> int:
    """Start ``sleep seconds``, write its PID and the worker's to ``path``, and wait for it."""
    child = subprocess.Popen(["sleep", str(seconds)])
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(path + ".tmp", path)
    return child.wait()


def deaf_to_sigterm(path: str) -> None:
    """Ignore SIGTERM, write the worker's PID to ``path``, and sleep for good."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(1)


def stop_own_worker() -> str:
    """SIGSTOP the worker this task runs in (its own PID: never ``os.kill(0, ...)``, which
    would signal the whole process group)."""
    os.kill(os.getpid(), signal.SIGSTOP)
    return "resumed"


def steal_frames() -> int:
    """Start a thread per socket this worker holds that reads it for good, taking the pool's
    task frames before the worker does; how many it started."""
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                sockets.append(int(name))
        except OSError:
            pass

    def thief(fd: int) -> None:
        while True:
            try:
                if not os.read(fd, 65536):
                    return
            except OSError:
                return

    for fd in sockets:
        threading.Thread(target=thief, args=(fd,), daemon=True).start()
    return len(sockets)
