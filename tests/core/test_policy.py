"""The pricing policy: estimates until measured, then the worst measured peak plus a margin."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpupool import parse_size
from gpupool._core.policy import (
    DEFAULT_MARGIN_BYTES,
    DEFAULT_MARGIN_FRACTION,
    DEFAULT_RESERVE_BYTES,
    AskTable,
    Policy,
)
from gpupool._core.units import GiB, MiB

EXACT = Policy(margin_bytes=1 * GiB, margin_fraction=0.0, reserve_bytes=0)


def table(estimate: int = 10 * GiB, policy: Policy = EXACT) -> AskTable:
    return AskTable(policy=policy, default_estimate_bytes=estimate)


def test_defaults_are_the_documented_constants() -> None:
    """A default Policy carries the module's margin and reserve constants."""
    policy = Policy()
    assert policy.margin_bytes == DEFAULT_MARGIN_BYTES == 256 * MiB
    assert policy.margin_fraction == DEFAULT_MARGIN_FRACTION == 0.10
    assert policy.reserve_bytes == DEFAULT_RESERVE_BYTES == 256 * MiB


def test_margin_is_the_larger_of_bytes_and_fraction() -> None:
    """margin_for is max(margin_bytes, fraction * peak): bytes when small, fraction when large."""
    policy = Policy()
    assert policy.margin_for(1 * GiB) == 256 * MiB
    assert policy.margin_for(12 * GiB) == int(0.10 * 12 * GiB)
    assert Policy(margin_bytes=0, margin_fraction=0.0).margin_for(12 * GiB) == 0


@given(st.integers(min_value=0, max_value=2**50))
def test_margin_is_never_below_either_rule(peak: int) -> None:
    """The default margin covers both the fixed bytes and the fraction of any peak."""
    margin = Policy().margin_for(peak)
    assert margin >= DEFAULT_MARGIN_BYTES
    assert margin >= int(DEFAULT_MARGIN_FRACTION * peak)


def test_an_unmeasured_key_is_priced_at_the_estimate() -> None:
    """Before any child reports, a key's ask is the pool's task_peak, basis estimated."""
    ask = table().ask("entry")
    assert (ask.ask_bytes, ask.basis, ask.samples) == (10 * GiB, "estimated", 0)
    assert ask.measured_peak_bytes is None
    assert ask.describe() == "10.00 GiB (estimated: task_peak)"


def test_a_measured_key_is_priced_at_its_peak_plus_the_margin() -> None:
    """After a report, the ask is the measured peak plus the margin, basis measured."""
    asks = table()
    asks.measure("entry", 6 * GiB)
    ask = asks.ask("entry")
    assert (ask.ask_bytes, ask.basis, ask.samples) == (7 * GiB, "measured", 1)
    assert (ask.measured_peak_bytes, ask.margin_bytes) == (6 * GiB, 1 * GiB)
    assert ask.describe() == "7.00 GiB (measured: 6.00 GiB peak over 1 task + 1.00 GiB margin)"


def test_the_ask_keeps_the_worst_peak_measured() -> None:
    """A smaller later peak does not lower the ask; a larger one raises it."""
    asks = table()
    asks.measure("entry", 6 * GiB)
    assert asks.measure("entry", 4 * GiB).ask_bytes == 7 * GiB
    assert asks.measure("entry", 8 * GiB).ask_bytes == 9 * GiB
    assert asks.ask("entry").samples == 3


def test_a_measurement_may_lower_the_ask_below_the_estimate() -> None:
    """A peak well under the estimate lowers the ask (the width may widen)."""
    estimate = parse_size("9.90GiB")
    asks = table(estimate=estimate)
    assert asks.measure("entry", 6_461_325_312).ask_bytes == 6_461_325_312 + GiB < estimate


def test_a_measurement_may_raise_the_ask_above_the_estimate() -> None:
    """A peak over the estimate raises the ask (the width may narrow)."""
    asks = table(estimate=4 * GiB)
    assert asks.measure("entry", 6 * GiB).ask_bytes == 7 * GiB > 4 * GiB


@given(
    st.integers(min_value=1, max_value=64 * GiB),
    st.lists(st.integers(min_value=0, max_value=64 * GiB), min_size=1, max_size=10),
)
def test_measured_ask_is_worst_peak_plus_margin(estimate: int, peaks: list[int]) -> None:
    """For any reports the ask is max(peaks) + margin_for(max(peaks)), whatever the estimate."""
    policy = Policy()
    asks = table(estimate=estimate, policy=policy)
    for peak in peaks:
        asks.measure("k", peak)
    worst = max(peaks)
    ask = asks.ask("k")
    assert ask.ask_bytes == worst + policy.margin_for(worst)
    assert ask.estimate_bytes == estimate
    assert ask.samples == len(peaks)


def test_a_zero_peak_with_no_margin_still_asks_one_byte() -> None:
    """An ask is always positive, so the bound never divides by zero."""
    asks = table(policy=Policy(margin_bytes=0, margin_fraction=0.0))
    assert asks.measure("idle", 0).ask_bytes == 1


def test_keys_are_priced_independently() -> None:
    """A measurement of one key leaves another key at its estimate."""
    asks = table()
    asks.measure("small", 1 * GiB)
    assert asks.ask("small").ask_bytes == 2 * GiB
    assert asks.ask("large").ask_bytes == 10 * GiB
    assert asks.keys() == ("small",)


def test_a_hint_replaces_the_default_estimate_for_its_key() -> None:
    """A per-key hint prices that key; other keys keep the pool's task_peak."""
    asks = table()
    asks.hint("large", 20 * GiB)
    assert asks.ask("large").ask_bytes == 20 * GiB
    assert asks.ask("large").basis == "estimated"
    assert asks.ask("small").ask_bytes == 10 * GiB


def test_a_larger_hint_raises_a_smaller_one_does_not_lower() -> None:
    """Hints only raise a key's estimate: the caller knows an input is bigger, never smaller."""
    asks = table()
    asks.hint("k", 12 * GiB)
    asks.hint("k", 8 * GiB)
    assert asks.ask("k").ask_bytes == 12 * GiB
    asks.hint("k", 16 * GiB)
    assert asks.ask("k").ask_bytes == 16 * GiB


def test_a_hint_never_overrides_a_measurement() -> None:
    """Once measured, a key is priced by its measurement whatever the hints say."""
    asks = table()
    asks.measure("k", 3 * GiB)
    asks.hint("k", 30 * GiB)
    ask = asks.ask("k")
    assert (ask.ask_bytes, ask.basis, ask.estimate_bytes) == (4 * GiB, "measured", 30 * GiB)


def test_keys_are_listed_in_first_seen_order() -> None:
    """keys() lists hinted and measured keys in the order they were first seen."""
    asks = table()
    asks.measure("b", GiB)
    asks.hint("a", GiB)
    asks.measure("c", GiB)
    asks.measure("b", GiB)
    assert asks.keys() == ("b", "a", "c")
