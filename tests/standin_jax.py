"""A stand-in ``jax`` for the probe's tests: backends that are initialised only when asked.

It models what the probe relies on in JAX: ``jax._src.xla_bridge._backends``
is empty until the task's first JAX call initialises the backends (the
probe never does: it reads only a backend already there), and each device's
``memory_stats()`` reports ``bytes_in_use``, ``peak_bytes_in_use`` (over the
process's life: XLA never resets it), ``pool_bytes`` and ``peak_pool_bytes``
(what its BFC allocator took from the driver). ``contexts_created`` counts
calls that would initialise a backend on a real card.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class StandinDevice:
    """A JAX device on the GPU backend."""

    platform = "gpu"

    def __init__(self) -> None:
        self.in_use = 0
        self.peak_in_use = 0
        self.pool = 0
        self.peak_pool = 0
        self.stats_calls = 0

    def allocate(self, nbytes: int) -> None:
        """A buffer of ``nbytes``: the BFC pool grows to hold it and keeps what it took."""
        self.in_use += nbytes
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.pool = max(self.pool, self.in_use)
        self.peak_pool = max(self.peak_pool, self.pool)

    def free(self, nbytes: int) -> None:
        self.in_use -= nbytes

    def memory_stats(self) -> dict[str, int]:
        self.stats_calls += 1
        return {
            "bytes_in_use": self.in_use,
            "peak_bytes_in_use": self.peak_in_use,
            "pool_bytes": self.pool,
            "peak_pool_bytes": self.peak_pool,
            "bytes_limit": 80 * 1024**3,
        }


class StandinClient:
    """A PJRT client: the backend's devices."""

    def __init__(self, device: StandinDevice) -> None:
        self._device = device

    def local_devices(self) -> list[StandinDevice]:
        return [self._device]


def make_jax() -> types.ModuleType:
    """A stand-in ``jax`` with ``jax._src.xla_bridge``; :func:`initialise` starts its backend."""
    jax = types.ModuleType("jax")
    src = types.ModuleType("jax._src")
    bridge = types.ModuleType("jax._src.xla_bridge")
    bridge._backends = {}  # type: ignore[attr-defined]
    jax._src = src  # type: ignore[attr-defined]
    src.xla_bridge = bridge  # type: ignore[attr-defined]
    device = StandinDevice()
    jax.standin_device = device  # type: ignore[attr-defined]
    jax.contexts_created = 0  # type: ignore[attr-defined]

    def local_devices(*args: Any, **kwargs: Any) -> list[StandinDevice]:
        initialise(jax)
        return [device]

    jax.local_devices = local_devices  # type: ignore[attr-defined]
    return jax


def initialise(jax: types.ModuleType) -> StandinDevice:
    """The task's first JAX call: the GPU backend starts (and, on a real card, its context)."""
    bridge: Any = jax._src.xla_bridge  # type: ignore[attr-defined]
    if "cuda" not in bridge._backends:
        jax.contexts_created += 1  # type: ignore[attr-defined]
        bridge._backends["cpu"] = object()
        bridge._backends["cuda"] = StandinClient(jax.standin_device)  # type: ignore[attr-defined]
    device: StandinDevice = jax.standin_device  # type: ignore[attr-defined]
    return device


def install(modules: Any, jax: types.ModuleType) -> None:
    """Put ``jax`` and its submodules where ``import jax`` and the probe find them."""
    modules["jax"] = jax
    modules["jax._src"] = jax._src  # type: ignore[attr-defined]
    modules["jax._src.xla_bridge"] = jax._src.xla_bridge  # type: ignore[attr-defined]


def install_in_worker() -> None:
    """Initializer: this worker's ``import jax`` finds the stand-in."""
    install(sys.modules, make_jax())
