"""Byte sizes: what users may write, what they may not, and how the log prints them."""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool import InvalidSizeError, format_size, parse_size
from gpupool._core.units import GiB, KiB, MiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("6GiB", 6 * GiB, id="binary-unit"),
        pytest.param("6.5 GB", 6_500_000_000, id="decimal-unit-with-space"),
        pytest.param("512MiB", 512 * MiB, id="mebibytes"),
        pytest.param("7e9", 7_000_000_000, id="exponent-bare-bytes"),
        pytest.param("6gib", 6 * GiB, id="unit-case-insensitive"),
        pytest.param("  2 KiB ", 2 * KiB, id="surrounding-whitespace"),
        pytest.param(".5KiB", 512, id="leading-point"),
        pytest.param("1.3KiB", 1331, id="a-unit-rounds-down-to-whole-bytes"),
        pytest.param("1.0B", 1, id="whole-bytes-written-with-a-point"),
        pytest.param("8.54 GB", 8_540_000_000, id="exact-decimal-no-float-loss"),
        pytest.param("0", 0, id="zero"),
    ],
)
def test_parse_size_accepts_written_sizes(text: str, expected: int) -> None:
    """Strings with binary, decimal or no units parse to exact whole bytes."""
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(0, 0, id="int-zero"),
        pytest.param(6 * GiB, 6 * GiB, id="int"),
        pytest.param(10**400, 10**400, id="int-larger-than-any-float"),
        pytest.param(6.5e9, 6_500_000_000, id="float"),
        pytest.param(6.0, 6, id="whole-float"),
        pytest.param(np.int64(6 * GiB), 6 * GiB, id="numpy-int"),
        pytest.param(np.float32(512.0), 512, id="numpy-float"),
        pytest.param(Fraction(6, 1), 6, id="fraction-type-whole"),
    ],
)
def test_parse_size_accepts_numbers(value: float, expected: int) -> None:
    """Numbers are bytes, numpy's included; ints are kept exactly, whole floats taken."""
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        pytest.param("-1GiB", r"^size='-1GiB' is not a byte size; write ", id="negative-string"),
        pytest.param(-1, r"^size=-1 is negative; write ", id="negative-int"),
        pytest.param(-0.5, r"^size=-0\.5 is negative; write ", id="negative-float"),
        pytest.param("abc", r"^size='abc' is not a byte size; write ", id="word"),
        pytest.param("NaN", r"^size='NaN' is not a byte size; write ", id="nan-string"),
        pytest.param("inf", r"^size='inf' is not a byte size; write ", id="inf-string"),
        pytest.param(float("nan"), r"^size=nan is not finite; write ", id="nan-float"),
        pytest.param(float("inf"), r"^size=inf is not finite; write ", id="inf-float"),
        pytest.param("1e400GiB", r"^size='1e400GiB' is not finite; write ", id="overflowing"),
        pytest.param("", r"^size='' is not a byte size; write ", id="empty"),
        pytest.param("6 GiBs", r"^size='6 GiBs' is not a byte size; write ", id="unknown-unit"),
        pytest.param(None, r"^size=None is not a byte size; write ", id="none"),
        pytest.param(True, r"^size=True is not a byte size; write ", id="true"),
        pytest.param(False, r"^size=False is not a byte size; write ", id="false"),
        pytest.param([6], r"^size=\[6\] \(list\) is not a byte size; write ", id="list"),
    ],
)
def test_parse_size_rejects_non_sizes(value: object, pattern: str) -> None:
    """Anything that is not a finite, non-negative size raises InvalidSizeError naming it."""
    with pytest.raises(InvalidSizeError, match=pattern) as caught:
        parse_size(value)
    assert caught.value.value is value or caught.value.value == value


def test_invalid_size_is_a_value_error() -> None:
    """InvalidSizeError is a ValueError, so existing ``except ValueError`` clauses catch it."""
    with pytest.raises(ValueError, match=r"^size='abc' is not a byte size"):
        parse_size("abc")


