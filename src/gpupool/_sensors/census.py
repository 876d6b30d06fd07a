"""Take the census: which devices the pool may use and how full each is, once (I/O edge).

::

    sensor.read_devices()          every device the driver lists (NVML order)
        | narrowed by the parent's visible-devices variable (the sensor's:
        |   CUDA_VISIBLE_DEVICES for NVML and the simulator, see _sensors/cuda.py)
        | selected by the pool's devices= option (index or UUID)
        v
    per device: sensor.read_memory()      total, free, reserved   (unreadable -> None + reason)
                sensor.read_processes()   this process's row -> own bytes
        v
    Census(cards=...), DeviceInfo per card (children are pinned by its UUID)

    sensor.read_host()             usable CPUs and RAM, the CPUs capped by LOKY_MAX_CPU_COUNT

Co-tenant bytes are ``total - free - own`` from the device's own totals,
never a sum of per-process rows: inside containers the rows omit other
containers' processes, or read 0 on some drivers.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from gpupool._core.census import CardCensus, Census
from gpupool._errors import ConfigurationError, NoDriverError, SensorError
from gpupool._sensors.cuda import count_cards, match_entry
from gpupool._sensors.host import cap_host_cpus

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from gpupool._sensors.base import DeviceInfo, ProcessReading, Sensor

__all__ = [
    "OWN_ROW_MISSING_REASON",
    "OWN_ROWS_UNAVAILABLE_REASON",
    "live_census",
    "read_census",
]

#: Our process has no row although the driver lists processes: either we
#: hold no context (a pool parent never creates one) or the driver reports
#: PIDs of another namespace (containers, on some drivers).
OWN_ROW_MISSING_REASON = (
    "this process's row was not found: it holds no device memory (no CUDA context), or "
    "the driver lists it under another PID (a container's namespace); using the measured "
    "baseline of a parent that has created no CUDA context (0 bytes)"
)

#: The driver gives no per-process rows on this device (MIG, WDDM, some drivers).
OWN_ROWS_UNAVAILABLE_REASON = (
    "per-process rows are unavailable on this device; using the measured baseline of "
    "a parent that has created no CUDA context"
)

#: NVML presents MPS "locality domain" devices and MPS-provided memory
#: figures when this is set (nvml.h); the census then reads MPS's view.
_MPS_ENUMERATION_ENV = "NVML_MPS_DEVICE_ENUMERATION"


def _describe(listed: Sequence[DeviceInfo]) -> str:
    if not listed:
        return "no device is visible"
    return ", ".join(
        f"{info.index}{f'/MIG {info.mig_index}' if info.mig else ''} {info.uuid} ({info.name})"
        for info in listed
    )


def _select(
    wanted: Sequence[int | str],
    visible: Sequence[DeviceInfo],
    listed: Sequence[DeviceInfo],
    hidden_by: str,
) -> tuple[DeviceInfo, ...]:
    """Apply the pool's ``devices=`` option (indexes, CUDA's UUIDs) to the visible devices.

    ``hidden_by`` names the variable that hid the devices left out of ``visible``.
    """
    chosen: list[DeviceInfo] = []
    for want in wanted:
        if isinstance(want, bool) or not isinstance(want, (int, str)):
            raise ConfigurationError(
                f"devices entry {want!r} is neither an index nor a UUID; "
                f"visible devices: {_describe(visible)}"
            )
        key = want.strip() if isinstance(want, str) else str(want)
        if not (key.isascii() and key.isdigit()) and not key.lower().startswith(("gpu-", "mig-")):
            raise ConfigurationError(
                f"devices entry {want!r} is neither an index nor a GPU-/MIG- UUID; "
                f"visible devices: {_describe(visible)}"
            )
        matches = match_entry(key, visible)
        if not (key.isascii() and key.isdigit()) and count_cards(matches) > 1:
            raise ConfigurationError(
                f"devices entry {want!r} matches {len(matches)} devices; give more of the "
                f"UUID. Visible devices: {_describe(visible)}"
            )
        if not matches:
            hidden = match_entry(key, listed)
            why = f"is hidden by {hidden_by}" if hidden else "does not exist on this host"
            raise ConfigurationError(
                f"devices entry {want!r} {why}; visible devices: {_describe(visible)}"
            )
        for info in matches:
            if not info.uuid:
                raise ConfigurationError(
                    f"devices entry {want!r} is device {info.index}, which the driver could not "
                    f"identify: {info.error}. Choose another device; visible devices: "
                    f"{_describe(visible)}"
                )
            if info not in chosen:
                chosen.append(info)
    return tuple(chosen)


def read_census(
    sensor: Sensor,
    *,
    devices: Sequence[int | str] | None = None,
    visible_devices: str | None = None,
    pid: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Census, tuple[DeviceInfo, ...]]:
    """Take the census of every device the pool may use, and of the host.

    Call it once, before any child of the pool exists: the census is never
    retaken (taken later, it would count the pool's own children as co-tenants).

    Args:
        sensor: where readings come from (NVML, the simulator).
        devices: the pool's own selection, by NVML index (as ``gpupool
            census`` and ``nvidia-smi`` number them) or by UUID (a unique
            prefix is enough); ``None`` takes every visible device.
        visible_devices: the parent's visible-devices value (the caller
            passes ``sensor.read_visible_devices()``, ``CUDA_VISIBLE_DEVICES``
            for NVML); it narrows which devices may be used, in the
            sensor's grammar (:meth:`Sensor.parse_visible_devices`).
        pid: the process whose device bytes are "own"; this process by default.
        environ: where ``LOKY_MAX_CPU_COUNT`` is read, which caps the host's
            usable CPUs; ``None`` reads this process's environment.

    Returns:
        ``(census, infos)``: ``infos[i]`` is the :class:`DeviceInfo` of
        ``census.cards[i]``, whose pool index is ``i``. With no driver the
        census has no cards and ``driver=False``; this is not an error.

    Raises:
        ConfigurationError: an entry of ``devices`` does not exist, is hidden
            by the visible-devices variable, is ambiguous or could not be
            identified; the message lists the visible devices. Or the
            sensor refuses the variable's value (``CUDA_VISIBLE_DEVICES``
            names cards by index where CUDA's order may differ from NVML's,
            see :func:`gpupool._sensors.cuda.parse_visible_devices`). Or
            ``LOKY_MAX_CPU_COUNT`` is not a whole number of at least 1.
        SensorError: a driver answered but its device list could not be read.
    """
    host = cap_host_cpus(sensor.read_host(), os.environ if environ is None else environ)
    try:
        listed = sensor.read_devices()
    except NoDriverError as exc:
        why = f"no NVIDIA driver or library: {exc}"
        return Census(cards=(), host=host, driver=False, sensor=sensor.name, reason=why), ()
    chosen, notes = _usable(sensor, listed, devices, visible_devices)
    own = os.getpid() if pid is None else pid
    cards = tuple(_census_card(sensor, info, device=n, pid=own) for n, info in enumerate(chosen))
    reason = "; ".join(notes) or None
    return Census(cards=cards, host=host, driver=True, sensor=sensor.name, reason=reason), chosen


def live_census() -> tuple[Sensor, Census, tuple[DeviceInfo, ...]]:
    """The census as a pool takes it: the default sensor (closed on failure, else the
    caller's to close), narrowed by its visible devices."""
    from gpupool._sensors.select import default_sensor

    sensor = default_sensor()
    try:
        census, infos = read_census(sensor, visible_devices=sensor.read_visible_devices())
    except BaseException:
        sensor.close()
        raise
    return sensor, census, infos


def _usable(
    sensor: Sensor,
    listed: tuple[DeviceInfo, ...],
    devices: Sequence[int | str] | None,
    visible_devices: str | None,
) -> tuple[tuple[DeviceInfo, ...], list[str]]:
    """The devices the pool may use, in its order, and the census' notes on the rest."""
    notes: list[str] = []
    visible, note = sensor.parse_visible_devices(visible_devices, listed)
    if note:
        notes.append(note)
    hidden_by = sensor.visible_devices_env
    chosen = visible if devices is None else _select(devices, visible, listed, hidden_by)
    for info in chosen:
        if not info.uuid:
            what = f"device {info.index}" + (f" MIG {info.mig_index}" if info.mig else "")
            notes.append(
                f"{what} is left out: {info.error}; children are pinned by UUID, so a device "
                "without one cannot be used"
            )
    if not listed:
        notes.append("the driver lists no device")
    mps = os.environ.get(_MPS_ENUMERATION_ENV)
    if mps:
        notes.append(
            f"{_MPS_ENUMERATION_ENV}={mps} is set: NVML reports MPS devices and MPS-provided "
            "memory figures"
        )
    return tuple(info for info in chosen if info.uuid), notes


def _census_card(sensor: Sensor, info: DeviceInfo, *, device: int, pid: int) -> CardCensus:
    """One device's census; an unreadable device is ``None``s and a reason, never empty."""
    card = functools.partial(
        CardCensus, device=device, uuid=info.uuid, name=info.name, mig=info.mig
    )
    try:
        memory = sensor.read_memory(info)
    except NoDriverError:
        raise
    except SensorError as exc:  # DeviceUnreadableError, or a sensor's own failure
        return card(
            total_bytes=None,
            free_bytes=None,
            own_bytes=None,
            source=sensor.name,
            own_source="unknown",
            reason=f"unreadable: {exc}",
        )
    rows: tuple[ProcessReading, ...] | None
    rows_error: str | None = None
    try:
        rows = sensor.read_processes(info)
    except NoDriverError:
        raise
    except SensorError as exc:
        rows, rows_error = None, str(exc)
    own_bytes, own_source, reason = _own_bytes(rows, pid)
    if rows_error is not None:
        reason = f"{OWN_ROWS_UNAVAILABLE_REASON} ({rows_error})"
    return card(
        total_bytes=memory.total_bytes,
        free_bytes=memory.free_bytes,
        own_bytes=own_bytes,
        reserved_bytes=memory.reserved_bytes,
        unified=memory.unified,
        source=memory.source,
        own_source=own_source,
        reason=reason,
    )


def _own_bytes(rows: tuple[ProcessReading, ...] | None, pid: int) -> tuple[int, str, str | None]:
    """This process's bytes, where they came from, and why they are a baseline if so.

    No rows at all on a device that lists processes means nothing holds a
    context there, this process included: 0, read from the rows.
    """
    if rows is None:
        return 0, "baseline", OWN_ROWS_UNAVAILABLE_REASON
    for row in rows:
        if row.pid == pid:
            if row.used_bytes is None:
                return (
                    0,
                    "baseline",
                    "this process's row carries no byte count (the driver does not say); "
                    "using the measured baseline of a parent that has created no CUDA context",
                )
            return row.used_bytes, "process-row", None
    if not rows:
        return 0, "process-row", None
    return 0, "baseline", OWN_ROW_MISSING_REASON
