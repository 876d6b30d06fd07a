"""What a sensor reads: a device, its memory, and one process's bytes (I/O edge).

Apart from :mod:`gpupool._sensors.base` so that :mod:`gpupool._sensors.cuda`, whose
grammar the base uses, reads devices without importing the base.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceInfo", "MemoryReading", "ProcessReading"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """A device as the driver names it.

    Attributes:
        index: the driver's index (NVML order, PCI bus order in practice);
            for a MIG instance, the parent card's index.
        uuid: ``GPU-...`` or ``MIG-...``; stable, and what children are pinned by.
        name: the product name, for people only.
        mig: whether this is a MIG instance.
        mig_index: the instance's index on its parent card, for MIG devices.
        parent_uuid: the parent card's ``GPU-`` UUID, for MIG devices.
        error: why the driver could not describe this device (a card that
            answers ``GPU_IS_LOST``, say), or ``None``. Such a device is
            unreadable; one whose UUID could not be read has ``uuid == ""``
            and cannot be used, since children are pinned by UUID.
    """

    index: int
    uuid: str
    name: str
    mig: bool = False
    mig_index: int | None = None
    parent_uuid: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReading:
    """A device's memory right now.

    Attributes:
        total_bytes: capacity (NVML ``total``; ``MemTotal`` on unified memory).
        free_bytes: free now (on unified memory: ``MemAvailable`` when nothing
            else competes for the device, ``MemFree`` when something does).
        used_bytes: allocated now.
        reserved_bytes: kept by the driver or firmware (NVML v2), or ``None``
            where the driver does not report it separately (v1, unified).
        unified: the device shares host memory.
        source: ``"nvml-v2"``, ``"nvml-v1"``, ``"meminfo"``, ``"simulator"``.
    """

    total_bytes: int
    free_bytes: int
    used_bytes: int
    reserved_bytes: int | None
    unified: bool
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessReading:
    """One process's device bytes, as the driver lists them.

    ``used_bytes`` is ``None`` where the driver does not say (Windows WDDM,
    some MIG setups); in containers on some drivers (535.113 to 560) it reads
    0, which is why co-tenant bytes never come from summing these rows, and
    why the child's probe never takes a 0 as a measurement (a listed process
    holds at least its context).
    """

    pid: int
    used_bytes: int | None
    name: str | None = None


# Public as gpupool.DeviceInfo, ...: documentation, reprs and pickles name that path.
DeviceInfo.__module__ = MemoryReading.__module__ = ProcessReading.__module__ = "gpupool"
