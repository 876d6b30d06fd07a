"""The pricing policy: defaults, and the per-key ask that learns from children (pure core).

A task key's ask starts from the caller's ``task_peak`` (basis
``estimated``). Once a child of that key reports its device peak, the ask
becomes the largest peak measured for the key plus a margin (basis
``measured``). The measurement may lower the ask as well as raise it, so it
moves the width either way; the bound keeps it from moving past the room.
Two rules hold whatever the measurements say:

* evidence never lowers a price: once a task of a key ran out of memory, the
  key's ask never falls below what it was before (:meth:`AskTable.floor`);
* with ``Policy(learned=True)`` (the pool's default) the margin is learned
  from how much the key's measurements vary (:func:`learned_margin`): a
  cautious prior with one sample, shrinking toward :data:`MARGIN_FLOOR_BYTES`
  as samples agree, growing with their spread as they disagree, but never by
  more than the range the peaks were measured over (``max - min``);
* a learned measured ask never passes the room for one task of the tightest of
  the pool's cards that holds its largest peak (:meth:`AskTable.room_for`), nor
  falls below the largest peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpupool._core.bound import AskBasis
from gpupool._core.predict import FEATURES_PER_KEY, Features, Fit, Line, choose, t_999
from gpupool._core.units import MiB, format_size

#: Every figure that prices a key's tasks on a card (:meth:`Ask.price_terms`).
PriceTerms = tuple[str, int, str, bool, int, int, int, int, int, int]

__all__ = [
    "DEFAULT_MARGIN_BYTES",
    "DEFAULT_MARGIN_FRACTION",
    "DEFAULT_RESERVE_BYTES",
    "MARGIN_FLOOR_BYTES",
    "Ask",
    "AskTable",
    "Policy",
    "learned_margin",
    "peaks_vary",
]

#: Margin added to a measured peak, in bytes, at least. The same task on the
#: same inputs does not land on the same bytes twice: the caching allocator
#: rounds segments up (2 MiB small pool, 20 MiB+ large blocks), fragmentation
#: differs with the order of frees, and library workspaces (cuBLAS, cuDNN) are
#: sized per stream. 256 MiB covers those on the cards we have figures for.
DEFAULT_MARGIN_BYTES = 256 * MiB

#: Margin as a fraction of the measured peak, when that is larger: a task with
#: a 12 GiB peak varies by more than a fixed 256 MiB between inputs.
DEFAULT_MARGIN_FRACTION = 0.10

#: The least learned margin. Two measured peaks of the same task can differ by
#: allocation granules without any change in the work: PyTorch's caching
#: allocator packs requests between 1 and 10 MiB into 20 MiB segments
#: (``kLargeBuffer``), rounds larger ones up to 2 MiB (``kRoundLarge``) and
#: packs small ones in 2 MiB blocks (``kSmallBuffer``); cuBLAS takes a workspace
#: per (handle, stream) through that allocator, 8 MiB + 128 KiB by default and
#: 32 MiB on Hopper, so a task that happens to run on one more stream holds one
#: more. 64 MiB covers one 20 MiB segment, one 32 MiB workspace and a few 2 MiB
#: blocks (20 + 32 + 3 x 2 = 58 MiB). It does not cover the sampler's blind
#: spot (an allocation that lives shorter than one NVML sampling interval): the
#: probe prefers the driver's exact per-process high-water where one is kept. The
#: card's room for one task comes first: a peak within this floor of the room is
#: priced at the room (:attr:`Ask.room_capped`).
MARGIN_FLOOR_BYTES = 64 * MiB

#: One-sided 99.9 % quantiles of Student's t by degrees of freedom, for the upper prediction
#: bound of the next peak from n samples (:func:`~gpupool._core.predict.t_999`).
_t_999 = t_999

#: The spread term starts at three samples (two degrees of freedom). With two,
#: the 99.9 % quantile is 318: two peaks of the same task that differ by one
#: 20 MiB allocator segment would add 7.6 GiB to the ask. Until then the prior
#: (``prior / n**2``) prices the key, above the worst peak measured.
_SPREAD_FROM_SAMPLES = 3

#: A line of peak on input size is fitted from four sized measurements (two degrees of
#: freedom: the 99.9 % t quantile is 22.3; with one it is 318).
_FIT_FROM_SAMPLES = 4

#: A key's peaks "vary a lot" (:func:`peaks_vary`) from this many measurements on, when the
#: largest is more than :data:`VARY_RATIO` times the least.
VARY_FROM_SAMPLES = 3
VARY_RATIO = 2.0
#: ... and they lie more than this far apart: within the least learned margin they differ by
#: allocator granules, and the margin is that floor whatever their ratio.
VARY_LEAST_RANGE_BYTES = MARGIN_FLOOR_BYTES

#: The most sizes of one key whose asks are kept (:meth:`AskTable.ask_for`) before they are
#: forgotten (and derived again when read).
_SIZED_CACHE_LIMIT = 1024

#: The most a sized ask is priced at: 1 EiB, more than any card, so a task predicted past it
#: starts only at the serial floor (a size the caller's unit makes astronomical is no float
#: overflow that stops the pool).
_SIZED_ASK_LIMIT_BYTES = 2**60


def _whole_bytes(value: float) -> int:
    """``value`` rounded up to whole bytes, at most :data:`_SIZED_ASK_LIMIT_BYTES` (an
    infinite or undefined figure, from sizes whose squares pass a float, is the limit)."""
    if not value < _SIZED_ASK_LIMIT_BYTES:
        return _SIZED_ASK_LIMIT_BYTES
    return max(0, math.ceil(value))


def _predict_peak(line: Line, size: float) -> tuple[float, float] | None:
    """The peak ``line`` predicts at ``size`` and its upper 99.9 % prediction bound (Student's
    t with ``n - 2`` degrees of freedom); ``None`` before :data:`_FIT_FROM_SAMPLES` measured
    tasks, with one size only, with peaks that do not grow with size, or sums not finite."""
    n = line.n
    sxx, sxy = line.sxx, line.sxy
    if not (n >= _FIT_FROM_SAMPLES and sxx > 0 and sxy > 0 and line.finite()):
        return None
    slope = sxy / sxx
    intercept = line.mean_peak - slope * line.mean_x
    sse = max(0.0, line.spp - slope * sxy)
    sigma = math.sqrt(sse / (n - 2))
    predicted = intercept + slope * size
    away = size - line.mean_x
    bound = predicted + _t_999(n - 2) * sigma * math.sqrt(1 + 1 / n + away * away / sxx)
    return predicted, bound


def learned_margin(
    *,
    samples: int,
    mean_bytes: float,
    stdev_bytes: float,
    max_bytes: int,
    prior_bytes: int,
    floor_bytes: int = 0,
    min_bytes: int | None = None,
) -> int:
    """The margin over ``max_bytes`` that a key's measurements justify.

    ``max(floor, min(ucb - max, max - min), prior / samples**2)`` where ``ucb = mean + t *
    s * sqrt(1 + 1/n)`` is the upper 99.9 % prediction bound of the next peak
    (Student's t with ``n - 1`` degrees of freedom, ``s`` the sample standard
    deviation), from three samples on: with one sample the margin is the prior (with
    two, a quarter of it); as samples agree it
    falls toward the floor (the prior's share fades with the square of the
    count); as they disagree it grows with their spread, but never past the
    range they were measured over (``max - min``): with few samples t is large
    (22.3 with three), and peaks 0.5-4 GiB apart would otherwise add 47 GiB,
    more than the measurements show. It assumes the
    key's peaks are independent draws of one distribution; a peak that
    depends on the input (a larger input than any before) is not predicted
    and is caught by the out-of-memory retry instead.

    Args:
        samples: how many peaks were measured (at least 1).
        mean_bytes: their mean.
        stdev_bytes: their sample standard deviation (0 for one sample).
        max_bytes: the largest.
        prior_bytes: the margin a single sample gets.
        floor_bytes: the least margin.
        min_bytes: the least peak (``None``: the spread term is not limited by the range).
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    prior = prior_bytes / (samples * samples)
    spread = 0.0
    if samples >= _SPREAD_FROM_SAMPLES:
        ucb = mean_bytes + _t_999(samples - 1) * stdev_bytes * math.sqrt(1 + 1 / samples)
        spread = ucb - max_bytes
        if min_bytes is not None:
            spread = min(spread, max_bytes - min_bytes)
    return max(floor_bytes, math.ceil(max(prior, spread)))


