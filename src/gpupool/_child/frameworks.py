"""Child side: what the frameworks a task loaded hold on the device, from their own counters.

Runs inside every worker, for the probe (:mod:`gpupool._child.probe`). It never
imports a framework nor starts its CUDA backend: each is read only when the
task already imported it (``sys.modules``), and torch and JAX only once the
task started their CUDA backend, so reading creates no context.

=========  ====================================================  ===========================
framework  held now                                              its own peak
=========  ====================================================  ===========================
torch      ``torch.cuda.memory_reserved()``                      ``max_memory_reserved()``
           (once ``torch.cuda.is_initialized()``)                since the last reset
CuPy       ``cupy.get_default_memory_pool().total_bytes()``      none: sampled
           (and ``used_bytes()``, never more)
JAX        ``memory_stats()`` of each GPU device of a backend    ``peak_pool_bytes`` /
           already in ``jax._src.xla_bridge._backends``:         ``peak_bytes_in_use``, over
           ``pool_bytes`` / ``bytes_reserved`` / ``bytes_in_use``  the process's life
=========  ====================================================  ===========================

torch's peak is lost when the task itself calls
``torch.cuda.reset_peak_memory_stats()``: :func:`guard_torch_resets` wraps
``torch._C._cuda_resetPeakMemoryStats`` (what every Python-level reset
calls) so that the peak is folded into this module's record first. JAX's
peak cannot be reset: a window counts it only when it rose during the window.
Every reader answers ``None`` or nothing where a call fails: a framework that
cannot be read is left out, never read as 0 bytes held.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = [
    "FRAMEWORKS",
    "FrameworkWindow",
    "guard_torch_resets",
    "initialised_torch_cuda",
    "read_held_bytes",
]

#: The frameworks read, in the order a peak's source names them.
FRAMEWORKS = ("torch", "cupy", "jax")

#: Names JAX gives its GPU backends in ``xla_bridge._backends`` (``"gpu"`` in older releases).
_JAX_GPU_BACKENDS = ("cuda", "rocm", "gpu")
#: ``memory_stats()`` keys: what XLA's allocator took from the driver (its BFC pool), else
#: what it reserved, else what live buffers use; and the peaks of the same.
_JAX_HELD = ("pool_bytes", "bytes_reserved", "bytes_in_use")
_JAX_PEAK = ("peak_pool_bytes", "peak_bytes_reserved", "peak_bytes_in_use")


def initialised_torch_cuda() -> Any | None:
    """``torch.cuda`` if the task imported torch and initialised CUDA, else ``None``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if cuda.is_initialized():
            return cuda
    except Exception:
        return None
    return None


def _torch() -> tuple[int, int] | None:
    """torch's ``(reserved now, reserved peak since the last reset)``, or ``None``."""
    cuda = initialised_torch_cuda()
    if cuda is None:
        return None
    try:
        # One call builds torch's whole statistics dict; memory_reserved() and
        # max_memory_reserved() would each build it again.
        stats = cuda.memory_stats()
        return int(stats["reserved_bytes.all.current"]), int(stats["reserved_bytes.all.peak"])
    except Exception:
        pass
    try:
        return int(cuda.memory_reserved()), int(cuda.max_memory_reserved())
    except Exception:
        return None


def _cupy() -> int | None:
    """What CuPy's default device pool holds from the driver now, or ``None``.

    ``total_bytes()`` counts live arrays and cached free blocks; ``used_bytes()``
    only the live ones, so it is never more.
    """
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        pool = cupy.get_default_memory_pool()
        return max(int(pool.total_bytes()), int(pool.used_bytes()))
    except Exception:
        return None


def _jax() -> tuple[int, int] | None:
    """JAX's ``(held now, lifetime peak)`` over its GPU devices, or ``None`` where no GPU
    backend was started by the task."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if sys.modules.get("jax") is None or bridge is None:
        return None
    try:
        backends = dict(getattr(bridge, "_backends", None) or {})
        devices: list[Any] = []
        for name in _JAX_GPU_BACKENDS:
            if name in backends:
                devices.extend(backends[name].local_devices())
        if not devices:
            return None
        held = peak = 0
        for device in devices:
            stats = device.memory_stats() or {}
            held += max(int(stats.get(key, 0)) for key in _JAX_HELD)
            peak += max(int(stats.get(key, 0)) for key in _JAX_PEAK)
        return held, peak
    except Exception:
        return None


def _read() -> dict[str, tuple[int, int | None]]:
    """Each loaded and started framework: ``(held now, its own peak or None)``."""
    found: dict[str, tuple[int, int | None]] = {}
    modules = sys.modules
    if "torch" not in modules and "cupy" not in modules and "jax" not in modules:
        return found  # the usual case outside a GPU task: nothing to ask
    torch = _torch()
    if torch is not None:
        found["torch"] = torch
    cupy = _cupy()
    if cupy is not None:
        found["cupy"] = (cupy, None)
    jax = _jax()
    if jax is not None:
        found["jax"] = jax
    return found


def read_held_bytes(*, leave_out: str | None = None) -> int:
    """What the loaded frameworks hold on the device now, all together (``leave_out``: but one)."""
    return sum(held for name, (held, _) in _read().items() if name != leave_out)


# -- torch's peak, kept across the task's own resets ------------------------------------------


class _Folded:
    """torch's reserved peak as it stood before each reset since the window opened."""

    __slots__ = ("lock", "peak_bytes")

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.lock = threading.Lock()


