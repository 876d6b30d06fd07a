"""Another local user against a pool in a shared booking table: how long the victim's tasks take.

Runs as root (it needs a second, unprivileged user: ``nobody`` by default). The
attacker, a forked child that becomes that user, writes one booking file of
about 1 MiB (``--attack-pools`` rows of ``--attack-tasks`` tasks each, every row
well formed, none under a live pool) under its own name in the shared table and
``--names - 1`` hard links to it under other spellings of its uid
(``uid065534``, ``uid0065534``...); with ``--churn`` it rewrites the file
without pause (``--names 1 --attack-pools 16 --attack-tasks 900`` makes one
that is read: a single name, within the size limit). The victim, this process, then runs
``--tasks`` tasks of ``--task-s`` seconds with ``share_bookings="host"`` on a
simulated card, and the same again with no attacker, in turn (``--repeat``
rounds), and prints the wall time of each and the ratio::

    sudo python bench/booking_attack.py                  # 9 names, 40 tasks of 50 ms
    sudo python bench/booking_attack.py --limit-s 120    # give up on a round after 2 min

A round that passes ``--limit-s`` is cut short: it prints how many tasks had
finished by then (the rest are cancelled, and ``shutdown`` is timed too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pwd
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from gpupool._sensors.simulated import simulated_uuid


def sleep_task(seconds: float) -> float:
    """The victim's task: sleep."""
    time.sleep(seconds)
    return seconds


def attacker_file(uuid: str, pools: int, tasks: int) -> bytes:
    """A well-formed table file of ``pools`` rows of ``tasks`` tasks, none under a live pool."""
    rows = {}
    for n in range(pools):
        rows[f"4000000.{n}"] = {
            "pid": 4_000_000 + n,
            "start": "1",
            "label": "attack",
            "updated_s": time.time(),
            "waiting": 0,
            "need_bytes": 0,
            "tasks": [[4_100_000 + i, "k", 1, 0] for i in range(tasks)],
        }
    return json.dumps(
        {"version": 1, "card_uuid": uuid, "pools": rows}, separators=(",", ":")
    ).encode()


def plant(directory: Path, uuid: str, user: tuple[int, int], args: argparse.Namespace) -> int:
    """Fork the attacker: as ``user``, write the file and its links; returns its pid once done
    (it lives on until killed, as a logged-in attacker would)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
            stem = "".join(c if (c.isalnum() or c == "-") else "_" for c in uuid)
            first = directory / f"{stem}.uid{user[0]}.json"
            first.write_bytes(attacker_file(uuid, args.attack_pools, args.attack_tasks))
            for zeros in range(1, args.names):
                os.link(first, directory / f"{stem}.uid{'0' * zeros}{user[0]}.json")
            os.write(ready_w, f"{first.stat().st_size}\n".encode())
            texts = [attacker_file(uuid, args.attack_pools, args.attack_tasks) for _ in range(2)]
            while args.churn:  # a new text at every moment: no read can be saved
                for text in texts:
                    fd = os.open(first, os.O_WRONLY)
                    os.pwrite(fd, text, 0)
                    os.close(fd)
            os.pause()
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    with os.fdopen(ready_r) as ready:
        print(f"attacker pid {pid}: a file of {ready.readline().strip()} bytes, {args.names} names")
    return pid


def run_victim(directory: Path, args: argparse.Namespace) -> dict[str, float]:
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    with SimulatedHost([SimulatedDevice("40GiB")], cpus=8, host_ram="64GiB"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool = GpuPoolExecutor(
                args.workers,
                task_peak="1GiB",
                share_bookings="host",
                bookings_dir=directory,
            )
            start = time.perf_counter()
            futures = [pool.submit(sleep_task, args.task_s) for _ in range(args.tasks)]
            done, _ = concurrent.futures.wait(futures, timeout=args.limit_s)
            took_s = time.perf_counter() - start
            for future in futures:
                future.cancel()
            closing = time.perf_counter()
            pool.shutdown(wait=True, cancel_futures=True)
            shutdown_s = time.perf_counter() - closing
        stats = pool.statistics()
    return {
        "done": len(done),
        "took_s": took_s,
        "shutdown_s": shutdown_s,
        "bookings_skipped": stats.bookings_skipped,
        "warnings": sum(1 for w in caught if "booking" in str(w.message)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--user", default="nobody")
    parser.add_argument("--names", type=int, default=9)
    parser.add_argument("--attack-pools", type=int, default=61)
    parser.add_argument("--attack-tasks", type=int, default=940)
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--task-s", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit-s", type=float, default=150.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--churn", action="store_true", help="the attacker rewrites its file without pause"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the attacker is a second, unprivileged user")
    entry = pwd.getpwnam(args.user)
    user = (entry.pw_uid, entry.pw_gid)
    root = Path(tempfile.mkdtemp(prefix="gpupool-attack-"))
    root.chmod(0o755)
    try:
        for round_ in range(args.repeat):
            for attacked in (False, True):
                directory = root / f"table-{round_}-{int(attacked)}"
                directory.mkdir()
                directory.chmod(0o1777)
                attacker = None
                if attacked:
                    attacker = plant(directory, simulated_uuid(0), user, args)
                try:
                    figures = run_victim(directory, args)
                finally:
                    if attacker is not None:
                        os.kill(attacker, 9)
                        os.waitpid(attacker, 0)
                label = "attacked" if attacked else "no attacker"
                print(
                    f"round {round_} {label:<12} {figures['done']:>3}/{args.tasks} tasks in "
                    f"{figures['took_s']:7.2f} s, shutdown {figures['shutdown_s']:6.2f} s, "
                    f"bookings_skipped {figures['bookings_skipped']}, "
                    f"booking warnings {figures['warnings']}",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
