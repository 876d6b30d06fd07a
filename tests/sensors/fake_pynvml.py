"""A fake ``pynvml`` module: a test double of the parts of NVIDIA's binding gpupool calls.

Written from the behaviour of the real wrapper (``nvidia-ml-py``'s
``pynvml.py``), not copied from it, and held to it by
``test_fake_pynvml_fidelity.py``: every function, constant and struct defined
here exists in the installed binding with the same signature, value or fields.
What the fake reproduces, because gpupool's readings depend on it:

* ``NVMLError(code)`` builds the subclass for that code (``NVMLError(12)`` is
  an ``NVMLError_LibraryNotFound``), with the binding's message;
* memory infos are ctypes structures with the binding's fields; the v2 call
  is ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)``;
* the unversioned process calls call the ``_v3`` symbol and turn a missing
  symbol (``FunctionNotFound``) into ``NVMLLibraryMismatchError``; ``_v2`` and
  ``_v3`` exist as functions of their own; ``usedGpuMemory`` is ``None``
  where the driver says "not available", and may be ``0`` (containers on
  drivers 535.113 to 560);
* ``nvmlDeviceGetMigMode`` answers ``[0, 0]`` on a MIG-capable card with MIG
  off (an H100), and NOT_SUPPORTED only on a card without MIG;
* ``nvmlDeviceIsMigDeviceHandle`` returns a ``ctypes.c_uint``;
* ``nvmlDeviceGetAccountingStats`` raises ``TypeError`` when the driver
  answers "not available" for ``maxMemoryUsage``: the binding assigns ``None``
  to the structure's integer field.

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
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

_NAMES = {
    NVML_ERROR_UNINITIALIZED: ("Uninitialized", "Uninitialized"),
    NVML_ERROR_INVALID_ARGUMENT: ("InvalidArgument", "Invalid Argument"),
    NVML_ERROR_NOT_SUPPORTED: ("NotSupported", "Not Supported"),
    NVML_ERROR_NO_PERMISSION: ("NoPermission", "Insufficient Permissions"),
    NVML_ERROR_NOT_FOUND: ("NotFound", "Not Found"),
    NVML_ERROR_INSUFFICIENT_SIZE: ("InsufficientSize", "Insufficient Size"),
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

#: What the driver writes for "not available" in a 64-bit field.
_NOT_AVAILABLE = ctypes.c_ulonglong(-1).value


class c_nvmlMemory_t(ctypes.Structure):
    """v1 memory info: ``used`` includes the reserved memory."""

    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class c_nvmlMemory_v2_t(ctypes.Structure):
    """v2 memory info: ``reserved`` is separate, ``used`` is allocated only."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class c_nvmlProcessInfo_v2_t(ctypes.Structure):
    """One process row (the ``_v2`` and ``_v3`` calls share it)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class c_nvmlAccountingStats_t(ctypes.Structure):
    """NVML accounting's per-process record."""

    _fields_ = [
        ("gpuUtilization", ctypes.c_uint),
        ("memoryUtilization", ctypes.c_uint),
        ("maxMemoryUsage", ctypes.c_ulonglong),
        ("time", ctypes.c_ulonglong),
        ("startTime", ctypes.c_ulonglong),
        ("isRunning", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 5),
    ]


class nvmlFriendlyObject:
    """The binding's plain object for a process row: attributes that accept ``None``."""

    def __init__(self, dictionary: dict[str, Any]) -> None:
        for key, value in dictionary.items():
            setattr(self, key, value)


MemoryMode = Literal["v2", "v1-only", "v2-not-supported", "unified", "old-binding"]


