"""Asks predicted from a task's input size (``options(size=...)``): pure core, hypothesis."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import Planner, PlannerConfig, Retry, Start
from gpupool._core.policy import MARGIN_FLOOR_BYTES, AskTable, Policy
from gpupool._core.units import GiB, MiB
from support import card_census, census_of

LEARNED = Policy(learned=True)


def table(samples: list[tuple[float, int]], estimate_bytes: int = 20 * GiB) -> AskTable:
    asks = AskTable(policy=LEARNED, default_estimate_bytes=estimate_bytes)
    for size, peak in samples:
        asks.measure("k", peak, size=size)
    return asks


def linear(size: float, noise_bytes: int = 0) -> int:
    """1 GiB of weights and context, 1 GiB per unit of input."""
    return int(GiB + size * GiB) + noise_bytes


def test_a_size_is_the_keys_ask_until_tasks_with_sizes_are_measured() -> None:
    asks = AskTable(policy=LEARNED, default_estimate_bytes=8 * GiB)
    assert asks.ask_for("k", 3.0) == asks.ask("k")
    asks.measure("k", 5 * GiB)  # measured, but without a size
    assert asks.ask_for("k", 3.0) == asks.ask("k")


def test_small_inputs_are_priced_near_their_own_peak_once_a_line_fits() -> None:
    """Eight tasks of sizes 1-8 GiB-units on a line (a few MiB of allocator noise): a size-2
    task is priced near its 3 GiB, not at the 9 GiB the largest needed."""
    rng = random.Random(4)
    samples = [(float(s), linear(s, rng.randint(0, 20) * MiB)) for s in range(1, 9)]
    asks = table(samples)
    key_ask = asks.ask("k").ask_bytes
    small = asks.ask_for("k", 2.0)
    assert small.size == 2.0 and not small.pooled
    assert linear(2, 20 * MiB) + MARGIN_FLOOR_BYTES <= small.ask_bytes < 3.5 * GiB
    assert key_ask > 9 * GiB
    assert "predicted for size 2" in small.describe()


def test_an_input_larger_than_any_before_is_priced_above_them() -> None:
    """Sizes up to 8 measured; a size-16 input is priced at what the line predicts there (about
    17 GiB) and never below the key's own ask."""
    samples = [(float(s), linear(s, (s % 3) * 8 * MiB)) for s in range(1, 9)]
    asks = table(samples)
    big = asks.ask_for("k", 16.0)
    assert big.ask_bytes >= linear(16)
    assert big.ask_bytes >= asks.ask("k").ask_bytes


def test_before_the_fit_a_larger_input_scales_the_keys_ask() -> None:
    """Two sized samples (no line yet): a size twice the largest is priced at twice the key's
    ask; a size within those measured gets the key's ask."""
    asks = table([(1.0, linear(1)), (2.0, linear(2))])
    key_ask = asks.ask("k").ask_bytes
    assert asks.ask_for("k", 4.0).ask_bytes == 2 * key_ask
    assert asks.ask_for("k", 1.5).ask_bytes == key_ask


def test_peaks_that_do_not_grow_with_size_are_priced_at_the_keys_ask() -> None:
    asks = table([(float(s), 6 * GiB - s * MiB) for s in range(1, 9)])
    assert asks.ask_for("k", 2.0).ask_bytes == asks.ask("k").ask_bytes


def test_after_an_out_of_memory_no_size_is_priced_below_the_floor() -> None:
    samples = [(float(s), linear(s)) for s in range(1, 9)]
    asks = table(samples)
    asks.floor("k", 12 * GiB)
    assert asks.ask_for("k", 1.0).ask_bytes >= 12 * GiB


