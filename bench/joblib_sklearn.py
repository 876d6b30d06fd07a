"""scikit-learn on joblib's loky backend against the gpupool backend (side by side).

Two workloads a scikit-learn user tries first, on the digits data set
(1,797 images, 64 features), ``n_jobs=2`` under ``joblib.parallel_config``:

* ``cross_val_score``: ``cross_val_score(LogisticRegression(max_iter=300), X, y, cv=5)``;
* ``GridSearchCV``: ``GridSearchCV(LogisticRegression(max_iter=300),
  {"C": [0.1, 1.0, 10.0]}, cv=3).fit(X, y)`` (9 fits, then the refit).

Each (backend, workload) runs in a fresh interpreter: its first call is
``cold`` (the backend starts its workers), the median of the next calls is
``warm`` (loky's reusable executor, gpupool's kept pool). Rounds alternate the
backends; the report gives the medians, gpupool / loky for each, and checks
that both backends computed the same scores::

    python bench/joblib_sklearn.py              # 3 rounds, 3 warm calls each
    python bench/joblib_sklearn.py --rounds 5 --warm 5
    python bench/joblib_sklearn.py --workload cross_val_score
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

BACKENDS = ("loky", "gpupool")
WORKLOADS = ("cross_val_score", "GridSearchCV")
N_JOBS = 2


def _workload(name: str) -> Any:
    """One call of the workload; returns its scores (compared across backends)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, cross_val_score

    x, y = load_digits(return_X_y=True)
    if name == "cross_val_score":
        return [
            round(float(s), 6)
            for s in cross_val_score(LogisticRegression(max_iter=300), x, y, cv=5)
        ]
    search = GridSearchCV(LogisticRegression(max_iter=300), {"C": [0.1, 1.0, 10.0]}, cv=3)
    search.fit(x, y)
    return [round(float(s), 6) for s in search.cv_results_["mean_test_score"]]


def _one(backend: str, workload: str, warm: int) -> dict[str, Any]:
    """In this (fresh) interpreter: the cold call, then ``warm`` calls."""
    import joblib

    import gpupool.joblib  # noqa: F401  # registers the backend

    times_s = []
    scores = None
    with joblib.parallel_config(backend=backend, n_jobs=N_JOBS):
        for _ in range(1 + warm):
            started = time.perf_counter()
            scores = _workload(workload)
            times_s.append(time.perf_counter() - started)
    return {"cold_s": times_s[0], "warm_s": statistics.median(times_s[1:]), "scores": scores}


def _run(backend: str, workload: str, warm: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--one", backend, workload, "--warm", str(warm)],
        check=True,
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=3, help="warm calls after the cold one")
    parser.add_argument(
        "--workload", choices=WORKLOADS, action="append", help="only this one (repeatable)"
    )
    parser.add_argument("--one", nargs=2, metavar=("BACKEND", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1], args.warm)))
        return 0
    workloads = tuple(args.workload or WORKLOADS)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        order = BACKENDS if round_ % 2 == 0 else tuple(reversed(BACKENDS))
        for workload in workloads:
            for backend in order:
                run = _run(backend, workload, args.warm)
                results.setdefault((backend, workload), []).append(run)
                print(
                    f"round {round_ + 1}: {workload} on {backend}: cold {run['cold_s']:.2f} s, "
                    f"warm {run['warm_s']:.2f} s (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    print(f"n_jobs={N_JOBS}, {args.rounds} rounds, {args.warm} warm calls each; medians (s)")
    print(f"{'workload':<16} {'call':<5} {'loky':>8} {'gpupool':>8} {'ratio':>6}")
    same = True
    for workload in workloads:
        loky_runs, ours = results[("loky", workload)], results[("gpupool", workload)]
        same &= all(r["scores"] == loky_runs[0]["scores"] for r in loky_runs + ours)
        for call in ("cold_s", "warm_s"):
            loky_s = statistics.median(r[call] for r in loky_runs)
            gpupool_s = statistics.median(r[call] for r in ours)
            print(
                f"{workload:<16} {call[:-2]:<5} {loky_s:>8.2f} {gpupool_s:>8.2f} "
                f"{gpupool_s / loky_s:>6.2f}"
            )
    print(f"same scores on both backends: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