@dataclass
class FakeCard:
    """One card (or MIG instance) as the fake driver reports it.

    Attributes:
        memory: ``"v2"`` (a current driver), ``"v1-only"`` (v2 raises
            FunctionNotFound), ``"v2-not-supported"`` (v2 raises
            NotSupported, v1 answers), ``"unified"`` (both NotSupported:
            GB10/Jetson), ``"old-binding"`` (the call takes no ``version``).
        compute, graphics: ``(pid, usedGpuMemory)`` rows; ``None`` is the
            driver's "not available", ``0`` what containers on drivers
            535.113 to 560 report.
        processes_supported: ``False``: both process calls raise NotSupported.
        process_api: ``"v3"`` (current drivers) or ``"v2"`` (a driver without
            the ``_v3`` symbols: the unversioned calls raise
            ``NVMLLibraryMismatchError``, as the binding's do).
        mig_capable: whether the card supports MIG (H100, A100: ``[0, 0]``
            when off); ``False``: ``nvmlDeviceGetMigMode`` raises NotSupported.
        mig_slots: ``None`` for MIG off; else one entry per slot, ``None``
            for an empty slot.
        errors: NVML function name -> error code to raise from that call.
        accounting: ``None``: accounting mode off; else pid ->
            ``maxMemoryUsage`` (``None``: the driver says "not available").
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
    process_api: Literal["v3", "v2"] = "v3"
    mig_capable: bool = True
    mig_slots: list[FakeCard | None] | None = None
    errors: dict[str, int] = field(default_factory=dict)
    accounting: dict[int, int | None] | None = None


@dataclass(frozen=True)
class _Handle:
    card: FakeCard
    is_mig: bool


#: Attributes of a FakePynvml that are the fake's own (tests read them), not the binding's.
FAKE_ONLY = frozenset(
    {"cards", "init_error", "count_error", "init_calls", "shutdown_calls", "calls"}
)


class FakePynvml(types.ModuleType):
    """The fake module. ``init_error``/``count_error``: what nvmlInit/nvmlDeviceGetCount raise."""

    def __init__(
        self,
        cards: list[FakeCard],
        *,
        init_error: int | None = None,
        count_error: int | None = None,
    ) -> None:
        super().__init__("pynvml")
        self.cards = cards
        self.init_error = init_error
        self.count_error = count_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []
        self.NVMLError = NVMLError
        self.NVMLLibraryMismatchError = NVMLLibraryMismatchError
        self.nvmlMemory_v2 = nvmlMemory_v2
        self.c_nvmlMemory_t = c_nvmlMemory_t
        self.c_nvmlMemory_v2_t = c_nvmlMemory_v2_t
        self.c_nvmlProcessInfo_v2_t = c_nvmlProcessInfo_v2_t
        self.c_nvmlAccountingStats_t = c_nvmlAccountingStats_t
        self.nvmlFriendlyObject = nvmlFriendlyObject
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
        if handle is None:
            return
        errors = handle.card.errors
        key = function
        if "RunningProcesses" in function and key not in errors:
            key = function.removesuffix("_v2").removesuffix("_v3")  # one error for every version
        if key in errors:
            raise NVMLError(errors[key])

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
        if self.count_error is not None:
            raise NVMLError(self.count_error)
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check(None, "nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.cards):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle = _Handle(self.cards[index], is_mig=False)
        if "nvmlDeviceGetHandleByIndex" in handle.card.errors:
            raise NVMLError(handle.card.errors["nvmlDeviceGetHandleByIndex"])
        return handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Handle:
        self._check(None, "nvmlDeviceGetHandleByUUID")
        for card in self.cards:
            if card.uuid == uuid:
                return _Handle(card, is_mig=False)
            for slot in card.mig_slots or []:
                if slot is not None and slot.uuid == uuid:
                    return _Handle(slot, is_mig=True)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._check(handle, "nvmlDeviceGetUUID")
        return handle.card.uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._check(handle, "nvmlDeviceGetName")
        return handle.card.name

    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        self._check(device, "nvmlDeviceGetMigMode")
        if device.is_mig or not device.card.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if device.card.mig_slots is None:
            return [NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE]
        return [NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        self._check(device, "nvmlDeviceGetMaxMigDeviceCount")
        return len(device.card.mig_slots or [])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        self._check(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        slots = device.card.mig_slots or []
        if index >= len(slots) or slots[index] is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        card = slots[index]
        assert card is not None
        return _Handle(card, is_mig=True)

    def nvmlDeviceIsMigDeviceHandle(self, device: _Handle) -> ctypes.c_uint:
        self._check(device, "nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(1 if device.is_mig else 0)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        card = handle.card
        if version and card.memory == "old-binding":
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
            return c_nvmlMemory_v2_t(version, card.total, card.reserved, card.free, used)
        return c_nvmlMemory_t(card.total, card.free, card.total - card.free)

    def _processes(
        self, handle: _Handle, function: str, rows: list[tuple[int, int | None]]
    ) -> list[Any]:
        self._check(handle, function)
        if not handle.card.processes_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if function.endswith("_v3") and handle.card.process_api == "v2":
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        out = []
        for pid, used in rows:
            raw = c_nvmlProcessInfo_v2_t(pid, _NOT_AVAILABLE if used is None else used, 0, 0)
            raw.gpuInstanceId = raw.computeInstanceId = 0xFFFFFFFF
            values = {name: getattr(raw, name) for name, _ in c_nvmlProcessInfo_v2_t._fields_}
            if values["usedGpuMemory"] == _NOT_AVAILABLE:
                values["usedGpuMemory"] = None
            out.append(nvmlFriendlyObject(values))
        return out

    def _unversioned(self, handle: _Handle, kind: str) -> list[Any]:
        try:
            return getattr(self, f"nvmlDevice{kind}RunningProcesses_v3")(handle)  # type: ignore[no-any-return]
        except NVMLError as exc:
            if exc.value != NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            raise NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML "
                f"lib version. Use a versioned function such as nvmlDevice{kind}"
                "RunningProcesses_v2"
            ) from None

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._processes(
            handle, "nvmlDeviceGetComputeRunningProcesses_v2", handle.card.compute
        )

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._processes(
            handle, "nvmlDeviceGetComputeRunningProcesses_v3", handle.card.compute
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        self.calls.append("nvmlDeviceGetComputeRunningProcesses")
        return self._unversioned(handle, "GetCompute")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._processes(
            handle, "nvmlDeviceGetGraphicsRunningProcesses_v2", handle.card.graphics
        )

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._processes(
            handle, "nvmlDeviceGetGraphicsRunningProcesses_v3", handle.card.graphics
        )

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[Any]:
        self.calls.append("nvmlDeviceGetGraphicsRunningProcesses")
        return self._unversioned(handle, "GetGraphics")

    def nvmlDeviceGetAccountingMode(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetAccountingMode")
        if handle.is_mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return NVML_FEATURE_DISABLED if handle.card.accounting is None else NVML_FEATURE_ENABLED

    def nvmlDeviceGetAccountingStats(self, handle: _Handle, pid: int) -> Any:
        self._check(handle, "nvmlDeviceGetAccountingStats")
        accounting = handle.card.accounting
        if accounting is None or pid not in accounting:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        stats = c_nvmlAccountingStats_t()
        value = accounting[pid]
        stats.maxMemoryUsage = _NOT_AVAILABLE if value is None else value
        stats.isRunning = 1
        if stats.maxMemoryUsage == _NOT_AVAILABLE:
            # What the binding does: None into a c_ulonglong field raises TypeError.
            stats.maxMemoryUsage = None
        return stats


def h100(index: int, **overrides: Any) -> FakeCard:
    """An idle H100 80GB with a deterministic UUID ``GPU-0000000<index>-...``."""
    uuid = f"GPU-{index:08x}-1111-2222-3333-{index:012x}"
    return FakeCard(uuid=uuid, **overrides)
