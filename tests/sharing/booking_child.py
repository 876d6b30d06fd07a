"""Child processes for the booking-table tests, run as ``python booking_child.py MODE ...``.

Modes:
    publish DIR UUID POOL BOOKED    publish one task booking, print "ready", wait for stdin.
    hammer DIR UUID POOL N          exchange N times (the row's booked bytes = the iteration),
                                    print "done", then wait for stdin to close.
    spin DIR UUID POOL              publish until killed, printing "ready" after the first.
    simulated POOL                  publish through the pool's own resolution (the simulated host's
                                    table), print "ready", wait for stdin to close.
"""

from __future__ import annotations

import os
import sys

from gpupool._core.bookings import TaskBooking
from gpupool._sensors.bookings import BookingTable, open_booking_table
from gpupool._sensors.select import default_sensor


def _task(booked: int) -> list[TaskBooking]:
    return [TaskBooking(worker_pid=os.getpid(), key="child", booked_bytes=booked, reached_bytes=0)]


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "publish":
        directory, uuid, pool, booked = argv[1:5]
        table = BookingTable(directory)
        assert table.publish(uuid, pool, _task(int(booked)))
        print("ready", flush=True)
        sys.stdin.read()
    elif mode == "hammer":
        directory, uuid, pool, count = argv[1:5]
        table = BookingTable(directory)
        for i in range(1, int(count) + 1):
            assert table.exchange(uuid, pool, _task(i)) is not None
        print("done", flush=True)
        sys.stdin.read()
    elif mode == "spin":
        directory, uuid, pool = argv[1:4]
        table = BookingTable(directory)
        i = 0
        while True:
            i += 1
            # Rows of varying length, so that the file grows and shrinks under the kill.
            table.exchange(uuid, pool, _task(i) * (1 + i % 7))
            if i == 1:
                print("ready", flush=True)
    elif mode == "simulated":
        (pool,) = argv[1:2]
        sensor = default_sensor()
        uuid = sensor.read_devices()[0].uuid
        table = open_booking_table(share=True, directory=None, sensor=sensor)
        assert table is not None
        assert table.publish(uuid, pool, _task(1234))
        print(f"ready {table.directory}", flush=True)
        sys.stdin.read()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