def peaks_vary(samples: int, min_bytes: int, max_bytes: int) -> bool:
    """A key's peaks vary a lot: at least :data:`VARY_FROM_SAMPLES` measurements, the largest
    more than :data:`VARY_RATIO` times the least and more than
    :data:`VARY_LEAST_RANGE_BYTES` above it (its tasks are not one workload: give them
    ``size=`` or separate keys)."""
    return (
        samples >= VARY_FROM_SAMPLES
        and max_bytes > VARY_RATIO * max(0, min_bytes)
        and max_bytes - min_bytes > VARY_LEAST_RANGE_BYTES
    )


#: Bytes kept free on every card beyond the priced terms. Not a pad for an
#: unpriced term (a constant reserve must not paper over one): it covers
#: the driver's own growth while contexts are created and page-granular
#: allocation, which neither the census nor a child's report can see.
DEFAULT_RESERVE_BYTES = 256 * MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How asks are priced and how much is kept free.

    Attributes:
        margin_bytes: least margin over a measured peak (with ``learned``:
            the one-sample prior's least).
        margin_fraction: margin as a fraction of the measured peak, when larger
            (with ``learned``: the one-sample prior's fraction).
        reserve_bytes: bytes kept free on every card.
        learned: learn the margin from the spread of each key's measurements
            (:func:`learned_margin`), starting from ``margin_for`` as the
            prior; ``False`` adds ``margin_for(peak)`` to every measured peak.
        margin_floor_bytes: the least learned margin.
        outliers: keep a peak far outside its key's distribution apart
            (:meth:`AskTable.sample`; the pool's default) rather than pricing the key by it.
    """

    margin_bytes: int = DEFAULT_MARGIN_BYTES
    margin_fraction: float = DEFAULT_MARGIN_FRACTION
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    learned: bool = False
    margin_floor_bytes: int = MARGIN_FLOOR_BYTES
    outliers: bool = False

    def margin_for(self, peak_bytes: int) -> int:
        """The margin for a measured peak: ``max(margin_bytes, fraction * peak)``."""
        return max(self.margin_bytes, int(self.margin_fraction * peak_bytes))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """One task key's price and how it was reached (``size``: the input size a task's ask was
    predicted for, ``None`` for the key's own ask; ``sized_samples``: how many of the key's
    measurements came with a size)."""

    key: str
    ask_bytes: int
    basis: AskBasis
    estimate_bytes: int | None
    measured_peak_bytes: int | None
    margin_bytes: int
    samples: int
    spread_bytes: int = 0
    floor_bytes: int = 0
    mean_bytes: int = 0
    granule_bytes: int = 0
    pooled: bool = False
    capped: bool = False
    size: float | None = None
    least_peak_bytes: int | None = None
    room_capped: bool = False
    sized_samples: int = 0
    # The feature of the call the ask was predicted from (``size`` is its value), if any.
    feature: str | None = None
    # Peaks measured far outside the key's distribution (:meth:`AskTable.sample`): how many,
    # and what one more is priced at; ``outlier_rate``: their share of the key's measurements.
    outliers: int = 0
    outlier_bytes: int = 0
    outlier_rate: float = 0.0
    # ``together_bytes`` by count, worked out once per ask (an ask is never changed: a new
    # price is a new ask, with an empty memo of its own).
    _together: dict[int, int] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    _price: PriceTerms | None = field(
        default=None, init=False, repr=False, compare=False, hash=False
    )

    @property
    def individual(self) -> bool:
        """Whether this ask prices one task on its own (a size, a feature, an outlier's call,
        or the task's own out-of-memory floor), not the key's tasks together."""
        return self.size is not None or self.feature is not None

    def price_terms(self) -> PriceTerms:
        """Every figure that prices this key's tasks on a card (:meth:`together_bytes`,
        ``ask_bytes`` and ``basis``): two asks with the same terms price every count alike,
        so what a card fits at one it fits at the other. The count of samples counts only
        where the spread does (a spread of 0 prices every count of samples alike)."""
        terms = self._price
        if terms is None:
            pooled = self.pooled
            terms = (
                self.key,
                self.ask_bytes,
                self.basis,
                pooled,
                self.mean_bytes if pooled else 0,
                self.granule_bytes if pooled else 0,
                self.spread_bytes if pooled else 0,
                self.samples if pooled and self.spread_bytes else 0,
                self.outlier_bytes,
                round(self.outlier_rate * 1e9),
            )
            object.__setattr__(self, "_price", terms)  # worked out once (a frozen ask)
        return terms

    def together_bytes(self, count: int) -> int:
        """What ``count`` tasks of this key running at once are priced at, together.

        ``count x ask`` unless the key is pooled (a learned margin with at least three
        measurements and no out-of-memory): then the least of ``count x ask`` and
        ``max(ask + (count - 1) x (mean + granule), count x (mean + granule) + t(n - 1) x s x
        sqrt(count + count**2 / n))``, the upper 99.9 % prediction bound of the sum of
        ``count`` new peaks (each with its allocator granule), never below one task at its
        full ask beside the others at the mean. It grows with every further task. Where the
        key had outliers, plus the reserve for those expected among ``count``
        (:meth:`outlier_reserve_bytes`), whether the ask is the key's or one task's own.

        Raises:
            ValueError: ``count`` is negative.
        """
        if count < 0:
            raise ValueError(f"count must be 0 or more tasks, got {count}")
        if count == 0:
            return 0
        if not self.pooled and not self.outlier_rate:
            return count * self.ask_bytes
        known = self._together.get(count)
        if known is None:
            known = self._base_bytes(count) + self.outlier_reserve_bytes(count)
            self._together[count] = known
        return known

    def _base_bytes(self, count: int) -> int:
        """:meth:`together_bytes` without the reserve for outliers."""
        if count <= 1 or not self.pooled:
            return max(0, count) * self.ask_bytes
        return self._pooled_bytes(count)

    def outlier_reserve_bytes(self, count: int) -> int:
        """What ``count`` tasks of this key together keep for outliers: as many as their rate
        makes expected among ``count`` (rounded: ``floor(count x rate + 1/2)``), each at what
        one is priced past the ask (none while the key had none)."""
        return self._expected(count) * max(0, self.outlier_bytes - self.ask_bytes)

    def _pooled_bytes(self, count: int) -> int:
        """:meth:`together_bytes` of a pooled key, for ``count`` of 2 or more."""
        each = self.mean_bytes + self.granule_bytes
        spread = (
            _t_999(self.samples - 1)
            * self.spread_bytes
            * math.sqrt(count + count * count / self.samples)
        )
        pooled = math.ceil(count * each + spread)
        return min(count * self.ask_bytes, max(self.ask_bytes + (count - 1) * each, pooled))

    def next_bytes(self, running: int, together: int | None = None) -> int:
        """The price of one more task at this ask beside ``running`` of its key on a card,
        ``together`` of which (default: all) are priced at the key's ask together (the others
        on their own: a size, a feature, an outlier's call, a task's own floor).

        Its step of the key's price together (``together_bytes(together + 1) -
        together_bytes(together)`` without the reserve: ``ask_bytes`` unpooled), plus one
        outlier's extra (``outlier_bytes - ask_bytes``) where one more is expected among the
        key's ``running + 1`` tasks than among ``running`` (:meth:`outlier_reserve_bytes`): the
        reserve for outliers counts every task of the key on the card, however each is
        priced. With ``together == running`` this is ``together_bytes(running + 1) -
        together_bytes(running)``.

        Raises:
            ValueError: ``running`` or ``together`` is negative.
        """
        return self.more_bytes(1, running, together)

    def more_bytes(self, count: int, running: int, together: int | None = None) -> int:
        """What ``count`` more tasks at this ask book between them beside ``running`` of its key
        on a card, ``together`` of which are priced at the key's ask together (the sum of
        their :meth:`next_bytes`, each placed after the one before).

        Raises:
            ValueError: ``count``, ``running`` or ``together`` is negative.
        """
        if together is None:
            together = running
        for name, value in (("count", count), ("running", running), ("together", together)):
            if value < 0:
                raise ValueError(f"{name} must be 0 or more tasks, got {value}")
        if not count:
            return 0
        if not self.pooled and not self.outlier_rate:
            return count * self.ask_bytes
        base = self._base_bytes(together + count) - self._base_bytes(together)
        if self.outlier_rate:
            expected = self._expected(running + count) - self._expected(running)
            base += expected * max(0, self.outlier_bytes - self.ask_bytes)
        return base

    def _expected(self, count: int) -> int:
        """How many outliers the rate makes expected among ``count`` tasks (rounded)."""
        return math.floor(count * self.outlier_rate + 0.5)

    def _reserve_words(self) -> str:
        """The outliers kept apart from this ask's key, in words ("" where none were)."""
        if not self.outliers:
            return ""
        return (
            f"; {self.outliers} outlier{'s' if self.outliers != 1 else ''} apart "
            f"(rate {self.outlier_rate:.3g}, one priced at {format_size(self.outlier_bytes)})"
        )

    def describe(self) -> str:
        """The ask in words, e.g. ``"7.02 GiB (measured: 6.02 GiB peak + 1.00 GiB margin)"``."""
        floor = ""
        if self.floor_bytes and self.floor_bytes >= self.ask_bytes:
            floor = f"; held at {format_size(self.floor_bytes)}, its price before an out-of-memory"
        if self.feature == OUTLIER_FEATURE:
            return (
                f"{format_size(self.ask_bytes)} (measured: an outlier of {self.key} at "
                f"{format_size(self.measured_peak_bytes)}, priced at its own peak for this "
                f"task + {format_size(self.margin_bytes)} margin; the key's other tasks keep "
                "their price)"
            )
        if self.basis == "measured" and self.size is not None:
            held = ", held at the card's room for one task" if self.room_capped else ""
            return (
                f"{format_size(self.ask_bytes)} (measured: {format_size(self.measured_peak_bytes)} "
                f"predicted for {self.feature or 'size'} {self.size:g} from {self.samples} "
                f"task{'s' if self.samples != 1 else ''} with "
                f"{'that feature' if self.feature else 'sizes'} + "
                f"{format_size(self.margin_bytes)} margin{held}{floor}{self._reserve_words()})"
            )
        if self.basis == "measured":
            capped = ", held at the task_peak estimate" if self.capped else ""
            if self.room_capped:
                capped = ", held at the card's room for one task"
            pooled = ""
            if self.pooled:
                pooled = (
                    f"; tasks together priced from the mean {format_size(self.mean_bytes)} and "
                    f"spread {format_size(self.spread_bytes)}"
                )
            pooled += self._reserve_words()
            return (
                f"{format_size(self.ask_bytes)} (measured: "
                f"{format_size(self.measured_peak_bytes)} peak over {self.samples} "
                f"task{'s' if self.samples != 1 else ''} + {format_size(self.margin_bytes)} "
                f"margin{capped}{floor}{pooled})"
            )
        return f"{format_size(self.ask_bytes)} (estimated: task_peak{floor})"