_FOLDED = _Folded()


def guard_torch_resets() -> None:
    """Wrap ``torch._C._cuda_resetPeakMemoryStats`` so that a reset folds the peak first.

    ``torch.cuda.reset_peak_memory_stats`` (and ``reset_max_memory_allocated``,
    which calls it) look the function up on ``torch._C`` at each call, so a
    task that imported them by name is covered too. Idempotent; a no-op
    where torch is not imported. Never raises.
    """
    torch = sys.modules.get("torch")
    c_module = getattr(torch, "_C", None) if torch is not None else None
    reset = getattr(c_module, "_cuda_resetPeakMemoryStats", None)
    if reset is None or getattr(reset, "_gpupool_folds", False):
        return

    def folding_reset(*args: Any, **kwargs: Any) -> Any:
        counters = _torch()
        if counters is not None:
            with _FOLDED.lock:
                _FOLDED.peak_bytes = max(_FOLDED.peak_bytes, counters[1])
        return reset(*args, **kwargs)

    folding_reset._gpupool_folds = True  # type: ignore[attr-defined]
    try:
        c_module._cuda_resetPeakMemoryStats = folding_reset  # type: ignore[union-attr]
    except Exception:
        return


def _take_folded() -> int:
    with _FOLDED.lock:
        value, _FOLDED.peak_bytes = _FOLDED.peak_bytes, 0
    return value


# -- one task's window ------------------------------------------------------------------------


class FrameworkWindow:
    """The frameworks' counters over one task: each one's peak, and what they hold now.

    :meth:`sample` may be called from the probe's sampling thread while the
    task runs; :meth:`open` and :meth:`close` from the worker's thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._max_held: dict[str, int] = {}
        self._jax_peak_at_open: int | None = None

    def open(self) -> int | None:
        """Open a window (after the probe reset torch's peak); what the frameworks hold now
        (``None``: no framework is loaded and started)."""
        if _FOLDED.peak_bytes:  # a reset folded before this window: not this window's
            _take_folded()
        found = _read()
        with self._lock:
            self._max_held = {name: held for name, (held, _) in found.items()} if found else {}
            jax = found.get("jax")
            self._jax_peak_at_open = jax[1] if jax is not None else None
        return sum(held for held, _ in found.values()) if found else None

    def sample(self) -> int | None:
        """Note what each framework holds now; what they hold together (``None``: none is
        loaded and started)."""
        found = _read()
        with self._lock:
            for name, (held, _) in found.items():
                self._max_held[name] = max(self._max_held.get(name, 0), held)
        return sum(held for held, _ in found.values()) if found else None

    def close(self) -> tuple[dict[str, int], int]:
        """Each framework's peak over the window (those that held anything), and what they
        hold together now (before the caches are released)."""
        found = _read()
        folded = _take_folded() if _FOLDED.peak_bytes else 0
        peaks: dict[str, int] = {}
        with self._lock:
            if not found and not self._max_held:
                return peaks, 0  # no framework loaded and started during the window
            for name in FRAMEWORKS:
                now = found.get(name)
                peak = max(self._max_held.get(name, 0), now[0] if now is not None else 0)
                if name == "torch" and now is not None and now[1] is not None:
                    peak = max(peak, now[1], folded)
                # JAX's is a lifetime peak: this window's only where it rose during it.
                rose = self._jax_peak_at_open is None or (
                    now is not None and now[1] is not None and now[1] > self._jax_peak_at_open
                )
                if name == "jax" and now is not None and now[1] is not None and rose:
                    peak = max(peak, now[1])
                if peak > 0:
                    peaks[name] = peak
        return peaks, sum(held for held, _ in found.values())
