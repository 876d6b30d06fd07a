"""Census values: what a card and the host looked like before any child existed (pure core).

A census is taken **once**, when a pool is constructed. ``co_tenant_bytes =
total - free - own`` names everything on the card that is not this process
only while the pool's own children are absent; taken later it would count
our own children as co-tenants, so no code path retakes it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CardCensus", "Census", "HostCensus"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CardCensus:
    """One device as it stood at construction.

    Unknown terms are ``None`` with a ``reason``; never ``-1`` or ``0``.

    Attributes:
        device: the pool's index for this device (0, 1, ...).
        uuid: ``GPU-...`` or ``MIG-...``; children are pinned by it.
        name: the driver's product name, for people (never looked up).
        total_bytes: the card's capacity (NVML ``total``; ``MemTotal`` on
            unified memory).
        free_bytes: free bytes at census.
        own_bytes: this process's device bytes at census.
        reserved_bytes: what the driver or firmware keeps (NVML v2), or ``None``
            where the driver does not say.
        unified: the device shares host memory (GB10, Jetson).
        mig: the device is a MIG instance.
        source: where total and free came from (``"nvml-v2"``, ``"meminfo"``, ...).
        own_source: where ``own_bytes`` came from (``"process-row"``,
            ``"baseline"``: our row could not be found, see ``reason``).
        reason: why a term is unknown or estimated, in words.
    """

    device: int
    uuid: str
    name: str
    total_bytes: int | None
    free_bytes: int | None
    own_bytes: int | None
    reserved_bytes: int | None = None
    unified: bool = False
    mig: bool = False
    source: str
    own_source: str = "process-row"
    reason: str | None = None

    @property
    def readable(self) -> bool:
        """Whether total and free were both read."""
        return self.total_bytes is not None and self.free_bytes is not None

    @property
    def co_tenant_bytes(self) -> int | None:
        """``total - free - own``: every byte on the card that is not this process.

        ``None`` when the card is unreadable. An unknown ``own`` counts as 0
        here only when the census says so in ``own_source``; a pool parent that
        has never created a CUDA context holds nothing.
        """
        if self.total_bytes is None or self.free_bytes is None:
            return None
        return self.total_bytes - self.free_bytes - (self.own_bytes or 0)

    @property
    def used_bytes(self) -> int | None:
        """``total - free`` (reserved included), or ``None`` when unreadable."""
        if self.total_bytes is None or self.free_bytes is None:
            return None
        return self.total_bytes - self.free_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCensus:
    """The host's usable CPUs and available RAM.

    Attributes:
        cpus: usable CPUs (affinity and cgroup quota), at least 1.
        available_ram_bytes: the least of ``MemAvailable`` and the cgroup's
            limit minus usage, or ``None`` when unknown.
        cpu_source: how ``cpus`` was found.
        ram_source: how ``available_ram_bytes`` was found.
    """

    cpus: int
    available_ram_bytes: int | None
    cpu_source: str = "given"
    ram_source: str = "given"


@dataclass(frozen=True, slots=True, kw_only=True)
class Census:
    """Every device the pool may use, and the host, as they stood at construction.

    Attributes:
        cards: one census per device, in the pool's device order (empty when
            the host has no device).
        host: usable CPUs and available RAM.
        driver: whether an NVIDIA driver (or the simulator) answered at all.
        sensor: which sensor took it (``"nvml"``, ``"simulator"``, ``"given"``).
        reason: why there is no device, or what the census could not read.
    """

    cards: tuple[CardCensus, ...]
    host: HostCensus
    driver: bool
    sensor: str
    reason: str | None = None


# Re-exported by gpupool, which may not have imported this module yet (it loads it on
# first use): the public path is set here, so reprs, docs and pickles name it whenever used.
CardCensus.__module__ = Census.__module__ = HostCensus.__module__ = "gpupool"