#: A peak is an outlier of its key (:func:`outlier_above`) once the key has this many peaks ...
OUTLIER_FROM = 5
#: ... when it is more than this many times the key's mean peak (or the fit's prediction) ...
OUTLIER_RATIO = 2.0
#: ... and past the key's largest peak by more than this many times the range of its peaks.
OUTLIER_RANGES = 2.0
#: ... and by at least this many bytes (peaks a few allocator granules apart are one workload).
OUTLIER_LEAST_BYTES = 1024 * MiB
#: Outliers stop being kept apart once they are more than this share of the key's measurements
#: (and more than one): they are part of the workload, and join its peaks.
OUTLIER_SHARE = 0.1
#: The most outlier peaks kept per key (their count goes on).
OUTLIERS_KEPT = 64
#: ``Ask.feature`` of a task priced at the peak of an outlier whose call it resembles.
OUTLIER_FEATURE = "outlier"


def outlier_above(state: _KeyState, features: Features) -> float:
    """The peak above which a new measurement of a key in ``state`` is an outlier: past
    :data:`OUTLIER_RATIO` times the key's mean peak and past its largest peak by
    :data:`OUTLIER_RANGES` times the range of its peaks, from :data:`OUTLIER_FROM` peaks on
    (infinite before). Where a feature of the calls explains the key's peaks and the task's
    call has it, :data:`OUTLIER_RATIO` times the line's prediction there, plus six of its
    errors, is the mark instead (a large input is no outlier)."""
    if state.samples < OUTLIER_FROM or state.peak_bytes is None or state.least_bytes is None:
        return math.inf
    fit = state.chosen
    if fit is not None:
        value = next((v for name, v in features if name == fit.feature), None)
        if value is not None:
            predicted = max(0.0, fit.intercept_bytes + fit.slope_bytes * value)
            return max(
                OUTLIER_RATIO * predicted + 6 * fit.error_bytes,
                predicted + OUTLIER_LEAST_BYTES,
            )
    spread = state.peak_bytes - state.least_bytes
    return max(
        OUTLIER_RATIO * state.mean_bytes,
        state.peak_bytes + max(OUTLIER_RANGES * spread, OUTLIER_LEAST_BYTES),
    )


