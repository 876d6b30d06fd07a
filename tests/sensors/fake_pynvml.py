"""A fake ``pynvml`` module: a test double of the parts of NVIDIA's binding gpupool calls.

Written from the binding's documented behaviour, not copied from it: error
classes carry the real names and ``.value`` codes (``NVMLError(12)`` is an
``NVMLError_LibraryNotFound``), memory structs have the real field names,
``nvmlDeviceIsMigDeviceHandle`` returns a ``ctypes.c_uint`` and
``usedGpuMemory`` is ``None`` where the driver does not say.

Install one per test::

    fake = FakePynvml(cards=[FakeCard(...)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
"""

from __future__ import annotations

import ctypes
import types
from dataclasses import dataclass, field
from typing import Any, Literal

GiB = 1024**3

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_NAMES = {
    NVML_ERROR_UNINITIALIZED: ("Uninitialized", "Uninitialized"),
    NVML_ERROR_INVALID_ARGUMENT: ("InvalidArgument", "Invalid Argument"),
    NVML_ERROR_NOT_SUPPORTED: ("NotSupported", "Not Supported"),
    NVML_ERROR_NO_PERMISSION: ("NoPermission", "Insufficient Permissions"),
    NVML_ERROR_NOT_FOUND: ("NotFound", "Not Found"),
    NVML_ERROR_DRIVER_NOT_LOADED: ("DriverNotLoaded", "Driver Not Loaded"),
    NVML_ERROR_LIBRARY_NOT_FOUND: ("LibraryNotFound", "NVML Shared Library Not Found"),
    NVML_ERROR_FUNCTION_NOT_FOUND: ("FunctionNotFound", "Function Not Found"),
    NVML_ERROR_GPU_IS_LOST: ("GpuIsLost", "GPU is lost"),
    NVML_ERROR_UNKNOWN: ("Unknown", "Unknown Error"),
}


class NVMLError(Exception):
    """Like the binding's: ``NVMLError(code)`` builds the subclass for that code."""

    _value_class: dict[int, type[NVMLError]] = {}  # noqa: RUF012

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._value_class.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _NAMES.get(self.value, ("", f"NVML Error with code {self.value}"))[1]


_ERROR_CLASSES: dict[str, type[NVMLError]] = {}
for _code, (_suffix, _text) in _NAMES.items():
    _cls = type(f"NVMLError_{_suffix}", (NVMLError,), {})
    NVMLError._value_class[_code] = _cls
    _ERROR_CLASSES[_cls.__name__] = _cls


class NVMLLibraryMismatchError(Exception):
    """The binding's error for an unversioned call on a driver without that symbol."""


#: ``nvmlMemory_v2``'s version word, as the binding defines it.
nvmlMemory_v2 = 0x02000028


class c_nvmlMemory_t:
    """v1 memory info: ``used`` includes the reserved memory."""

    def __init__(self, total: int, free: int, used: int) -> None:
        self.total = total
        self.free = free
        self.used = used


class c_nvmlMemory_v2_t:
    """v2 memory info: ``reserved`` is separate, ``used`` is allocated only."""

    def __init__(self, total: int, reserved: int, free: int, used: int) -> None:
        self.version = nvmlMemory_v2
        self.total = total
        self.reserved = reserved
        self.free = free
        self.used = used


MemoryMode = Literal["v2", "v1-only", "v2-not-supported", "unified", "old-binding"]


@dataclass
class FakeCard:
    """One card (or MIG instance) as the fake driver reports it.

    Attributes:
        memory: ``"v2"`` (a current driver), ``"v1-only"`` (v2 raises
            FunctionNotFound), ``"v2-not-supported"`` (v2 raises
            NotSupported, v1 answers), ``"unified"`` (both NotSupported:
            GB10/Jetson), ``"old-binding"`` (the call takes no ``version``).
        compute, graphics: ``(pid, usedGpuMemory or None)`` rows.
        processes_supported: ``False``: both process calls raise NotSupported.
        mig_slots: ``None`` for MIG off; else one entry per slot, ``None``
            for an empty slot.
        errors: NVML function name -> error code to raise from that call.
        accounting: ``None``: accounting mode off; else pid -> ``maxMemoryUsage``.
    """

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GiB
    free: int = 79 * GiB
    reserved: int = 512 * 1024**2
    memory: MemoryMode = "v2"
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    processes_supported: bool = True
    mig_slots: list[FakeCard | None] | None = None
    errors: dict[str, int] = field(default_factory=dict)
    accounting: dict[int, int] | None = None


