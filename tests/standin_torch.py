"""A stand-in ``torch`` (and ``cupy``) for the probe's tests: records what the probe asks of it.

It models what the probe relies on in the real libraries: ``torch.cuda``'s
lazy initialisation (``_lazy_call`` queues a call until ``_lazy_init`` runs
it, after the driver is initialised and before any context exists), c10's
peak counters (``reset_peak_memory_stats`` sets each peak to the current
value; ``empty_cache`` gives cached blocks back), and the first allocation
creating the CUDA context. Calls that would create a context on a real card
(``mem_get_info``, ``synchronize``, ``current_device`` before initialisation)
count ``contexts_created``.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from typing import Any

GiB = 1024**3


class StandinCuda:
    """``torch.cuda`` as far as the probe and the allocator cap use it."""

    def __init__(self, *, total_bytes: int = 16 * GiB) -> None:
        self.total_bytes = total_bytes
        self.calls: list[str] = []
        self.contexts_created = 0
        self.fractions: list[tuple[float, int, str]] = []  # (fraction, device, when)
        self._initialized = False
        self._initializing = False
        self._queued: list[Callable[[], None]] = []
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.on_change: Callable[[StandinCuda], None] | None = None
        # torch._C: the extension's functions that torch.cuda's Python calls go through.
        self.c_module = types.SimpleNamespace(_cuda_resetPeakMemoryStats=self._reset_peaks)

    # -- initialisation --

    def is_initialized(self) -> bool:
        return self._initialized

    def _lazy_call(self, fn: Callable[[], None]) -> None:
        self.calls.append("_lazy_call")
        if self._initialized:
            fn()
        else:
            self._queued.append(fn)

    def _lazy_init(self) -> None:
        """The driver is initialised, then the queued calls run; no context is created."""
        if self._initialized or self._initializing:
            return
        self._initializing = True
        try:
            for fn in self._queued:
                fn()
        finally:
            self._initializing = False
        self._initialized = True

    def get_device_properties(self, device: int) -> Any:
        self.calls.append(f"get_device_properties({device})")
        self._lazy_init()
        return types.SimpleNamespace(total_memory=self.total_bytes, name="Stand-in GPU")

    def set_per_process_memory_fraction(self, fraction: float, device: int | None = None) -> None:
        when = "initializing" if self._initializing else "initialized"
        if not (self._initializing or self._initialized):
            when = "before-init"
        self._lazy_init()
        if device is None:
            self.contexts_created += 1  # current_device() would be asked
            device = 0
        self.fractions.append((fraction, device, when))

    # -- what a task does --

    def allocate(self, nbytes: int) -> None:
        """A tensor of ``nbytes``: initialises CUDA and creates the context on first use."""
        self._lazy_init()
        if self.contexts_created == 0:
            self.contexts_created = 1
        limit = self.allowed_bytes()
        if limit is not None and self.reserved_bytes + nbytes > limit:
            raise StandinOutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. "
                f"{limit} bytes allowed."
            )
        self.allocated_bytes += nbytes
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self._changed()

    def free(self, nbytes: int) -> None:
        """A tensor dropped: its block stays cached (reserved)."""
        self.allocated_bytes -= nbytes

    def allowed_bytes(self) -> int | None:
        if not self.fractions:
            return None
        return int(self.fractions[-1][0] * self.total_bytes)

    # -- counters --

    def max_memory_reserved(self) -> int:
        return self.peak_reserved_bytes

    def memory_reserved(self) -> int:
        return self.reserved_bytes

    def memory_stats(self) -> dict[str, int]:
        """torch's statistics dict, the two keys of it the probe reads among others."""
        return {
            "reserved_bytes.all.current": self.reserved_bytes,
            "reserved_bytes.all.peak": self.peak_reserved_bytes,
            "allocated_bytes.all.current": self.allocated_bytes,
        }

    def reset_peak_memory_stats(self) -> None:
        """As torch's: through ``torch._C._cuda_resetPeakMemoryStats``, looked up at each call."""
        self.calls.append("reset_peak_memory_stats")
        self.c_module._cuda_resetPeakMemoryStats(0)

    def _reset_peaks(self, device: int = 0) -> None:
        self.peak_reserved_bytes = self.reserved_bytes  # c10: peak = current

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved_bytes = self.allocated_bytes
        self._changed()

    # -- calls that create a context on a real card --

    def mem_get_info(self) -> tuple[int, int]:
        self.contexts_created += 1
        return self.total_bytes, self.total_bytes

    def synchronize(self) -> None:
        self.contexts_created += 1

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)


class StandinOutOfMemoryError(RuntimeError):
    """torch's ``OutOfMemoryError`` (module ``torch``)."""


StandinOutOfMemoryError.__module__ = "torch"
StandinOutOfMemoryError.__name__ = StandinOutOfMemoryError.__qualname__ = "OutOfMemoryError"


def make_torch(**kwargs: Any) -> types.ModuleType:
    """A stand-in ``torch`` module with a :class:`StandinCuda` as ``torch.cuda``."""
    torch = types.ModuleType("torch")
    torch.cuda = StandinCuda(**kwargs)  # type: ignore[attr-defined]
    torch._C = torch.cuda.c_module  # type: ignore[attr-defined]
    torch.OutOfMemoryError = StandinOutOfMemoryError  # type: ignore[attr-defined]
    return torch


def make_cupy() -> types.ModuleType:
    """A stand-in ``cupy`` (:mod:`standin_cupy`)."""
    import standin_cupy

    return standin_cupy.make_cupy()


def mirror_to_simulator(cuda: StandinCuda, device: int = 0) -> None:
    """Charge the stand-in's reserved bytes to this process on a simulated host's card.

    The simulator then charges the process its context at the first allocation,
    as a driver does, and lists a row of context plus reserved bytes.
    """
    from gpupool._sensors.select import SIMULATOR_ENV
    from gpupool._sensors.simulated import ledger_at

    ledger = ledger_at(os.environ[SIMULATOR_ENV])
    charged = [0]

    def change(now: StandinCuda) -> None:
        delta = now.reserved_bytes - charged[0]
        if delta > 0:
            refusal = ledger.allocate(device, os.getpid(), delta)
            if refusal is not None:
                raise StandinOutOfMemoryError(f"CUDA out of memory. Tried to allocate {delta} B")
        elif delta < 0:
            ledger.release(device, os.getpid(), -delta)
        charged[0] = now.reserved_bytes

    cuda.on_change = change


# -- for pool tests: installed in a worker by the initializer, used by the task ------------


def install_in_worker(total_bytes: int, mirror: bool = False) -> None:
    """Initializer: this worker's ``import torch`` finds the stand-in (its reserved bytes
    charged on the simulated card with ``mirror``)."""
    torch = make_torch(total_bytes=total_bytes)
    if mirror:
        mirror_to_simulator(torch.cuda)
    sys.modules["torch"] = torch


def capped_task(nbytes: int) -> dict[str, Any]:
    """A torch task on the stand-in: allocate (initialising CUDA), report the cap it met."""
    from gpupool._child.probe import allocator_cap_state

    cuda = sys.modules["torch"].cuda
    fractions_before = list(cuda.fractions)
    try:
        cuda.allocate(nbytes)
        cuda.free(nbytes)
        outcome = "ok"
    except StandinOutOfMemoryError:
        outcome = "oom-inside"
    return {
        "fractions_before": fractions_before,
        "fractions": list(cuda.fractions),
        "state": allocator_cap_state(),
        "outcome": outcome,
    }