def test_parse_size_names_the_option_and_how_to_write_it() -> None:
    """The message names the option given in ``name`` and shows valid spellings."""
    with pytest.raises(
        InvalidSizeError,
        match=r"^task_peak='lots' is not a byte size; write a non-negative number of bytes, "
        r"optionally with a unit: 6GiB, 6\.5 GB, 512MiB, 7e9\.$",
    ):
        parse_size("lots", name="task_peak")


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        pytest.param(1.5, r"write its unit, such as task_peak='1\.5GiB'", id="float"),
        pytest.param("1.5", r"write its unit, such as task_peak='1\.5GiB'", id="text"),
        pytest.param(" 0.4 B", r"write its unit, such as task_peak='0\.4GiB'", id="text-bytes"),
        pytest.param(np.float64(2.5), r"write its unit, such as task_peak='2\.5GiB'", id="numpy"),
        pytest.param(Fraction(3, 2), r"write its unit, such as task_peak='1\.5GiB'", id="ratio"),
        pytest.param(
            0.9 * 12 * GiB,
            r"pass a whole number of bytes, such as 11596411699 \(int\(\) of a computed size\)",
            id="computed",
        ),
        pytest.param("1234.5", r"pass a whole number of bytes, such as 1234 ", id="large-text"),
    ],
)
def test_a_fraction_of_a_byte_is_refused_with_the_fix(value: object, fix: str) -> None:
    """A bare number is bytes, which must be whole: task_peak=1.5 (1.5 GiB with its unit left
    out) is refused, saying how to write it, never read as 1 byte."""
    with pytest.raises(
        InvalidSizeError,
        match=rf"^task_peak={re.escape(repr(value))} is a fraction of a byte: .*; {fix}",
    ) as caught:
        parse_size(value, name="task_peak")
    assert caught.value.value is value


@pytest.mark.parametrize("value", [0, "0", "0 GiB", "0.0001 KiB", "0.0"])
def test_parse_size_refuses_zero_when_asked(value: object) -> None:
    """With ``allow_zero=False`` a size that rounds to zero bytes is refused."""
    with pytest.raises(
        InvalidSizeError, match=rf"^task_peak={re.escape(repr(value))} is zero; task_peak must"
    ):
        parse_size(value, name="task_peak", allow_zero=False)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        pytest.param(None, "unknown", id="unreadable"),
        pytest.param(0, "0 B", id="zero"),
        pytest.param(1023, "1023 B", id="bytes"),
        pytest.param(512 * MiB, "512.00 MiB", id="mebibytes"),
        pytest.param(int(9.90 * GiB), "9.90 GiB", id="the-incident-estimate"),
        pytest.param(2 * 1024**4, "2.00 TiB", id="tebibytes"),
        pytest.param(-(2 * GiB), "-2.00 GiB", id="negative-keeps-sign"),
    ],
)
def test_format_size(nbytes: int | None, expected: str) -> None:
    """Sizes print in the largest binary unit with two decimals; None prints as unknown."""
    assert format_size(nbytes) == expected


@given(st.integers(min_value=0, max_value=2**60))
def test_format_then_parse_round_trips_within_rounding(nbytes: int) -> None:
    """A printed size parses back to within the two-decimal rounding of its unit."""
    back = parse_size(format_size(nbytes))
    # Two decimals in a unit of at least 1 lose at most half a hundredth of
    # that unit, i.e. at most 0.5 % of the value; floor can lose one byte more.
    assert abs(back - nbytes) <= nbytes * 0.005 + 1


@given(st.integers(min_value=0, max_value=2**80))
def test_parse_size_of_an_int_or_its_text_is_exact(nbytes: int) -> None:
    """An int, or its decimal text, parses to exactly that many bytes."""
    assert parse_size(nbytes) == nbytes
    assert parse_size(str(nbytes)) == nbytes


@given(
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=99),
    st.sampled_from([("KB", 1000), ("MB", 1000**2), ("GB", 1000**3), ("GiB", GiB)]),
)
def test_parse_size_with_two_decimals_is_exact(
    whole: int, hundredths: int, unit: tuple[str, int]
) -> None:
    """``"W.HH unit"`` is exactly ``floor((100*W + HH) * unit / 100)`` bytes, with no float loss."""
    name, scale = unit
    text = f"{whole}.{hundredths:02d} {name}"
    assert parse_size(text) == (100 * whole + hundredths) * scale // 100
