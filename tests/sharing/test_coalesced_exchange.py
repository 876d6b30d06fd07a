"""Two pools whose starts and releases fall within one coalescing window of the booking table.

Each pool alone would run four 6.5 GiB tasks on the 40 GiB card; the two together
would pass it if either booked onto the other's bytes. Both start their four
workers first, then submit at once (a barrier), so their first starts fall within
one window; each task allocates two windows after it starts, so no reading of
the card shows it yet: only the bookings written at the start keep the pools
apart. Later starts take a finished task's booking while its release is still
coalesced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpupool.testing as gt
from gpupool._pool.booking_link import COALESCE_S
from gpupool._sensors.bookings import BookingTable

SCRIPT = str(Path(__file__).with_name("pool_script.py"))
TASKS = 12


def test_two_pools_starting_within_one_window_never_share_bytes(tmp_path: Path) -> None:
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    wait_s, hold_s = 2 * COALESCE_S, 6 * COALESCE_S
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")], cpus=16, host_ram="256GiB") as host:
        scripts = {
            name: subprocess.Popen(
                [
                    sys.executable,
                    SCRIPT,
                    str(barrier),
                    name,
                    "2",
                    "4",
                    "6.5GiB",
                    "6GiB",
                    str(TASKS),
                    str(tmp_path / f"{name}.json"),
                    str(wait_s),
                    str(hold_s),
                    "warm",
                ],
            )
            for name in ("a", "b")
        }
        codes = {name: script.wait(timeout=600) for name, script in scripts.items()}
        left = BookingTable(host.bookings_directory).others(host.device_uuid(0))
        ooms = host.out_of_memory_events
        peak = host.device_peak(0)
        total = host.devices[0].total_bytes
    assert codes == {"a": 0, "b": 0}
    pools = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in scripts}
    for name, pool in pools.items():
        assert pool["errors"] == [], name
        assert sorted(pool["results"]) == list(range(TASKS)), name
        assert pool["out_of_memory"] == 0, name
    assert ooms == []
    assert peak <= total
    assert left is not None and left.pools == ()  # both withdrew at shutdown
