"""The pricing policy: defaults, and the per-key ask that learns from children (pure core).

A task key's ask starts from the caller's ``task_peak`` (basis
``estimated``). Once a child of that key reports its device peak, the ask
becomes the largest peak measured for the key plus a margin (basis
``measured``). The measurement may lower the ask as well as raise it, so it
moves the width either way; the bound keeps it from moving past the room.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpupool._core.bound import AskBasis
from gpupool._core.units import MiB, format_size

__all__ = [
    "DEFAULT_MARGIN_BYTES",
    "DEFAULT_MARGIN_FRACTION",
    "DEFAULT_RESERVE_BYTES",
    "Ask",
    "AskTable",
    "Policy",
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

#: Bytes kept free on every card beyond the priced terms. Not a pad for an
#: unpriced term (DESIGN.md: no constant reserve papers over one): it covers
#: the driver's own growth while contexts are created and page-granular
#: allocation, which neither the census nor a child's report can see.
DEFAULT_RESERVE_BYTES = 256 * MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How asks are priced and how much is kept free.

    Attributes:
        margin_bytes: least margin over a measured peak.
        margin_fraction: margin as a fraction of the measured peak, when larger.
        reserve_bytes: bytes kept free on every card.
    """

    margin_bytes: int = DEFAULT_MARGIN_BYTES
    margin_fraction: float = DEFAULT_MARGIN_FRACTION
    reserve_bytes: int = DEFAULT_RESERVE_BYTES

    def margin_for(self, peak_bytes: int) -> int:
        """The margin for a measured peak: ``max(margin_bytes, fraction * peak)``."""
        return max(self.margin_bytes, int(self.margin_fraction * peak_bytes))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """One task key's price and how it was reached."""

    key: str
    ask_bytes: int
    basis: AskBasis
    estimate_bytes: int | None
    measured_peak_bytes: int | None
    margin_bytes: int
    samples: int

    def describe(self) -> str:
        """The ask in words, e.g. ``"7.02 GiB (measured: 6.02 GiB peak + 1.00 GiB margin)"``."""
        if self.basis == "measured":
            return (
                f"{format_size(self.ask_bytes)} (measured: "
                f"{format_size(self.measured_peak_bytes)} peak over {self.samples} "
                f"task{'s' if self.samples != 1 else ''} + {format_size(self.margin_bytes)} margin)"
            )
        return f"{format_size(self.ask_bytes)} (estimated: task_peak)"


@dataclass(slots=True)
class _KeyState:
    estimate_bytes: int | None
    peak_bytes: int | None = None
    samples: int = 0


@dataclass(slots=True)
class AskTable:
    """Per-key asks: the estimate until measured, then the worst peak plus a margin.

    Args:
        policy: the margin to add to measurements.
        default_estimate_bytes: the pool's ``task_peak``, used for keys that
            were given no estimate of their own.
    """

    policy: Policy
    default_estimate_bytes: int
    _keys: dict[str, _KeyState] = field(default_factory=dict)
    _cache: dict[str, Ask] = field(default_factory=dict)

    def hint(self, key: str, estimate_bytes: int) -> None:
        """Give ``key`` an estimate of its own (a per-task peak hint).

        A hint never overrides a measurement; a larger hint after a smaller
        one raises the estimate (the caller knows this input is bigger).
        """
        self._cache.pop(key, None)
        state = self._keys.get(key)
        if state is None:
            self._keys[key] = _KeyState(estimate_bytes=estimate_bytes)
        elif state.estimate_bytes is None or estimate_bytes > state.estimate_bytes:
            state.estimate_bytes = estimate_bytes

    def measure(self, key: str, peak_bytes: int) -> Ask:
        """Record a child's measured device peak for ``key``; returns the new ask."""
        self._cache.pop(key, None)
        state = self._keys.setdefault(key, _KeyState(estimate_bytes=None))
        state.samples += 1
        if state.peak_bytes is None or peak_bytes > state.peak_bytes:
            state.peak_bytes = peak_bytes
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
        state = self._keys.get(key)
        estimate = self.default_estimate_bytes
        if state is not None and state.estimate_bytes is not None:
            estimate = state.estimate_bytes
        if state is None or state.peak_bytes is None:
            return Ask(
                key=key,
                ask_bytes=estimate,
                basis="estimated",
                estimate_bytes=estimate,
                measured_peak_bytes=None,
                margin_bytes=0,
                samples=0,
            )
        margin = self.policy.margin_for(state.peak_bytes)
        return Ask(
            key=key,
            ask_bytes=max(1, state.peak_bytes + margin),
            basis="measured",
            estimate_bytes=estimate,
            measured_peak_bytes=state.peak_bytes,
            margin_bytes=margin,
            samples=state.samples,
        )

    def keys(self) -> tuple[str, ...]:
        """Every key priced so far, in first-seen order."""
        return tuple(self._keys)