@dataclass(slots=True)
class _KeyState:
    estimate_bytes: int | None
    peak_bytes: int | None = None
    least_bytes: int | None = None
    samples: int = 0
    # Welford's running mean and sum of squared deviations of the peaks.
    mean_bytes: float = 0.0
    m2: float = 0.0
    # What an out-of-memory proved: the ask never falls below it.
    floor_bytes: int = 0
    # The key's own ask (not a size's or a feature's) before an out-of-memory of one of its
    # tasks priced on its own: the key's ask never falls below it (AskTable.hold).
    held_bytes: int = 0
    # The measured tasks that were given a size (``options(size=...)``).
    told: Line = field(default_factory=Line)
    # By feature of the calls (:mod:`~gpupool._core.predict`), the measured tasks that carried it
    # (the first FEATURES_PER_KEY features seen), and the one that explains the peaks, if any.
    lines: dict[str, Line] = field(default_factory=dict)
    chosen: Fit | None = None
    # Peaks kept apart as outliers (AskTable.sample): how many, the largest, each peak with
    # its call's features (the first OUTLIERS_KEPT), and by features the largest such peak
    # where those features tell it from the key's other tasks; ``merged``: they were not rare,
    # and joined the key's peaks (no more are kept apart).
    outliers: int = 0
    outlier_top_bytes: int = 0
    outlier_peaks: list[tuple[int, Features]] = field(default_factory=list)
    outlier_features: dict[Features, int] = field(default_factory=dict)
    merged: bool = False
    # What an earlier run measured the key to hold (AskTable.remember), until a measurement
    # of this run contradicts it; ``contradicted``: one did.
    remembered_bytes: int | None = None
    contradicted: bool = False
    # The features of the key's other measured tasks (the first OUTLIERS_KEPT * 16 kinds).
    seen_features: set[Features] = field(default_factory=set)

    def add_outlier(self, peak_bytes: int, features: Features) -> None:
        """Keep one outlier's peak apart from the key's distribution."""
        self.outliers += 1
        self.outlier_top_bytes = max(self.outlier_top_bytes, peak_bytes)
        if len(self.outlier_peaks) < OUTLIERS_KEPT:
            self.outlier_peaks.append((peak_bytes, features))
            if features and features not in self.seen_features:
                known = self.outlier_features.get(features, 0)
                self.outlier_features[features] = max(known, peak_bytes)

    @property
    def sized(self) -> int:
        """How many measured tasks were given a size."""
        return self.told.n

    def add_features(self, features: Features, peak_bytes: int) -> None:
        """Count one measured task whose call had ``features``; choose the feature again."""
        if len(self.seen_features) < OUTLIERS_KEPT * 16:
            self.seen_features.add(features)
        self.outlier_features.pop(features, None)  # no longer tells an outlier apart
        for name, value in features:
            line = self.lines.get(name)
            if line is None:
                if len(self.lines) >= FEATURES_PER_KEY:
                    continue
                line = self.lines[name] = Line()
            line.add(value, peak_bytes)
        self.chosen = choose(self.lines)


