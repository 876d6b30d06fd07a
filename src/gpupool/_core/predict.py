"""Peaks predicted from what a call's arguments say (pure core).

A task's call carries *features*: cheap figures of its arguments worked out in the parent when it is
submitted (a sequence's length, an array's ``nbytes`` or first dimension, a number; see
:mod:`gpupool._pool.features`), named by where they were found (``arg0.len``, ``arg1.nbytes``,
``items.len``, ``arg2``). Each key keeps, per feature, a running least-squares line of measured
peak on that feature (:class:`Line`). A feature *explains* a key's peaks (:func:`choose`) only
when its line is clearly there:

* at least :data:`FIT_FROM_SAMPLES` measured tasks carried it, at :data:`DISTINCT_FROM` distinct
  values at least;
* the peaks grow with it, and the slope is significant at 99.9 % (Student's t with ``n - 2``
  degrees of freedom: 22.3 with four tasks, 10.2 with five), so noise that only looks like a
  trend in a few samples is not taken;
* it explains at least :data:`LEAST_R2` of the peaks' variance.

Among the features that pass, the one with the highest ``R^2`` prices the key's tasks one by one.
Because the slope is significant at the same t the prediction bound uses, the bound grows with
the feature: a larger input is never priced below a smaller one.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

__all__ = [
    "DISTINCT_FROM",
    "FEATURES_PER_KEY",
    "FIT_FROM_SAMPLES",
    "LEAST_R2",
    "Features",
    "Fit",
    "Line",
    "choose",
    "t_999",
]

#: What a call's arguments say: ``(name, value)`` pairs, every value positive and finite.
Features = tuple[tuple[str, float], ...]

#: A feature is tried from this many measured tasks that carried it ...
FIT_FROM_SAMPLES = 4
#: ... at this many distinct values of it at least (two values make any line fit).
DISTINCT_FROM = 3
#: ... and it must explain this share of the peaks' variance.
LEAST_R2 = 0.9
#: The most features kept per key (the first seen): a call with many arguments costs no more.
FEATURES_PER_KEY = 16

#: One-sided 99.9 % quantiles of Student's t by degrees of freedom (n - 1 or n - 2).
_T_999 = (
    (1, 318.31),
    (2, 22.327),
    (3, 10.215),
    (4, 7.173),
    (5, 5.893),
    (6, 5.208),
    (7, 4.785),
    (8, 4.501),
    (9, 4.297),
    (10, 4.144),
    (12, 3.930),
    (15, 3.733),
    (20, 3.552),
    (30, 3.385),
    (60, 3.232),
    (120, 3.160),
)
_T_999_LIMIT = 3.090


def t_999(dof: int) -> float:
    """The 99.9 % one-sided t quantile for ``dof`` degrees of freedom (rounded down: larger)."""
    value = _T_999_LIMIT
    for table_dof, quantile in reversed(_T_999):
        if dof >= table_dof:
            return quantile if dof == table_dof else value
        value = quantile
    return _T_999[0][1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """A line of peak on one feature that explains a key's peaks: the decision log's terms."""

    feature: str
    samples: int
    slope_bytes: float  # bytes of peak per unit of the feature
    intercept_bytes: float
    error_bytes: float  # the residuals' standard deviation
    r2: float
    t_slope: float

    def describe(self) -> str:
        """The fit in words, e.g. ``"arg0.len: peak = 1.00 GiB + 1.75 GiB x arg0.len ..."``."""
        gib = 1024**3
        return (
            f"{self.feature} explains the peaks: peak = {self.intercept_bytes / gib:.3g} GiB + "
            f"{self.slope_bytes / gib:.3g} GiB x {self.feature} over {self.samples} tasks "
            f"(R^2 {self.r2:.3f}, error {self.error_bytes / 1024**2:.0f} MiB)"
        )


@dataclass(slots=True)
class Line:
    """The measured tasks of a key that carried one figure (a told size or a feature): how
    many, the running means and centred sums of squares and products of figure and peak
    (Welford), so that pricing a value does not read every measurement again."""

    n: int = 0
    mean_x: float = 0.0
    mean_peak: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    spp: float = 0.0
    largest_x: float = 0.0
    peak_at_largest: int = 0
    # The largest peak measured at a value up to each value: values ascending, each listed
    # where that largest peak rises (a search finds it for any value).
    step_xs: list[float] = field(default_factory=list)
    step_peaks: list[int] = field(default_factory=list)
    # Up to DISTINCT_FROM distinct values seen (whether a line can be told from two points).
    distinct: set[float] = field(default_factory=set)

    def add(self, x: float, peak_bytes: int) -> None:
        """Count one measured task at ``x`` that peaked at ``peak_bytes``."""
        self.n += 1
        d_x = x - self.mean_x
        d_peak = peak_bytes - self.mean_peak
        self.mean_x += d_x / self.n
        self.mean_peak += d_peak / self.n
        self.sxx += d_x * (x - self.mean_x)
        self.sxy += d_x * (peak_bytes - self.mean_peak)
        self.spp += d_peak * (peak_bytes - self.mean_peak)
        if len(self.distinct) < DISTINCT_FROM:
            self.distinct.add(x)
        if self.n == 1 or x > self.largest_x:
            self.largest_x, self.peak_at_largest = x, peak_bytes
        elif x == self.largest_x:
            self.peak_at_largest = max(self.peak_at_largest, peak_bytes)
        at = bisect.bisect_right(self.step_xs, x)
        if at and self.step_peaks[at - 1] >= peak_bytes:
            return  # a peak as large was measured at a value up to this one
        if at and self.step_xs[at - 1] == x:
            at -= 1
            self.step_peaks[at] = peak_bytes
        else:
            self.step_xs.insert(at, x)
            self.step_peaks.insert(at, peak_bytes)
        end = at + 1
        while end < len(self.step_peaks) and self.step_peaks[end] <= peak_bytes:
            end += 1
        del self.step_xs[at + 1 : end]
        del self.step_peaks[at + 1 : end]

    def peak_up_to(self, x: float) -> int | None:
        """The largest peak measured at a value up to ``x`` (``None``: none was)."""
        at = bisect.bisect_right(self.step_xs, x)
        return self.step_peaks[at - 1] if at else None

    def finite(self) -> bool:
        """Whether the sums are finite (values whose squares pass a float are not)."""
        return math.isfinite(self.sxx) and math.isfinite(self.sxy) and math.isfinite(self.spp)

    def explains(self, feature: str) -> Fit | None:
        """The line's :class:`Fit` where it explains the peaks (module docstring), else ``None``."""
        n = self.n
        if (
            n < FIT_FROM_SAMPLES
            or len(self.distinct) < DISTINCT_FROM
            or self.sxx <= 0
            or self.sxy <= 0
            or self.spp <= 0
            or not self.finite()
        ):
            return None
        slope = self.sxy / self.sxx
        sse = max(0.0, self.spp - slope * self.sxy)
        r2 = 1.0 - sse / self.spp
        error = math.sqrt(sse / (n - 2))
        t_slope = math.inf if error == 0 else slope / (error / math.sqrt(self.sxx))
        if r2 < LEAST_R2 or t_slope < t_999(n - 2):
            return None
        return Fit(
            feature=feature,
            samples=n,
            slope_bytes=slope,
            intercept_bytes=self.mean_peak - slope * self.mean_x,
            error_bytes=error,
            r2=r2,
            t_slope=t_slope,
        )


def choose(lines: dict[str, Line]) -> Fit | None:
    """The feature whose line explains a key's peaks best (highest ``R^2``; the first seen on a
    tie), or ``None`` where none does."""
    best: Fit | None = None
    for feature, line in lines.items():
        found = line.explains(feature)
        if found is not None and (best is None or found.r2 > best.r2):
            best = found
    return best
