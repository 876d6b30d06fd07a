"""What the simulated host costs per operation: hold() enter+exit, and a sensor's read_memory.

Run: ``python bench/sensor_overhead.py [--number N]``. Prints microseconds per
operation (the best of several repeats of N operations each). Every operation
is one locked read-modify-write of the ledger file, so the figures are what a
pool's live gate or a child's probe pays per reading on the simulator; they
should stay well under a millisecond.
"""

from __future__ import annotations

import argparse
import timeit
from typing import TYPE_CHECKING

from gpupool.testing import SimulatedDevice, SimulatedHost, hold

if TYPE_CHECKING:
    from collections.abc import Callable


def _per_op_us(statement: Callable[[], object], number: int, repeat: int) -> float:
    """The best of ``repeat`` runs of ``number`` calls, in microseconds per call."""
    best = min(timeit.repeat(statement, number=number, repeat=repeat))
    return best / number * 1e6


def main() -> None:
    """Time each operation on a small simulated host and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="operations per repeat")
    parser.add_argument("--repeat", type=int, default=5, help="repeats (the best is kept)")
    args = parser.parse_args()

    devices = [
        SimulatedDevice("80GiB", co_tenants={"server": "20GiB", "notebook": "3GiB"}),
        SimulatedDevice("80GiB"),
    ]
    with SimulatedHost(devices) as host:
        sensor = host.sensor()
        device = sensor.read_devices()[0]
        with hold("1GiB"):  # charge the context once, as a warm worker has
            pass

        def hold_enter_exit() -> None:
            with hold("1GiB"):
                pass

        def read_memory() -> None:
            sensor.read_memory(device)

        def read_processes() -> None:
            sensor.read_processes(device)

        figures = {
            "hold() enter + exit (2 ledger writes)": _per_op_us(
                hold_enter_exit, args.number, args.repeat
            ),
            "sensor.read_memory": _per_op_us(read_memory, args.number, args.repeat),
            "sensor.read_processes": _per_op_us(read_processes, args.number, args.repeat),
        }
    width = max(len(name) for name in figures)
    print(f"simulated host, {args.number} ops x {args.repeat} repeats (best), us per op:")
    for name, micros in figures.items():
        print(f"  {name:<{width}}  {micros:8.1f} us")


if __name__ == "__main__":
    main()
