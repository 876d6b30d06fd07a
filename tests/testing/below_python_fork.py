"""Run alone (a single-threaded process, so a fork made by C code is safe in it): a child
forked through ctypes (no fork hook runs in it) allocates on the simulated card while this
process holds the ledger's exclusive lock. Prints, as JSON, whether the child allocated
before the lock was let go, and the child's peak on the card."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select

from gpupool._sensors.simulated import ledger_at
from gpupool.testing import SimulatedDevice, SimulatedHost, hold

TICK_S = 0.05
#: A safety net so that a broken run ends instead of hanging; never asserted on.
HANG_TICKS = 1200


def _waits_for_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked on a file lock (``/proc/locks`` lists it after "->")."""
    with open("/proc/locks", encoding="ascii", errors="replace") as file:
        return any(
            len(fields) > 5 and fields[1] == "->" and fields[5] == str(pid)
            for fields in (line.split() for line in file)
        )


def main() -> None:
    with SimulatedHost([SimulatedDevice("16GiB")]) as host:
        ledger = ledger_at(host.ledger_path)
        with hold("1GiB"):  # the ledger open, its layout known, in this process
            pass
        read_end, write_end = os.pipe()
        fd = ledger._file.fd
        assert fd is not None
        fcntl.flock(fd, fcntl.LOCK_EX)  # as this process's operation holds it, in a thread
        child = None
        try:
            child = ctypes.PyDLL(None).fork()
            if child == 0:
                try:
                    with hold("1GiB"):
                        os.write(write_end, b"held")
                finally:
                    os._exit(0)
            # Until the child has either allocated or waits for the lock.
            for _ in range(HANG_TICKS):
                allocated = bool(select.select([read_end], [], [], TICK_S)[0])
                if allocated or _waits_for_a_lock(child):
                    break
            else:
                raise AssertionError("the child neither allocated nor waited for the lock")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            if child:
                os.waitpid(child, 0)
            os.close(read_end)
            os.close(write_end)
        print(json.dumps({"allocated": allocated, "peak_bytes": host.process_peak(child)}))


if __name__ == "__main__":
    main()
