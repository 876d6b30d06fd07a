"""``options(size=...)`` end to end: bad sizes are refused, and an input four times the size of
those before it is priced for its size."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import sized_tasks

import gpupool.testing as gt
from gpupool import ConfigurationError, GpuPoolExecutor


@pytest.mark.parametrize("size", [0, -1, math.nan, math.inf, "3", True, [2]])
def test_a_size_that_is_not_a_positive_finite_number_is_refused(size: object) -> None:
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=4, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            with pytest.raises(ConfigurationError, match="positive, finite number"):
                ex.options(key="k", size=size)  # type: ignore[arg-type]
            # Nothing was lost: the pool still runs work.
            assert ex.submit(sized_tasks.hold_for_size, 1, 0.1).result(timeout=120) == 1


def test_a_larger_input_is_priced_for_its_size_and_runs_out_of_nothing() -> None:
    """Sixteen size-1 tasks (1.3 GiB peaks with the context) teach the key, then a size-6 task
    arrives among more size-1 tasks on a 10 GiB card, four at once. Priced at its key's ask
    it would start beside three others and need 6.3 GiB of the 5.8 GiB left; priced for its
    size it waits for room, and no task runs the card out of memory."""
    with gt.SimulatedHost([gt.SimulatedDevice("10GiB")], cpus=8, host_ram="32GiB") as host:
        with GpuPoolExecutor(max_workers=4, task_peak="2GiB") as ex:
            sizes = [1.0] * 16 + [6.0] + [1.0] * 7
            futures = [
                ex.options(key="k", size=size).submit(sized_tasks.hold_for_size, i, size)
                for i, size in enumerate(sizes)
            ]
            assert [f.result(timeout=120) for f in futures] == list(range(len(sizes)))
            stats = ex.statistics()
        assert host.out_of_memory_events == []
        assert stats.out_of_memory == 0 and stats.retries == 0


def test_a_size_of_any_real_number_type_is_taken_and_one_too_large_is_refused() -> None:
    """Sizes come from numpy shapes and products (``numpy.int64``, ``numpy.float32``) as often
    as from ``len``: any real number is a size, read as a float. An int too large for a float
    (10**400) is refused with the same ConfigurationError, not an OverflowError."""
    numpy = pytest.importorskip("numpy")
    sizes = [numpy.int64(2), numpy.float32(1.5), numpy.float64(1.0), Fraction(1, 2), 10**300]
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=4, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            futures = [
                ex.options(key="k", size=size).submit(sized_tasks.hold_for_size, i, 0.1)
                for i, size in enumerate(sizes)
            ]
            assert [f.result(timeout=120) for f in futures] == list(range(len(sizes)))
            with pytest.raises(ConfigurationError, match="positive, finite number"):
                ex.options(key="k", size=10**400)
            with pytest.raises(ConfigurationError, match="positive, finite number"):
                ex.options(key="k", size=numpy.float64("nan"))
