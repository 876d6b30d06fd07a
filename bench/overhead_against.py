"""``bench/overhead.py`` run against two source trees, interleaved, in one run.

Each round runs ``overhead.py --repeat 1`` once per tree (in an order that alternates from
round to round), each in a fresh process with that tree's ``src`` first on ``PYTHONPATH``,
and keeps the gpupool executors' no-op cost per task beside that same process's
``stdlib (spawn)`` figure. Reported: per tree, the median over the rounds of the us per
task and of its ratio to stdlib in the same process (which cancels most of a shared
machine's drift), and the ratio of the two trees' medians::

    python bench/overhead_against.py --before ../base/src --after src --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GPUPOOL = ("gpupool (host)", "gpupool (simulated card)")


def _one(src: str, tasks: int, workers: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "o.json")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "overhead.py"),
                "--repeat",
                "1",
                "--tasks",
                str(tasks),
                "--workers",
                str(workers),
                "--payload-tasks",
                "0",
                "--json",
                out,
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(out, encoding="utf-8") as fh:
            noop = json.load(fh)["noop_s"]["median"]
    figures = {name: noop[name] for name in GPUPOOL}
    figures.update({f"{name} / stdlib": noop[name] / noop["stdlib (spawn)"] for name in GPUPOOL})
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the src directory of the tree before")
    parser.add_argument("--after", required=True, help="the src directory of the tree after")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for label in ("before", "after") if r % 2 == 0 else ("after", "before"):
            runs[label].append(_one(trees[label], args.tasks, args.workers))
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    medians = {
        label: {k: statistics.median(run[k] for run in rows) for k in rows[0]}
        for label, rows in runs.items()
    }
    print(
        f"no-op cost per task, {args.tasks} tasks, {args.workers} workers, medians of "
        f"{args.rounds} interleaved rounds (load {os.getloadavg()[0]:.1f})"
    )
    print(
        f"{'executor':<26}{'before us':>11}{'after us':>10}{'after/before':>14}"
        f"{'before/stdlib':>15}{'after/stdlib':>14}{'ratio of ratios':>17}"
    )
    for name in GPUPOOL:
        b, a = medians["before"], medians["after"]
        key = f"{name} / stdlib"
        print(
            f"{name:<26}{b[name] * 1e6:>11.1f}{a[name] * 1e6:>10.1f}{a[name] / b[name]:>14.3f}"
            f"{b[key]:>15.3f}{a[key]:>14.3f}{a[key] / b[key]:>17.3f}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"runs": runs, "medians": medians, "args": vars(args)}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
