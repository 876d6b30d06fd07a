"""Fake C entry points under the real ``pynvml.py``: the binding's own struct handling runs.

``nvidia-ml-py``'s wrappers look every NVML function up with
``_nvmlGetFunctionPointer(name)``, which reads ``getattr(pynvml.nvmlLib, name)``
(cached in ``pynvml._nvmlGetFunctionPointer_cache``). :func:`install` puts a
:class:`FakeNvmlLib` there, so ``pynvml.nvmlDeviceGetComputeRunningProcesses``
really sizes its ``c_nvmlProcessInfo_v3_t`` array, calls the entry point twice
(``INSUFFICIENT_SIZE``, then the fill) and converts the structs, exactly as on
a host with the driver. The entry points are Python callables: ctypes passes
them the binding's own objects (``byref(x)._obj`` is ``x``), and they write
into those as the driver writes into the caller's memory.

A card answers with the process rows a test gives (``rows``), written into the
binding's array field by field, or with raw bytes (``raw_rows``): entries of
another layout than the binding's, as a driver whose struct does not match the
binding's writes them (the early R535 ``_v3`` break).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from typing import Any

import pytest

GiB = 1024**3

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INSUFFICIENT_SIZE = 7

#: One entry of a driver whose process struct carries ``usedGpuCcProtectedMemory``
#: after ``computeInstanceId`` (32 bytes), against the binding's 24.
WIDE_ENTRY = struct.Struct("<I4xQIIQ")


@dataclass
class FakeNvmlCard:
    """One card: its memory figures and what its process list answers."""

    total_bytes: int = 80 * GiB
    used_bytes: int = 0
    reserved_bytes: int = 512 * 1024**2
    uuid: str = "GPU-fa4e0000-0000-4000-8000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    rows: list[tuple[int, int]] = field(default_factory=list)
    #: (pid, usedGpuMemory, usedGpuCcProtectedMemory), written as WIDE_ENTRY structs.
    raw_rows: list[tuple[int, int, int]] | None = None

    @property
    def count(self) -> int:
        return len(self.raw_rows) if self.raw_rows is not None else len(self.rows)


class FakeNvmlLib:
    """The C symbols ``NvmlSensor`` reaches through the real binding, for one card."""

    def __init__(self, card: FakeNvmlCard) -> None:
        self.card = card
        self.calls: list[str] = []

    def nvmlInitWithFlags(self, flags: Any) -> int:
        return NVML_SUCCESS

    def nvmlShutdown(self) -> int:
        return NVML_SUCCESS

    def nvmlErrorString(self, result: Any) -> bytes:
        return b"fake NVML error"

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = 1
        return NVML_SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, device: Any) -> int:
        return NVML_SUCCESS  # the opaque handle stays NULL: there is one card

    def nvmlDeviceGetUUID(self, handle: Any, buffer: Any, size: Any) -> int:
        buffer.value = self.card.uuid.encode()
        return NVML_SUCCESS

    def nvmlDeviceGetName(self, handle: Any, buffer: Any, size: Any) -> int:
        buffer.value = self.card.name.encode()
        return NVML_SUCCESS

    def nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        return NVML_ERROR_NOT_SUPPORTED

    def nvmlDeviceGetMemoryInfo_v2(self, handle: Any, memory: Any) -> int:
        info = memory._obj
        card = self.card
        info.total = card.total_bytes
        info.reserved = card.reserved_bytes
        info.used = card.used_bytes
        info.free = card.total_bytes - card.reserved_bytes - card.used_bytes
        return NVML_SUCCESS

    def nvmlDeviceGetAccountingMode(self, handle: Any, mode: Any) -> int:
        mode._obj.value = 0  # NVML_FEATURE_DISABLED
        return NVML_SUCCESS

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        self.calls.append("compute_v3")
        card = self.card
        if infos is None:
            count._obj.value = card.count
            return NVML_ERROR_INSUFFICIENT_SIZE if card.count else NVML_SUCCESS
        if card.raw_rows is not None:
            data = b"".join(
                WIDE_ENTRY.pack(pid, used, 0xFFFFFFFF, 0xFFFFFFFF, protected)
                for pid, used, protected in card.raw_rows
            )
            assert len(data) <= ctypes.sizeof(infos)
            ctypes.memmove(infos, data, len(data))
        else:
            for index, (pid, used) in enumerate(card.rows):
                infos[index].pid = pid
                infos[index].usedGpuMemory = used
                infos[index].gpuInstanceId = 0xFFFFFFFF
                infos[index].computeInstanceId = 0xFFFFFFFF
        count._obj.value = card.count
        return NVML_SUCCESS

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        count._obj.value = 0
        return NVML_SUCCESS


def install(monkeypatch: pytest.MonkeyPatch, card: FakeNvmlCard) -> FakeNvmlLib:
    """Put a :class:`FakeNvmlLib` for ``card`` under the installed ``pynvml`` for one test."""
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    lib = FakeNvmlLib(card)
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return lib
