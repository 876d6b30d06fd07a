"""The NVML sensor: devices, memory and per-process bytes from NVIDIA's driver (I/O edge).

The only module that imports ``pynvml`` (the module of NVIDIA's
``nvidia-ml-py`` distribution), and only inside methods, so ``import
gpupool`` never loads it. NVML is initialised once per sensor, on first use.
Nothing here creates a CUDA context: NVML reads the driver's books, and
never imports torch or CuPy.

Backend errors are mapped once, in :func:`_translate`:

* the library or the kernel driver is absent (``NVMLError_LibraryNotFound``,
  ``NVMLError_DriverNotLoaded``, or ``pynvml`` not importable) ->
  :class:`~gpupool.NoDriverError`: the host has no device for us;
* any other ``NVMLError`` -> :class:`~gpupool.DeviceUnreadableError` (a
  device's reading) or :class:`~gpupool.SensorError` (the device list):
  a driver is present and the reading failed, which is never read as empty.

Each method names its NVML call and the ``nvidia-smi`` query that shows the
same figure, so a reading can be checked by hand.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool._errors import DeviceUnreadableError, NoDriverError, SensorError
from gpupool._sensors.ancestry import is_descendant
from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading, Sensor

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType

    from gpupool._core.census import HostCensus

__all__ = ["NvmlSensor"]

#: NVML's return codes, as ``nvml.h`` numbers them (pynvml's
#: ``NVML_ERROR_*``); kept here so that the mapping does not depend on which
#: constants an old binding happens to define.
_NOT_SUPPORTED = 3
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13

#: ``nvmlDeviceGetMigMode``'s "current mode" value for MIG enabled.
_MIG_ENABLED = 1

#: ``NVML_FEATURE_ENABLED``: what ``nvmlDeviceGetAccountingMode`` answers when on.
_FEATURE_ENABLED = 1


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _is_no_driver(exc: BaseException) -> bool:
    """Whether an NVML error means "no NVIDIA library or driver on this host"."""
    if _code(exc) in (_LIBRARY_NOT_FOUND, _DRIVER_NOT_LOADED):
        return True
    # Bindings that lost the code still say it in words.
    text = str(exc)
    return "Shared Library Not Found" in text or "Driver Not Loaded" in text


def _translate(exc: BaseException, what: str, *, device: DeviceInfo | None = None) -> SensorError:
    """Map a backend error to gpupool's own, once, for every call in this module."""
    detail = f"{type(exc).__name__}: {exc}"
    if _is_no_driver(exc):
        return NoDriverError(f"{what} failed: {detail}")
    if device is not None:
        return DeviceUnreadableError(f"{_label(device)}: {what} failed: {detail}")
    return SensorError(f"{what} failed: {detail}")


def _label(device: DeviceInfo) -> str:
    if device.mig:
        return f"device {device.index} MIG {device.mig_index} ({device.uuid})"
    return f"device {device.index} ({device.uuid})"


