"""``map(..., size=callable)`` and ``options(size=callable)`` end to end on a simulated card (real
worker processes): each call's size from its arguments at submit, and a callable that fails
fails its own task alone."""

from __future__ import annotations

import concurrent.futures

import predict_tasks
import pytest
import sized_tasks

import gpupool.testing as gt
from gpupool import ConfigurationError, GpuPoolExecutor

GiB = 1024**3


def spec(held_bytes: int) -> str:
    """A task's hold as a fixed-width string: no feature of the call says how large it is."""
    return f"{held_bytes:020d}"


def gib_of(i: int, held: str) -> float:
    """The size callable of :func:`predict_tasks.hold_spec`'s calls: the GiB it holds."""
    return int(held) / GiB


def test_map_with_a_size_callable_prices_each_task_for_its_size() -> None:
    """Sixteen tasks of 1 GiB, then one of 6 GiB among more of 1 GiB on a 10 GiB card, four at
    once, mapped with ``size=`` a callable of the arguments (their fixed-width strings say
    nothing the pool could read). Priced at its key's ask the 6 GiB task would start beside
    three others and run the card out of memory; sized by the callable it waits for room."""
    holds = [GiB] * 16 + [6 * GiB] + [GiB] * 7
    with gt.SimulatedHost([gt.SimulatedDevice("10GiB")], cpus=8, host_ram="32GiB") as host:
        with GpuPoolExecutor(max_workers=4, task_peak="2GiB") as ex:
            out = list(
                ex.map(
                    predict_tasks.hold_spec,
                    range(len(holds)),
                    [spec(h) for h in holds],
                    size=gib_of,
                )
            )
            stats = ex.statistics()
    assert out == list(range(len(holds)))
    assert host.out_of_memory_events == []
    assert stats.out_of_memory == 0 and stats.retries == 0


class Unsizable(Exception):
    pass


def sizes(i: int, size: float) -> object:
    """A size callable that fails for some calls, as users' do."""
    if i == 1:
        raise Unsizable("no shape on this entry")
    if i == 2:
        return 0
    if i == 3:
        return "3"
    if i == 4:
        return None  # no size for this call: priced by its key
    return size


def test_a_size_callable_that_fails_fails_its_task_alone_and_leaves_nothing_pending() -> None:
    """Through ``options(size=)``: the call whose callable raised fails with a
    ConfigurationError naming the error (its cause), those whose callable returned 0 or a str
    fail saying what it returned and what to return; a ``None`` runs untold; every other task
    runs; no future is left pending; the pool goes on. Through ``map(size=)``: the failing
    entry's result raises, naming the entry. Bad values given as ``size`` are refused at once."""
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=4, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            view = ex.options(key="k", size=sizes)
            futures = [view.submit(sized_tasks.hold_for_size, i, 0.2) for i in range(7)]
            concurrent.futures.wait(futures, timeout=120)
            assert all(f.done() for f in futures)
            raised = futures[1].exception()
            assert isinstance(raised, ConfigurationError)
            assert isinstance(raised.__cause__, Unsizable)
            assert "raised Unsizable: no shape on this entry" in str(raised)
            assert "return a positive number, or None" in str(raised)
            for bad, shown in ((2, "returned 0"), (3, "returned '3'")):
                error = futures[bad].exception()
                assert isinstance(error, ConfigurationError), error
                assert shown in str(error) and "return None for a call with no size" in str(error)
            assert [f.result() for i, f in enumerate(futures) if i not in (1, 2, 3)] == [
                0,
                4,
                5,
                6,
            ]
            assert ex.statistics().tasks_submitted == 4  # the three refused were never sent

            results = ex.map(sized_tasks.hold_for_size, range(4), [0.2] * 4, size=sizes)
            assert next(results) == 0
            with pytest.raises(ConfigurationError, match=r"map entry 1\)") as found:
                next(results)
            assert isinstance(found.value.__cause__, Unsizable)

            for bad in (0, -2.0, "3", float("nan")):
                with pytest.raises(ConfigurationError, match=r"callable .*\(size=len\)"):
                    ex.map(sized_tasks.hold_for_size, [1], [0.2], size=bad)  # type: ignore[arg-type]
            # Nothing was lost: the pool still runs work; chunks are sized by their calls.
            chunked = ex.map(
                sized_tasks.hold_for_size,
                range(5),
                [0.2] * 5,
                size=lambda i, size: size * (i + 1),
                chunksize=2,
            )
            assert list(chunked) == [0, 1, 2, 3, 4]


def test_a_size_may_be_a_zero_dimensional_array_or_tensor() -> None:
    """``size=`` a 0-d numpy array or torch tensor (what ``batch.sum()`` returns), as a value
    or from a callable, is its one number; a 0-d array of a bool or of NaN, or one with more
    than one number, is refused as any other bad size is."""
    np = pytest.importorskip("numpy", reason="numpy is the array library users size by")
    torch = pytest.importorskip("torch", reason="the test session installs torch")
    from gpupool._pool.executor import check_size, size_of_calls

    for zero_d in (np.array(3), np.array(2.5), torch.tensor(4), torch.tensor([2.0, 3.0]).sum()):
        assert check_size(zero_d) == float(zero_d.item())
        assert size_of_calls(lambda batch: batch.sum(), [((zero_d,), {})]) == float(zero_d)
    for bad in (np.array(True), np.array(float("nan")), np.array([1, 2]), torch.tensor([1.0, 2.0])):
        with pytest.raises(ConfigurationError, match="positive, finite number"):
            check_size(bad)
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=4, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            sized = ex.map(
                sized_tasks.hold_for_size, range(3), [0.1] * 3, size=lambda i, s: np.array(i + 1)
            )
            assert list(sized) == [0, 1, 2]


class _NoShapeYet:
    """A lazy value whose ``ndim`` cannot be read (a closed dataset, a proxy not yet bound)."""

    @property
    def ndim(self) -> int:
        raise RuntimeError("the dataset is closed")


class _Grid:
    """A value whose ``ndim`` is an array: comparing it to 0 has no one truth value."""

    def __init__(self) -> None:
        self.ndim = __import__("numpy").array([0, 0])


def test_a_size_whose_dimensions_cannot_be_read_is_refused_as_a_bad_size() -> None:
    """A size (or a size callable's return) whose ``ndim`` raises, or is not one number, is
    refused with a ConfigurationError as any other bad size is: through ``options(size=)``
    at once, and from a callable as its own task's failure, the other tasks running."""
    pytest.importorskip("numpy", reason="numpy is the array library users size by")
    from gpupool._pool.executor import check_size, size_of_calls

    for odd in (_NoShapeYet(), _Grid()):
        with pytest.raises(ConfigurationError, match="positive, finite number"):
            check_size(odd)
        with pytest.raises(ConfigurationError, match="positive, finite number"):
            size_of_calls(lambda i, s, odd=odd: odd, [((0, 0.0), {})])
    with gt.SimulatedHost([gt.SimulatedDevice("8GiB")], cpus=4, host_ram="16GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
            with pytest.raises(ConfigurationError):
                ex.options(size=_NoShapeYet())
            sized = ex.options(size=lambda i, s: _NoShapeYet() if i == 1 else i + 1)
            futures = [sized.submit(sized_tasks.hold_for_size, i, 0.05) for i in range(3)]
            assert isinstance(futures[1].exception(timeout=60), ConfigurationError)
            assert [futures[0].result(timeout=60), futures[2].result(timeout=60)] == [0, 2]
