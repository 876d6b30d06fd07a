"""Peaks predicted from what the arguments say, and an outlier kept apart, end to end on a
simulated card (real worker processes)."""

from __future__ import annotations

from pathlib import Path

import predict_tasks

import gpupool.testing as gt
from gpupool import GpuPoolExecutor
from gpupool._observe.postmortem import format_postmortem, read_postmortem

GiB = 1024**3


def test_a_larger_list_than_any_before_is_priced_for_its_length_untold() -> None:
    """Twelve tasks of lists of 1 to 3 items (1.3 to 3.3 GiB peaks with the context) teach the
    key that the first argument's length predicts its peak; then a list of 6 items (6.3 GiB)
    arrives among lists of 3 on a 10 GiB card, three at once. Priced at its key's ask (about
    3.5 GiB) it would start beside another 3.3 GiB task and run the card out of memory;
    predicted from its length it waits for room. Nothing was told: no ``size=``."""
    with gt.SimulatedHost([gt.SimulatedDevice("10GiB")], cpus=8, host_ram="32GiB") as host:
        with GpuPoolExecutor(max_workers=3, task_peak="4GiB") as ex:
            lengths = [1, 2, 3] * 4 + [6] + [3] * 5
            futures = [
                ex.submit(predict_tasks.hold_items, i, list(range(n)))
                for i, n in enumerate(lengths)
            ]
            assert [f.result(timeout=120) for f in futures] == list(range(len(lengths)))
            stats = ex.statistics()
            predicted = [d for d in ex.decisions if d.event == "predicted"]
        assert host.out_of_memory_events == []
        assert stats.out_of_memory == 0 and stats.retries == 0
    assert predicted, "no record names the feature that predicts the peaks"
    record = predicted[0].to_dict()
    assert record["feature"] == "arg1.len"
    assert abs(record["slope_bytes_per_unit"] - GiB) < 0.01 * GiB
    assert "R^2" in record["reason"] and "error" in record["reason"]


def test_one_outlier_does_not_price_its_key(tmp_path: Path) -> None:
    """Sixteen 1 GiB tasks, one of 7 GiB, then sixteen more of 1 GiB on an 11 GiB card: the
    outlier is recorded as one and priced for itself (it ran its card out of memory at most
    once, its own), and the tasks after it are priced by the key's 1.3 GiB peaks, not by the
    outlier's 7.3 GiB (the key's ask after the run says so); the postmortem names it."""
    spec = "{:020d}".format
    holds = [GiB] * 16 + [7 * GiB] + [GiB] * 16
    log = tmp_path / "decisions.jsonl"
    with gt.SimulatedHost([gt.SimulatedDevice("11GiB")], cpus=8, host_ram="32GiB"):
        with GpuPoolExecutor(max_workers=4, task_peak="2GiB", log_path=log) as ex:
            futures = [ex.submit(predict_tasks.hold_spec, i, spec(h)) for i, h in enumerate(holds)]
            assert [f.result(timeout=120) for f in futures] == list(range(len(holds)))
            stats = ex.statistics()
            outliers = [d for d in ex.decisions if d.event == "outlier"]
    assert stats.out_of_memory <= 1
    ask = stats.asks["predict_tasks.hold_spec"]
    assert ask.ask_bytes < 2 * GiB, ask.describe()
    assert ask.outliers == 1
    assert len(outliers) == 1 and "outlier" in outliers[0].reason
    report = "\n".join(format_postmortem(read_postmortem(log)))
    assert "outlier at" in report and "kept apart" in report, report