def _text(value: object) -> str:
    """NVML strings are ``str`` in current bindings, ``bytes`` in old ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _failed(call: str, exc: BaseException, what: str) -> str:
    return f"{call} failed ({type(exc).__name__}: {exc}), so gpupool cannot {what}"


def _flag(value: object) -> bool:
    """NVML booleans: ``nvmlDeviceIsMigDeviceHandle`` returns a ``ctypes.c_uint``, and
    ``c_uint(1) == 1`` is False, so its ``.value``."""
    return bool(getattr(value, "value", value))


def _reading(info: Any, reserved_bytes: int | None, source: str) -> MemoryReading:
    """A discrete card's reading from NVML's memory info (v1 or v2)."""
    return MemoryReading(
        total_bytes=int(info.total),
        free_bytes=int(info.free),
        used_bytes=int(info.used),
        reserved_bytes=reserved_bytes,
        unified=False,
        source=source,
    )


class NvmlSensor(Sensor):
    """Reads devices through NVML (``nvidia-ml-py``'s ``pynvml``).

    Args:
        meminfo_path: where unified-memory devices (GB10, Jetson) read their
            capacity and free memory; tests point it at a saved sample.
        host_root: the filesystem root for :meth:`read_host` (cgroups, meminfo).
    """

    name = "nvml"

    def __init__(
        self,
        *,
        meminfo_path: Path = Path("/proc/meminfo"),
        host_root: Path = Path("/"),
    ) -> None:
        self._meminfo_path = meminfo_path
        self._host_root = host_root
        self._lib: ModuleType | None = None
        self._init_error: SensorError | None = None
        self._handles: dict[str, Any] = {}

    def worker_factory(self) -> Callable[[], Sensor]:
        """This sensor again, in a worker: NVML reading the same paths."""
        return functools.partial(
            NvmlSensor, meminfo_path=self._meminfo_path, host_root=self._host_root
        )

    # -- NVML plumbing -------------------------------------------------------

    def _nvml(self) -> ModuleType:
        """``pynvml``, imported and initialised (``nvmlInit``) on first use, once."""
        if self._lib is not None:
            return self._lib
        if self._init_error is not None:
            raise type(self._init_error)(str(self._init_error))
        try:
            with warnings.catch_warnings():
                # The deprecated ``pynvml`` distribution, if also installed,
                # warns on any import of a ``pynvml*`` name, ours included.
                warnings.filterwarnings("ignore", "The pynvml package is deprecated", FutureWarning)
                import pynvml
        except ImportError as exc:
            self._init_error = NoDriverError(
                f"the NVML binding is not importable ({exc}); install nvidia-ml-py"
            )
            raise type(self._init_error)(str(self._init_error)) from exc
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            if not isinstance(exc, pynvml.NVMLError) and not _is_no_driver(exc):
                raise
            self._init_error = _translate(exc, "nvmlInit")
            raise type(self._init_error)(str(self._init_error)) from exc
        self._lib = pynvml
        return self._lib

    @contextmanager
    def _mapped(self, what: str, device: DeviceInfo | None = None) -> Iterator[ModuleType]:
        """Run NVML calls with their errors mapped to gpupool's (see :func:`_translate`)."""
        lib = self._nvml()
        try:
            yield lib
        except lib.NVMLError as exc:
            raise _translate(exc, what, device=device) from exc

    def _handle(self, device: DeviceInfo) -> Any:
        if device.error is not None:
            raise DeviceUnreadableError(f"{_label(device)}: {device.error}")
        handle = self._handles.get(device.uuid)
        if handle is None:
            try:
                self.read_devices()
            except NoDriverError:
                raise
            except SensorError as exc:
                raise DeviceUnreadableError(f"{_label(device)}: {exc}") from exc
            handle = self._handles.get(device.uuid)
        if handle is None:
            raise DeviceUnreadableError(f"{_label(device)}: the driver no longer lists it")
        return handle

    # -- Sensor --------------------------------------------------------------

    def read_devices(self) -> tuple[DeviceInfo, ...]:
        """Every card by NVML index, MIG instances in place of a MIG-enabled card.

        NVML calls: ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
        ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName``, ``nvmlDeviceGetMigMode``,
        ``nvmlDeviceGetMaxMigDeviceCount``, ``nvmlDeviceGetMigDeviceHandleByIndex``.
        ``nvidia-smi -L`` lists the same devices and UUIDs.

        A card in MIG mode is listed as its instances only: CUDA work runs on
        an instance, never on the parent card. Empty instance slots
        (``NVML_ERROR_NOT_FOUND``) are skipped. A card that fails to answer
        (``GPU_IS_LOST``, say) does not fail the list: it is listed with its
        ``error`` (and ``uuid == ""`` when even its UUID could not be read),
        and every other card is read.

        Raises:
            NoDriverError: no NVIDIA library or driver.
            SensorError: the driver answered but the device count could not be read.
        """
        found: list[DeviceInfo] = []
        handles: dict[str, Any] = {}
        with self._mapped("listing devices (nvmlDeviceGetCount)") as lib:
            count = int(lib.nvmlDeviceGetCount())
        for index in range(count):
            found.extend(self._read_card(index, handles))
        self._handles = handles
        return tuple(found)

    def _read_card(self, index: int, handles: dict[str, Any]) -> list[DeviceInfo]:
        """One card, or its MIG instances; a failing call becomes the device's ``error``."""
        lib = self._nvml()
        step = "nvmlDeviceGetHandleByIndex"
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            step = "nvmlDeviceGetUUID"
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
        except lib.NVMLError as exc:
            if _is_no_driver(exc):
                raise _translate(exc, f"reading device {index} ({step})") from exc
            return [
                DeviceInfo(
                    index=index, uuid="", name="unknown", error=_failed(step, exc, "identify it")
                )
            ]
        try:
            name = _text(lib.nvmlDeviceGetName(handle))
        except lib.NVMLError:
            name = "unknown"
        card = DeviceInfo(index=index, uuid=uuid, name=name)
        try:
            mig = self._mig_enabled(lib, handle)
            instances = list(self._mig_handles(lib, handle)) if mig else []
        except lib.NVMLError as exc:
            if _is_no_driver(exc):
                raise _translate(exc, f"reading device {index} (nvmlDeviceGetMigMode)") from exc
            handles[uuid] = handle
            error = _failed("nvmlDeviceGetMigMode", exc, "tell whether it is in MIG mode")
            return [card.replace(error=error)]
        if not mig:
            handles[uuid] = handle
            return [card]
        return [
            _mig_instance(lib, card, slot, mig_handle, handles) for slot, mig_handle in instances
        ]

    @staticmethod
    def _mig_enabled(lib: ModuleType, handle: Any) -> bool:
        """``nvmlDeviceGetMigMode`` (``nvidia-smi --query-gpu=mig.mode.current``)."""
        getter = getattr(lib, "nvmlDeviceGetMigMode", None)
        if getter is None:
            return False
        try:
            current = getter(handle)[0]
        except lib.NVMLError as exc:
            if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                return False  # not a MIG-capable card, or a driver that predates MIG
            raise
        return int(current) == _MIG_ENABLED

    @staticmethod
    def _mig_handles(lib: ModuleType, handle: Any) -> Iterator[tuple[int, Any]]:
        """The MIG instances of one card (``nvidia-smi -L`` shows them under it)."""
        slots = lib.nvmlDeviceGetMaxMigDeviceCount(handle)
        for slot in range(slots):
            try:
                mig_handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except lib.NVMLError as exc:
                if _code(exc) == _NOT_FOUND:
                    continue  # an empty slot: no instance created there
                raise
            is_mig = getattr(lib, "nvmlDeviceIsMigDeviceHandle", None)
            if is_mig is not None and not _flag(is_mig(mig_handle)):
                continue
            yield slot, mig_handle

    def read_memory(self, device: DeviceInfo) -> MemoryReading:
        """Total, free, used and reserved bytes now.

        NVML call: ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)``
        (``nvidia-smi --query-gpu=memory.total,memory.reserved,memory.used,memory.free``),
        source ``"nvml-v2"``: ``reserved`` is its own term and ``used`` is
        allocated memory only. Drivers or bindings without v2 fall back to
        ``nvmlDeviceGetMemoryInfo(handle)`` (source ``"nvml-v1"``, whose
        ``used`` includes the reserved memory; ``reserved_bytes`` is ``None``).

        Unified memory (GB10 / DGX Spark, Jetson) answers ``NOT_SUPPORTED``
        to both (``nvidia-smi`` prints ``[N/A]``): capacity is ``MemTotal``
        from ``/proc/meminfo``, and free is ``MemAvailable`` when no other
        process holds the device (this process and its descendants, the
        pool's workers, do not count), ``MemFree`` when another does or when
        the process list is unknown (source ``"meminfo"``, ``unified=True``).

        Raises:
            DeviceUnreadableError: the driver answered with an error, a MIG
                instance answered NOT_SUPPORTED (never read as unified), or
                the unified-memory fallback could not read ``/proc/meminfo``.
        """
        what = "reading memory (nvmlDeviceGetMemoryInfo)"
        with self._mapped(what, device) as lib:
            handle = self._handle(device)
            reading = self._read_memory_v2(lib, handle)
            if reading is None:
                reading = self._read_memory_v1(lib, handle)
        if reading is None:
            if device.mig:
                # A MIG instance is a slice of a discrete card, never unified
                # memory: the host's MemTotal would be a wrong capacity.
                raise DeviceUnreadableError(
                    f"{_label(device)}: memory info answers NOT_SUPPORTED on this MIG instance"
                )
            reading = self._read_unified_memory(device)
        return reading

    @staticmethod
    def _read_memory_v2(lib: ModuleType, handle: Any) -> MemoryReading | None:
        """The v2 reading, or ``None`` where the driver or binding has no v2."""
        version = getattr(lib, "nvmlMemory_v2", None)
        if version is None:
            return None
        try:
            info = lib.nvmlDeviceGetMemoryInfo(handle, version=version)
        except TypeError:
            return None  # a binding whose nvmlDeviceGetMemoryInfo takes no version
        except lib.NVMLError as exc:
            if _code(exc) in (_FUNCTION_NOT_FOUND, _NOT_SUPPORTED):
                return None  # a driver before R510, or unified memory: try v1
            raise
        return _reading(info, int(info.reserved), "nvml-v2")

    @staticmethod
    def _read_memory_v1(lib: ModuleType, handle: Any) -> MemoryReading | None:
        """The v1 reading, or ``None`` where the device answers ``NOT_SUPPORTED`` (unified)."""
        try:
            info = lib.nvmlDeviceGetMemoryInfo(handle)
        except lib.NVMLError as exc:
            if _code(exc) == _NOT_SUPPORTED:
                return None
            raise
        return _reading(info, None, "nvml-v1")

    def _read_unified_memory(self, device: DeviceInfo) -> MemoryReading:
        """Unified memory: the host's ``/proc/meminfo`` is the device's memory."""
        from gpupool._sensors.host import read_meminfo  # not at the top: workers skip the census

        try:
            meminfo = read_meminfo(self._meminfo_path)
        except (OSError, ValueError) as exc:
            raise DeviceUnreadableError(
                f"{_label(device)}: NVML memory info is not supported (unified memory?) "
                f"and {self._meminfo_path} could not be read: {exc}"
            ) from exc
        try:
            rows = self.read_processes(device)
        except SensorError:
            rows = None
        # This process and its descendants (the pool's own workers and what
        # their tasks start) are not competitors for the page cache.
        me = os.getpid()
        alone = rows is not None and all(is_descendant(row.pid, me) for row in rows)
        free = meminfo.free_bytes
        if alone and meminfo.available_bytes is not None:
            free = meminfo.available_bytes
        return MemoryReading(
            total_bytes=meminfo.total_bytes,
            free_bytes=free,
            used_bytes=meminfo.total_bytes - free,
            reserved_bytes=None,
            unified=True,
            source="meminfo",
        )

    def read_processes(self, device: DeviceInfo) -> tuple[ProcessReading, ...] | None:
        """Per-process device bytes: compute and graphics processes, de-duplicated by PID.

        NVML calls: ``nvmlDeviceGetComputeRunningProcesses`` and
        ``nvmlDeviceGetGraphicsRunningProcesses`` (``nvidia-smi
        --query-compute-apps=pid,used_memory``; plain ``nvidia-smi`` lists
        both kinds, ``C+G`` for a process in both). ``used_bytes`` is
        ``None`` where the driver does not say (``NVML_VALUE_NOT_AVAILABLE``:
        Windows WDDM, some MIG setups).

        Returns:
            The rows, or ``None`` when the driver supports neither list.

        Raises:
            DeviceUnreadableError: the driver answered with another error.
        """
        what = "listing processes (nvmlDeviceGetComputeRunningProcesses)"
        with self._mapped(what, device) as lib:
            handle = self._handle(device)
            compute = self._process_list(lib, handle, "nvmlDeviceGetComputeRunningProcesses")
            graphics = self._process_list(lib, handle, "nvmlDeviceGetGraphicsRunningProcesses")
        if compute is None and graphics is None:
            return None
        merged: dict[int, ProcessReading] = {}
        for info in [*(compute or []), *(graphics or [])]:
            pid = int(info.pid)
            used = getattr(info, "usedGpuMemory", None)
            used_bytes = None if used is None else int(used)
            seen = merged.get(pid)
            if seen is not None and (
                used_bytes is None
                or (seen.used_bytes is not None and seen.used_bytes >= used_bytes)
            ):
                continue
            merged[pid] = ProcessReading(pid=pid, used_bytes=used_bytes)
        return tuple(merged.values())

    def read_process_max_bytes(self, device: DeviceInfo, pid: int) -> int | None:
        """``pid``'s device high-water over its life, from NVML accounting, when it is on.

        NVML calls: ``nvmlDeviceGetAccountingMode`` and
        ``nvmlDeviceGetAccountingStats(handle, pid).maxMemoryUsage``
        (``nvidia-smi --query-accounted-apps=pid,max_memory_usage``). The driver
        keeps it only with accounting enabled (root: ``nvidia-smi -am 1``), and
        not on MIG instances; it misses no spike, which sampling can.

        Returns:
            The bytes, or ``None`` when accounting is off, unsupported, or has
            no record of ``pid``.
        """
        lib = self._nvml()
        try:
            handle = self._handle(device)
            if int(lib.nvmlDeviceGetAccountingMode(handle)) != _FEATURE_ENABLED:
                return None
            stats = lib.nvmlDeviceGetAccountingStats(handle, pid)
        except (lib.NVMLError, SensorError, AttributeError, TypeError, ValueError):
            # TypeError: the binding assigns None to the struct's integer field
            # when the driver answers NVML_VALUE_NOT_AVAILABLE (WDDM, some MIG).
            return None
        value = getattr(stats, "maxMemoryUsage", None)
        return None if value is None else int(value)

    @staticmethod
    def _process_list(lib: ModuleType, handle: Any, function: str) -> list[Any] | None:
        """One NVML process list; ``None`` where unsupported.

        pynvml's unversioned wrappers call the ``_v3`` symbol and turn a
        missing symbol into ``NVMLLibraryMismatchError`` (not an
        ``NVMLError``); older drivers have ``_v2``.
        """
        candidates: list[Callable[[Any], list[Any]]] = []
        for name in (function, f"{function}_v2"):
            fn = getattr(lib, name, None)
            if fn is not None:
                candidates.append(fn)
        mismatch: type[BaseException] | None = getattr(lib, "NVMLLibraryMismatchError", None)
        for fn in candidates:
            try:
                return list(fn(handle))
            except lib.NVMLError as exc:
                if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                    continue
                raise
            except Exception as exc:
                if mismatch is not None and isinstance(exc, mismatch):
                    continue
                raise
        return None

    def read_host(self) -> HostCensus:
        """Usable CPUs and available RAM, by :func:`gpupool._sensors.host.read_host_census`."""
        from gpupool._sensors.host import read_host_census  # the parent's census only

        return read_host_census(self._host_root)

    def close(self) -> None:
        """``nvmlShutdown``, once, if this sensor initialised NVML. Idempotent."""
        lib, self._lib = self._lib, None
        self._handles = {}
        if lib is None:
            return
        # Shutting down a library that is going away: an error leaves nothing to do.
        with contextlib.suppress(lib.NVMLError):
            lib.nvmlShutdown()


def _mig_instance(
    lib: ModuleType, card: DeviceInfo, mig_index: int, handle: Any, handles: dict[str, Any]
) -> DeviceInfo:
    """One MIG instance of ``card``; a failing call becomes the instance's ``error``."""
    instance = card.replace(uuid="", mig=True, mig_index=mig_index, parent_uuid=card.uuid)
    try:
        uuid = _text(lib.nvmlDeviceGetUUID(handle))
    except lib.NVMLError as exc:
        return instance.replace(
            error=_failed("nvmlDeviceGetUUID", exc, "identify this MIG instance")
        )
    try:
        name = _text(lib.nvmlDeviceGetName(handle))
    except lib.NVMLError:
        name = card.name
    handles[uuid] = handle
    return instance.replace(uuid=uuid, name=name)
