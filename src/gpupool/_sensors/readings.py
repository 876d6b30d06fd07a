"""What a sensor reads: a device, its memory, and one process's bytes (I/O edge).

Apart from :mod:`gpupool._sensors.base` so that :mod:`gpupool._sensors.cuda`, whose
grammar the base uses, reads devices without importing the base.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

__all__ = ["DeviceInfo", "MemoryReading", "ProcessReading"]


class _Reading:
    """A frozen record of named fields (its ``_fields``, in order), built by keyword.

    Written out rather than made with :mod:`dataclasses`, whose import (with the
    :mod:`inspect` it loads) would be most of a worker's start on a card: equal where
    their class and values are, hashable, immutable, pickled as their values, and
    printed as they are built."""

    __slots__: ClassVar[tuple[str, ...]] = ()
    #: The fields, in order: a record's own ``__slots__``, kept apart from them so that a
    #: subclass that declares its own (``__slots__ = ()``) still has its base's fields.
    _fields: ClassVar[tuple[str, ...]] = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot assign to {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Reading) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__qualname__}({fields})"

    def __getstate__(self) -> tuple[Any, ...]:
        return self._values()

    def __setstate__(self, state: tuple[Any, ...] | dict[str, Any]) -> None:
        if isinstance(state, dict):  # a dataclass's without slots (its __dict__): by name
            state = tuple(state[name] for name in self._fields)
        for name, value in zip(self._fields, state, strict=True):
            object.__setattr__(self, name, value)

    def replace(self: _R, **changes: Any) -> _R:
        """A copy with ``changes`` (fields by name) made; also ``copy.replace`` (Python 3.13)."""
        values = self._asdict()
        unknown = sorted(set(changes) - set(values))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        return type(self)(**{**values, **changes})

    __replace__ = replace

    def _asdict(self) -> dict[str, Any]:
        """The fields and their values, in order (as a named tuple's ``_asdict``)."""
        return {name: getattr(self, name) for name in self._fields}

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)


# Made after the class, bound to it rather than to its name: a string bound is compiled as
# the variable is made, and a variable only the checker saw would leave ``replace``'s type
# hints unresolved at run time (typing.get_type_hints).
_R = TypeVar("_R", bound=_Reading)


class DeviceInfo(_Reading):
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

    # The fields, in order, written once (slots, match arguments, the record's fields).
    __slots__ = __match_args__ = _fields = (
        "index",
        "uuid",
        "name",
        "mig",
        "mig_index",
        "parent_uuid",
        "error",
    )
    index: int
    uuid: str
    name: str
    mig: bool
    mig_index: int | None
    parent_uuid: str | None
    error: str | None

    def __init__(
        self,
        *,
        index: int,
        uuid: str,
        name: str,
        mig: bool = False,
        mig_index: int | None = None,
        parent_uuid: str | None = None,
        error: str | None = None,
    ) -> None:
        self._set(
            index=index,
            uuid=uuid,
            name=name,
            mig=mig,
            mig_index=mig_index,
            parent_uuid=parent_uuid,
            error=error,
        )


class MemoryReading(_Reading):
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

    __slots__ = __match_args__ = _fields = (
        "total_bytes",
        "free_bytes",
        "used_bytes",
        "reserved_bytes",
        "unified",
        "source",
    )
    total_bytes: int
    free_bytes: int
    used_bytes: int
    reserved_bytes: int | None
    unified: bool
    source: str

    def __init__(
        self,
        *,
        total_bytes: int,
        free_bytes: int,
        used_bytes: int,
        reserved_bytes: int | None,
        unified: bool,
        source: str,
    ) -> None:
        self._set(
            total_bytes=total_bytes,
            free_bytes=free_bytes,
            used_bytes=used_bytes,
            reserved_bytes=reserved_bytes,
            unified=unified,
            source=source,
        )


class ProcessReading(_Reading):
    """One process's device bytes, as the driver lists them.

    ``used_bytes`` is ``None`` where the driver does not say (Windows WDDM,
    some MIG setups); in containers on some drivers (535.113 to 560) it reads
    0, which is why co-tenant bytes never come from summing these rows, and
    why the child's probe never takes a 0 as a measurement (a listed process
    holds at least its context).
    """

    __slots__ = __match_args__ = _fields = ("pid", "used_bytes", "name")
    pid: int
    used_bytes: int | None
    name: str | None

    def __init__(self, *, pid: int, used_bytes: int | None, name: str | None = None) -> None:
        self._set(pid=pid, used_bytes=used_bytes, name=name)


# Public as gpupool.DeviceInfo, ...: documentation, reprs and pickles name that path.
DeviceInfo.__module__ = MemoryReading.__module__ = ProcessReading.__module__ = "gpupool"