SIZED = st.lists(
    st.tuples(
        st.floats(min_value=0.01, max_value=1e6, allow_nan=False, allow_infinity=False),
        st.integers(min_value=1, max_value=80 * GiB),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(samples=SIZED, query=st.floats(min_value=0.01, max_value=1e7))
def test_a_sized_ask_never_undercuts_what_was_measured_at_sizes_up_to_it(
    samples: list[tuple[float, int]], query: float
) -> None:
    """Whatever was measured: the ask for a size is at least the largest peak measured at a size
    up to it plus the allocator granule (or the key's ask); within the sizes measured it is
    never above the key's ask, and past them never below it."""
    asks = table(samples)
    key_ask = asks.ask("k").ask_bytes
    ask = asks.ask_for("k", query).ask_bytes
    below = [p for s, p in samples if s <= query]
    assert ask >= min(key_ask, max(below, default=0) + MARGIN_FLOOR_BYTES)
    largest = max(s for s, _ in samples)
    if query <= largest:
        assert ask <= key_ask
    else:
        assert ask >= key_ask


def test_the_prediction_bound_covers_new_peaks_about_as_promised() -> None:
    """Peaks on a line plus normal noise (sd 200 MiB), sizes uniform 1-10; after 4, 8 and 30
    samples, a new task's peak passes its sized ask about 1 time in 1000 (fixed seed; at most
    8 in 2000 per case)."""
    rng = random.Random(7)
    for n in (4, 8, 30):
        passed = 0
        for _ in range(2000):
            samples = []
            for _ in range(n):
                size = rng.uniform(1, 10)
                samples.append((size, max(1, int(linear(size) + rng.gauss(0, 200 * MiB)))))
            asks = table(samples, estimate_bytes=80 * GiB)
            size = rng.uniform(1, 12)
            peak = linear(size) + rng.gauss(0, 200 * MiB)
            passed += peak > asks.ask_for("k", size).ask_bytes
        assert passed <= 8, (n, passed)


def test_the_planner_books_a_sized_task_at_its_own_ask_and_keeps_it() -> None:
    """Eight sized tasks measured; a size-1 and a size-8 task start side by side, each booked at
    its own predicted ask, and a later measurement rebooks each at its size."""
    records: list[Decision] = []
    asks = AskTable(policy=LEARNED, default_estimate_bytes=12 * GiB)
    for s in range(1, 9):
        asks.measure("k", linear(s, s * MiB), size=float(s))
    planner = Planner(
        census=census_of([card_census(total_bytes=40 * GiB, free_bytes=40 * GiB)]),
        asks=asks,
        config=PlannerConfig(max_workers=4, reserve_bytes=0),
        emit=records.append,
    )
    planner.construct(0.0)
    planner.submit(0, "k", size=1.0)
    planner.submit(1, "k", size=8.0)
    planner.submit(2, "k", size=2.0)
    for pid in (100, 101, 102):
        verdict = planner.next_start(0.0)
        assert isinstance(verdict, Start)
        planner.started(verdict.task, verdict.device, pid, 0.0)
    booked = {t: r.booked_bytes for t, r in planner.state.running.items()}
    assert booked[0] == asks.ask_for("k", 1.0).ask_bytes < 2.5 * GiB
    assert booked[1] == asks.ask_for("k", 8.0).ask_bytes
    report = PeakReport(device=0, device_peak_bytes=linear(2), device_source="simulator")
    planner.finished(2, report, 0.5)
    assert planner.state.running[0].booked_bytes == asks.ask_for("k", 1.0).ask_bytes
    assert planner.state.running[1].booked_bytes == asks.ask_for("k", 8.0).ask_bytes


class _CountingSize(float):
    """A size that counts how often the table reads it (compares it or computes with it)."""

    reads = 0

    def _read(self, name: str, *args: object) -> object:
        _CountingSize.reads += 1
        return getattr(float, name)(self, *args)

    def __lt__(self, other: object) -> bool:
        return bool(self._read("__lt__", other))

    def __le__(self, other: object) -> bool:
        return bool(self._read("__le__", other))

    def __gt__(self, other: object) -> bool:
        return bool(self._read("__gt__", other))

    def __ge__(self, other: object) -> bool:
        return bool(self._read("__ge__", other))

    def __eq__(self, other: object) -> bool:
        return bool(self._read("__eq__", other))

    def __hash__(self) -> int:
        return float.__hash__(self)

    def __sub__(self, other: float) -> float:
        return float(self._read("__sub__", other))  # type: ignore[arg-type]

    def __rsub__(self, other: float) -> float:
        return float(self._read("__rsub__", other))  # type: ignore[arg-type]

    def __add__(self, other: float) -> float:
        return float(self._read("__add__", other))  # type: ignore[arg-type]

    def __radd__(self, other: float) -> float:
        return float(self._read("__radd__", other))  # type: ignore[arg-type]

    def __mul__(self, other: float) -> float:
        return float(self._read("__mul__", other))  # type: ignore[arg-type]

    def __rmul__(self, other: float) -> float:
        return float(self._read("__rmul__", other))  # type: ignore[arg-type]

    def __truediv__(self, other: float) -> float:
        return float(self._read("__truediv__", other))  # type: ignore[arg-type]


def test_pricing_a_size_does_not_read_every_measurement_again() -> None:
    """The dispatcher prices every pending task in its look-ahead (64) before every start, and
    every running sized task of a key when one of its tasks ends: pricing one size reads a
    handful of the key's measurements (a search among the sizes), not all of them. 4,000
    measured tasks at 40 sizes; ten asks read their stored sizes at most 200 times in all
    (reading each measurement again would be 40,000 reads and more)."""
    asks = AskTable(policy=LEARNED, default_estimate_bytes=20 * GiB)
    for i in range(4000):
        size = float(i % 40 + 1)
        asks.measure("k", linear(size, (i % 7) * MiB), size=_CountingSize(size))
    _CountingSize.reads = 0
    for query in range(1, 11):
        assert asks.ask_for("k", float(query) * 4.5).ask_bytes > 0
    assert _CountingSize.reads <= 200, _CountingSize.reads


def test_sizes_too_large_to_square_are_priced_and_do_not_raise() -> None:
    """Sizes are the caller's unit: 1e160 of them squares past a float. A line fitted over them
    (or, before it, an input 1e300 times the largest) still gets an ask, at least the key's
    ask past the sizes measured, instead of an OverflowError that would stop the pool."""
    asks = table([(s * 1e160, linear(s)) for s in (1.0, 2.0, 3.0, 4.0, 5.0)])
    key_ask = asks.ask("k").ask_bytes
    assert asks.ask_for("k", 2.5e160).ask_bytes <= key_ask
    assert asks.ask_for("k", 8e160).ask_bytes >= key_ask
    before_fit = table([(1.0, linear(1)), (2.0, linear(2))])
    huge = before_fit.ask_for("k", 1e300)
    assert huge.ask_bytes >= before_fit.ask("k").ask_bytes
    assert "predicted for size" in huge.describe()


def test_a_sized_task_that_passed_its_own_ask_is_not_taken_for_something_else_growing() -> None:
    """A size-2 task booked at its own 3.06 GiB ask beside a size-1 task reached 4 GiB and asked
    for 1 GiB more: it passed its ask, as the out-of-memory record says. The key's ask (12 GiB,
    its estimate) is not what it was booked at, so the card is not capped at one task for the
    rest of the run (that cap is for a task that stayed within its booking), and its retry is
    priced above what it needed."""
    records: list[Decision] = []
    asks = AskTable(policy=LEARNED, default_estimate_bytes=12 * GiB)
    for s in range(1, 9):
        asks.measure("k", linear(s), size=float(s))
    planner = Planner(
        census=census_of([card_census(total_bytes=40 * GiB, free_bytes=40 * GiB)]),
        asks=asks,
        config=PlannerConfig(max_workers=8, reserve_bytes=0),
        emit=records.append,
    )
    planner.construct(0.0)
    planner.submit(0, "k", size=2.0)
    planner.submit(1, "k", size=1.0)
    for pid in (100, 101):
        verdict = planner.next_start(0.0)
        assert isinstance(verdict, Start)
        planner.started(verdict.task, verdict.device, pid, 0.0)
    booked = planner.state.running[0].booked_bytes
    assert booked < 3.5 * GiB < asks.ask("k").ask_bytes
    report = PeakReport(
        device=0, device_peak_bytes=4 * GiB, oom_requested_bytes=GiB, device_source="simulator"
    )
    outcome = planner.out_of_memory(0, report, None, 1.0, error="CUDA out of memory")
    assert isinstance(outcome, Retry)
    assert planner.state.cards[0].cap.oom_cap is None
    assert "underestimated" in outcome.reason and "stayed within" not in outcome.reason
    assert asks.ask_for("k", 2.0).ask_bytes >= 5 * GiB
