"""One pool of the serial-floor scenario, run as a script inside the test's SimulatedHost.

    python serial_floor_script.py small OUT_DIR TASKS
    python serial_floor_script.py big OUT_DIR TASKS

``small``: a pool of 3 workers runs TASKS tasks that each write ``small-<i>`` in OUT_DIR
when they start, then hold 3.5 GiB for 0.3 s (``task_peak="4GiB"``). ``big``: waits until
the small pool's first task has started, then runs one task (``task_peak="20GiB"``,
``room_wait_s=600``) that counts the small pool's started tasks when it starts (into
``big-start.json``) and holds 19 GiB. Each writes its results and the events of its
decision log to ``<role>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import gpupool.testing as gt
from gpupool import GpuPoolExecutor

PATIENCE_S = 120.0


def small_task(i: int, out_dir: str) -> int:
    Path(out_dir, f"small-{i}").touch()
    with gt.hold("3.5GiB"):
        time.sleep(0.3)
    return i


def big_task(out_dir: str, tasks: int) -> int:
    started = sum(1 for i in range(tasks) if Path(out_dir, f"small-{i}").exists())
    Path(out_dir, "big-start.json").write_text(json.dumps({"small_started": started}))
    with gt.hold("19GiB"):
        time.sleep(0.1)
    return started


def main(argv: list[str]) -> int:
    role, out_dir, tasks = argv[0], argv[1], int(argv[2])
    log = Path(out_dir, f"{role}.jsonl")
    if role == "big":
        deadline = time.monotonic() + PATIENCE_S
        while not Path(out_dir, "small-0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with GpuPoolExecutor(1, task_peak="20GiB", room_wait_s=600, log_path=log) as pool:
            results = [pool.submit(big_task, out_dir, tasks).result()]
    else:
        with GpuPoolExecutor(3, task_peak="4GiB", log_path=log) as pool:
            results = list(pool.map(small_task, range(tasks), [out_dir] * tasks))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    Path(out_dir, f"{role}.json").write_text(json.dumps({"results": results, "records": records}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
