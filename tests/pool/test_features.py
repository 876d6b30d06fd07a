"""What a call's arguments say, read at submit: cheap figures only, and a stranger's argument
that misbehaves costs no task."""

from __future__ import annotations

import math

import pytest

from gpupool._pool.features import ARGS_READ, call_features


class Raising:
    """An array-like whose ``nbytes`` raises (a stranger's property)."""

    shape = (3,)

    @property
    def nbytes(self) -> int:
        raise RuntimeError("no")


class Counting:
    """A sequence that is not a built-in: never iterated or measured."""

    def __len__(self) -> int:
        raise AssertionError("len() was called on a payload")


def test_lengths_arrays_and_numbers_are_read_and_named() -> None:
    numpy = pytest.importorskip("numpy")
    found = dict(
        call_features(
            ([1, 2, 3], numpy.zeros((4, 5)), 7, numpy.float32(2.5), "abcd"), {"items": {1: 2}}
        )
    )
    assert found == {
        "arg0.len": 3.0,
        "arg1.nbytes": 160.0,
        "arg1.shape0": 4.0,
        "arg2": 7.0,
        "arg3": 2.5,
        "arg4.len": 4.0,
        "items.len": 1.0,
    }


def test_a_tensor_is_read_by_nbytes_and_shape() -> None:
    torch = pytest.importorskip("torch")
    assert dict(call_features((torch.zeros(6, 2),), {})) == {
        "arg0.nbytes": 48.0,
        "arg0.shape0": 6.0,
    }


def test_what_is_not_a_positive_finite_figure_is_left_out() -> None:
    assert call_features((0, -3, math.nan, math.inf, True, None, [], 10**400), {}) == ()


def test_a_strangers_argument_that_raises_or_is_not_builtin_is_skipped() -> None:
    assert call_features((Raising(), Counting(), object()), {}) == ()


def test_only_the_first_arguments_are_read() -> None:
    found = call_features(tuple(range(1, 100)), {f"k{i}": i + 1 for i in range(100)})
    assert len(found) == 2 * ARGS_READ