@dataclass(frozen=True)
class _Handle:
    card: FakeCard
    is_mig: bool


class FakePynvml(types.ModuleType):
    """The fake module. ``init_error``: a code ``nvmlInit`` raises (12, 9, ...)."""

    def __init__(self, cards: list[FakeCard], *, init_error: int | None = None) -> None:
        super().__init__("pynvml")
        self.cards = cards
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []
        self.NVMLError = NVMLError
        self.NVMLLibraryMismatchError = NVMLLibraryMismatchError
        self.nvmlMemory_v2 = nvmlMemory_v2
        self.c_nvmlMemory_t = c_nvmlMemory_t
        self.c_nvmlMemory_v2_t = c_nvmlMemory_v2_t
        self.NVML_DEVICE_MIG_ENABLE = 1
        self.NVML_DEVICE_MIG_DISABLE = 0
        for name, value in globals().items():
            if name.startswith("NVML_"):
                setattr(self, name, value)
        for name, cls in _ERROR_CLASSES.items():
            setattr(self, name, cls)

    # -- helpers --

    def _check(self, handle: _Handle | None, function: str) -> None:
        self.calls.append(function)
        if self.init_calls <= self.shutdown_calls:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle is not None and function in handle.card.errors:
            raise NVMLError(handle.card.errors[function])

    # -- the binding's functions --

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        self._check(None, "nvmlDeviceGetCount")
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check(None, "nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.cards):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(self.cards[index], is_mig=False)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._check(handle, "nvmlDeviceGetUUID")
        return handle.card.uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._check(handle, "nvmlDeviceGetName")
        return handle.card.name

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._check(handle, "nvmlDeviceGetMigMode")
        if handle.card.mig_slots is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetMaxMigDeviceCount")
        return len(handle.card.mig_slots or [])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._check(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        slots = handle.card.mig_slots or []
        if index >= len(slots) or slots[index] is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        card = slots[index]
        assert card is not None
        return _Handle(card, is_mig=True)

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> ctypes.c_uint:
        self._check(handle, "nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(1 if handle.is_mig else 0)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        card = handle.card
        if version is not None and card.memory == "old-binding":
            raise TypeError(
                "nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'"
            )
        self._check(handle, "nvmlDeviceGetMemoryInfo" + ("_v2" if version else ""))
        if card.memory == "unified":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if version:
            if card.memory == "v1-only":
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            if card.memory == "v2-not-supported":
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            used = card.total - card.free - card.reserved
            return c_nvmlMemory_v2_t(card.total, card.reserved, card.free, used)
        return c_nvmlMemory_t(card.total, card.free, card.total - card.free)

    def _processes(
        self, handle: _Handle, function: str, rows: list[tuple[int, int | None]]
    ) -> list[Any]:
        self._check(handle, function)
        if not handle.card.processes_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [
            types.SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in rows
        ]

    def nvmlDeviceGetAccountingMode(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetAccountingMode")
        return 0 if handle.card.accounting is None else 1

    def nvmlDeviceGetAccountingStats(self, handle: _Handle, pid: int) -> Any:
        self._check(handle, "nvmlDeviceGetAccountingStats")
        accounting = handle.card.accounting
        if accounting is None or pid not in accounting:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return types.SimpleNamespace(maxMemoryUsage=accounting[pid], isRunning=1)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._processes(handle, "nvmlDeviceGetComputeRunningProcesses", handle.card.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._processes(
            handle, "nvmlDeviceGetGraphicsRunningProcesses", handle.card.graphics
        )


def h100(index: int, **overrides: Any) -> FakeCard:
    """An idle H100 80GB with a deterministic UUID ``GPU-0000000<index>-...``."""
    uuid = f"GPU-{index:08x}-1111-2222-3333-{index:012x}"
    return FakeCard(uuid=uuid, **overrides)