@dataclass(slots=True)
class AskTable:
    """Per-key asks: the estimate until measured, then the worst peak plus a margin.

    Args:
        policy: the margin to add to measurements.
        default_estimate_bytes: the pool's ``task_peak``, used for keys that
            were given no estimate of their own.
        rooms_bytes: the room for one task of each of the pool's cards (its bound
            without the other pools' bookings), least first (empty: unknown): with a
            learned margin, a measured ask is never priced past :meth:`room_for` its
            largest peak, nor below that peak (a peak past every room is priced at that
            peak: its task runs alone, at the serial floor). Set by the planner
            (:meth:`limit_to_room`).
    """

    policy: Policy
    default_estimate_bytes: int
    rooms_bytes: tuple[int, ...] = ()
    _keys: dict[str, _KeyState] = field(default_factory=dict)
    _cache: dict[str, Ask] = field(default_factory=dict)
    # ``ask_for`` by key and size, until the key's ask changes (dropped with ``_cache[key]``).
    _sized_cache: dict[str, dict[tuple[str | None, float], Ask]] = field(default_factory=dict)

    def _forget(self, key: str) -> None:
        """``key``'s price may change: its asks are derived again when next read."""
        self._cache.pop(key, None)
        self._sized_cache.pop(key, None)

    def limit_to_room(self, room_bytes: int | Iterable[int] | None) -> bool:
        """Price no learned measured ask past the room of the tightest card that holds its
        largest peak (``room_bytes``: one card's room, or each card's; ``None``: no limit)
        from now on. Returns whether the rooms changed (asks may have moved)."""
        if room_bytes is None:
            rooms: tuple[int, ...] = ()
        elif isinstance(room_bytes, int):
            rooms = (room_bytes,)
        else:
            rooms = tuple(sorted(room_bytes))
        if rooms == self.rooms_bytes:
            return False
        self.rooms_bytes = rooms
        self._cache.clear()
        self._sized_cache.clear()
        return True

    def room_for(self, peak_bytes: int) -> int | None:
        """The room a key whose largest peak is ``peak_bytes`` is held within: the least room
        of a card that holds that peak with the least learned margin (so its ask fits each
        such card), else the largest room; ``None`` when no room is known."""
        floor = self.policy.margin_floor_bytes
        fits = (room for room in self.rooms_bytes if room >= peak_bytes + floor)
        return next(fits, self.rooms_bytes[-1] if self.rooms_bytes else None)

    def hint(self, key: str, estimate_bytes: int) -> None:
        """Give ``key`` an estimate of its own (a per-task peak hint).

        A hint never overrides a measurement; a larger hint after a smaller
        one raises the estimate (the caller knows this input is bigger).
        """
        self._forget(key)
        state = self._keys.get(key)
        if state is None:
            self._keys[key] = _KeyState(estimate_bytes=estimate_bytes)
        elif state.estimate_bytes is None or estimate_bytes > state.estimate_bytes:
            state.estimate_bytes = estimate_bytes

    def measure(self, key: str, peak_bytes: int, size: float | None = None) -> Ask:
        """Record a child's measured device peak for ``key`` (of a task given ``size``);
        returns the new ask."""
        self.sample(key, peak_bytes, size)
        return self.ask(key)

    def sample(
        self, key: str, peak_bytes: int, size: float | None = None, features: Features = ()
    ) -> bool:
        """Record a child's measured device peak for ``key`` (of a task given ``size``, whose
        call had ``features``); the new ask is derived when it is next asked for (:meth:`ask`).

        A peak far outside the key's distribution (:func:`outlier_above`) is kept apart: it
        does not join the key's peaks, it prices the tasks whose calls have the same features
        (where those tell it from the others), and the rate of such peaks prices the risk of
        another (:meth:`Ask.outlier_reserve_bytes`). Where they are no longer rare
        (:data:`OUTLIER_SHARE`), they join the key's peaks. Returns whether it was an outlier."""
        self._forget(key)
        state = self._keys.setdefault(key, _KeyState(estimate_bytes=None))
        if self.is_outlier(key, peak_bytes, features) and size is None:
            state.add_outlier(peak_bytes, features)
            if state.outliers > max(1, OUTLIER_SHARE * (state.samples + state.outliers)):
                state.merged = True  # not rare: one workload whose peaks vary
                for peak, kept in state.outlier_peaks:
                    self._add(state, peak, None, kept)
            return not state.merged
        self._add(state, peak_bytes, size, features)
        return False

    def remember(self, key: str, peak_bytes: int) -> Ask:
        """An earlier run measured ``key``'s tasks at ``peak_bytes`` on this card model: until
        this run measures one, the key is estimated at that peak plus the one-sample margin
        (over the pool's ``task_peak``, and over a per-task hint before it). Returns the ask."""
        state = self._keys.setdefault(key, _KeyState(estimate_bytes=None))
        if state.samples == 0 and not state.contradicted:
            self._forget(key)
            state.remembered_bytes = peak_bytes
            state.estimate_bytes = peak_bytes + self.policy.margin_for(peak_bytes)
        return self.ask(key)

    def contradicted(self, key: str) -> bool:
        """Whether a measurement of this run contradicted what an earlier run remembered."""
        state = self._keys.get(key)
        return state is not None and state.contradicted

    def _add(
        self, state: _KeyState, peak_bytes: int, size: float | None, features: Features
    ) -> None:
        remembered = state.remembered_bytes
        if remembered is not None and state.samples == 0:
            granule = self.policy.margin_floor_bytes
            if not remembered / 2 - granule <= peak_bytes <= remembered + granule:
                # The first new measurement contradicts the memory: it is dropped (the key is
                # priced from this run's measurements over the pool's task_peak).
                state.contradicted = True
                state.estimate_bytes = None
            state.remembered_bytes = None
        if size is not None:
            state.told.add(size, peak_bytes)
        if features:
            state.add_features(features, peak_bytes)
        state.samples += 1
        delta = peak_bytes - state.mean_bytes
        state.mean_bytes += delta / state.samples
        state.m2 += delta * (peak_bytes - state.mean_bytes)
        if state.peak_bytes is None or peak_bytes > state.peak_bytes:
            state.peak_bytes = peak_bytes
        if state.least_bytes is None or peak_bytes < state.least_bytes:
            state.least_bytes = peak_bytes

    def is_outlier(self, key: str, peak_bytes: int, features: Features = ()) -> bool:
        """Whether ``peak_bytes`` (of a task of ``key`` whose call had ``features``) lies far
        outside the key's distribution (:func:`outlier_above`), as :meth:`sample` would keep
        it apart."""
        state = self._keys.get(key)
        return (
            self.policy.outliers
            and state is not None
            and not state.sized
            and not state.merged
            and peak_bytes > outlier_above(state, features)
        )

    def predictor(self, key: str) -> Fit | None:
        """The feature of the calls that explains ``key``'s peaks, with its fit (``None``:
        none does, or its tasks are told their sizes)."""
        state = self._keys.get(key)
        if state is None or state.sized:
            return None
        return state.chosen

    def floor(self, key: str, floor_bytes: int) -> Ask:
        """Never price ``key`` below ``floor_bytes`` again (what an out-of-memory proved).

        Returns:
            The new ask, at least ``floor_bytes`` and at least the ask before.
        """
        self._forget(key)
        state = self._keys.setdefault(key, _KeyState(estimate_bytes=None))
        state.floor_bytes = max(state.floor_bytes, floor_bytes)
        return self.ask(key)

    def hold(self, key: str, ask_bytes: int) -> Ask:
        """Never price ``key``'s own ask below ``ask_bytes`` again, without raising the price
        of its tasks priced on their own (a size, a feature): what an out-of-memory of such a
        task, or of an outlier, says of the key's ask (evidence never lowers a price). Returns
        the key's ask."""
        self._forget(key)
        state = self._keys.setdefault(key, _KeyState(estimate_bytes=None))
        state.held_bytes = max(state.held_bytes, ask_bytes)
        return self.ask(key)

    def ask(self, key: str) -> Ask:
        """The current price of a task of ``key``."""
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        ask = self._derive(key)
        self._cache[key] = ask
        return ask

    def _derive(self, key: str) -> Ask:
        """The key's price from its state: the estimate until it is measured."""
        state = self._keys.get(key)
        estimate = self.default_estimate_bytes
        if state is not None and state.estimate_bytes is not None:
            estimate = state.estimate_bytes
        if state is not None and state.peak_bytes is not None:
            return self._derive_measured(key, state, state.peak_bytes, estimate)
        floor = max(state.floor_bytes, state.held_bytes) if state is not None else 0
        return Ask(
            key=key,
            ask_bytes=max(estimate, floor),
            basis="estimated",
            estimate_bytes=estimate,
            measured_peak_bytes=None,
            margin_bytes=0,
            samples=0,
            floor_bytes=floor,
        )

    def _derive_measured(
        self, key: str, state: _KeyState, peak_bytes: int, estimate_bytes: int
    ) -> Ask:
        """A measured key's price: its largest ``peak_bytes`` plus the margin, with the evidence."""
        stdev_bytes = math.sqrt(state.m2 / (state.samples - 1)) if state.samples > 1 else 0.0
        granule_bytes = self.policy.margin_floor_bytes if self.policy.learned else 0
        margin, capped, room_capped = self._derive_margin(
            state, peak_bytes, estimate_bytes, stdev_bytes
        )
        return Ask(
            key=key,
            ask_bytes=max(1, peak_bytes + margin, state.floor_bytes, state.held_bytes),
            basis="measured",
            estimate_bytes=estimate_bytes,
            measured_peak_bytes=peak_bytes,
            margin_bytes=margin,
            samples=state.samples,
            spread_bytes=round(stdev_bytes),
            floor_bytes=max(state.floor_bytes, state.held_bytes),
            mean_bytes=round(state.mean_bytes),
            granule_bytes=granule_bytes,
            pooled=(
                self.policy.learned
                and state.samples >= _SPREAD_FROM_SAMPLES
                and state.floor_bytes == 0
                and not state.sized
            ),
            capped=capped,
            least_peak_bytes=state.least_bytes,
            room_capped=room_capped,
            sized_samples=state.sized,
            outliers=state.outliers if not state.merged else 0,
            outlier_bytes=(
                state.outlier_top_bytes + granule_bytes
                if state.outliers and not state.merged
                else 0
            ),
            outlier_rate=(
                state.outliers / (state.samples + state.outliers)
                if state.outliers and not state.merged
                else 0.0
            ),
        )

    def _derive_margin(
        self, state: _KeyState, peak_bytes: int, estimate_bytes: int, stdev_bytes: float
    ) -> tuple[int, bool, bool]:
        """The margin over ``peak_bytes``, and whether the estimate or the room capped it."""
        prior = self.policy.margin_for(peak_bytes)
        if not self.policy.learned:
            return prior, False, False
        margin = learned_margin(
            samples=state.samples,
            mean_bytes=state.mean_bytes,
            stdev_bytes=stdev_bytes,
            max_bytes=peak_bytes,
            prior_bytes=prior,
            floor_bytes=self.policy.margin_floor_bytes,
            min_bytes=state.least_bytes,
        )
        capped = room_capped = False
        granule_bytes = self.policy.margin_floor_bytes  # the least learned margin
        if estimate_bytes >= peak_bytes + granule_bytes and peak_bytes + margin > estimate_bytes:
            # No measurement has passed the caller's estimate: the spread of a few
            # samples does not price the key above what the caller vouched for.
            margin = estimate_bytes - peak_bytes
            capped = True
        room = self.room_for(peak_bytes)
        if room is not None and room < peak_bytes + margin:
            # No margin prices the key off the card (a peak past the room: at that peak).
            margin = max(0, room - peak_bytes)
            room_capped = True
        return margin, capped, room_capped

    def ask_for(self, key: str, size: float | None, features: Features = ()) -> Ask:
        """The price of one task of ``key`` whose input has ``size`` (``None``: the key's ask).

        From :data:`_FIT_FROM_SAMPLES` measured tasks with sizes (two sizes at least, and
        peaks that grow with size), a least-squares line of peak on size predicts the task's
        peak; the ask is the upper 99.9 % prediction bound there (Student's t with ``n - 2``
        degrees of freedom) plus the allocator granule. It is never below the largest peak
        measured at a size up to this one (peaks do not shrink as inputs grow), and never
        above the key's ask for a size within those measured (the key's worst peak covers
        it). Past the largest size measured it is never below the key's ask, nor above the
        key's ask scaled by the size (before the fit, it is that: a peak grows at most in
        proportion to its input); any other size gets the key's ask. With a learned margin
        and the card's room known (:meth:`limit_to_room`), no size is priced past the room
        unless its predicted peak, a peak measured at a size up to it or an out-of-memory's
        floor is. Sized asks are never priced together. After an out-of-memory, never below
        its floor.
        """
        base = self.ask(key)
        state = self._keys.get(key)
        if state is None or base.basis != "measured":
            return base
        found = base
        feature: str | None = None
        line = state.told
        if size is None and state.chosen is not None and not state.sized:
            feature = state.chosen.feature
            size = next((value for name, value in features if name == feature), None)
            line = state.lines[feature]
        if size is not None and line.n:
            cache = self._sized_cache.setdefault(key, {})
            slot = (feature, size)
            cached = cache.get(slot)
            if cached is None:
                if len(cache) >= _SIZED_CACHE_LIMIT:
                    cache.clear()
                cached = cache[slot] = self._sized_ask(base, state, line, size, feature)
            found = cached
        if state.outlier_peaks and features and features in state.outlier_features:
            # A call like an outlier's (its features told it from the key's other tasks): at
            # that outlier's own peak.
            peak = state.outlier_features[features]
            granule = self.policy.margin_floor_bytes
            if peak + granule > found.ask_bytes:
                found = dataclasses.replace(
                    found,
                    ask_bytes=peak + granule,
                    measured_peak_bytes=peak,
                    margin_bytes=granule,
                    pooled=False,
                    feature=OUTLIER_FEATURE,
                )
        return found

    def _sized_ask(
        self, base: Ask, state: _KeyState, line: Line, size: float, feature: str | None
    ) -> Ask:
        """:meth:`ask_for` a value of a key's told size or chosen feature (``line``: its
        measurements; the key's ask is ``base``)."""
        granule = self.policy.margin_floor_bytes
        largest = line.largest_x
        fit = _predict_peak(line, size)
        if fit is None:
            if size <= largest:
                return base
            ask = _whole_bytes(base.ask_bytes * (size / largest))
            predicted = line.peak_at_largest * (size / largest)
        else:
            predicted, bound = fit
            below = line.peak_up_to(size) or 0
            ask = max(_whole_bytes(bound + granule), below + granule)
            if size <= largest:
                ask = min(ask, base.ask_bytes)
            elif feature is not None:
                # A feature's line passed a significance test (:mod:`~gpupool._core.predict`):
                # past the largest value, its bound, within the key's ask scaled by the value,
                # and never below the peak measured at the largest value.
                scaled = _whole_bytes(base.ask_bytes * (size / largest))
                ask = max(min(ask, scaled), line.peak_at_largest + granule)
            else:
                # A peak grows at most in proportion to its input: the line's bound (t = 22.3
                # with four tasks) prices no size past the key's ask scaled by it.
                scaled = _whole_bytes(base.ask_bytes * (size / largest))
                ask = max(min(ask, scaled), base.ask_bytes)
        ask = max(1, ask, state.floor_bytes)
        peak = _whole_bytes(max(0.0, predicted))
        room, room_capped = self.room_for(max(peak, line.peak_up_to(size) or 0)), False
        if self.policy.learned and room is not None and ask > room:
            # As the key's ask: no margin prices a task off the card (a predicted or
            # measured peak past the room, or an out-of-memory's floor: at that).
            ask = max(1, room, peak, line.peak_up_to(size) or 0, state.floor_bytes)
            room_capped = True
        return dataclasses.replace(
            base,
            ask_bytes=ask,
            measured_peak_bytes=peak,
            margin_bytes=ask - peak,
            samples=line.n,
            pooled=False,
            capped=False,
            size=size,
            room_capped=room_capped,
            feature=feature,
            floor_bytes=state.floor_bytes,
        )

    def keys(self) -> tuple[str, ...]:
        """Every key priced so far, in first-seen order."""
        return tuple(self._keys)

    def priced(self, key: str) -> None:
        """A task of ``key`` was submitted: :meth:`keys` lists the key from now on, at its
        estimate until it is measured (its price is unchanged)."""
        self._keys.setdefault(key, _KeyState(estimate_bytes=None))


# Re-exported by gpupool, which may not have imported this module yet (it loads it on
# first use): the public path is set here, so reprs, docs and pickles name it whenever used.
Ask.__module__ = "gpupool"
