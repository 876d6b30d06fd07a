"""A simulated GPU host for tests without a GPU: gpupool's own, and your pipeline's (public).

A :class:`SimulatedHost` is a set of simulated cards shared by the process
that enters it and every process started inside it (spawned children
included): each card has a total, co-tenant processes that hold bytes (and
can grow while a pool runs), and a per-process CUDA-context charge. Code under
test allocates with :func:`hold`; an allocation that would overflow its card
raises :class:`SimulatedOutOfMemory` in the allocating process, exactly where a
real out-of-memory error surfaces. The host keeps the truth for assertions:
each card's peak, each process's peak, and every refused allocation::

    import gpupool.testing as gt

    def task(i):
        with gt.hold("6GiB"):          # on the device this process is pinned to
            ...

    card = gt.SimulatedDevice("44.39GiB", co_tenants={"server": "9.5GiB"})
    with gt.SimulatedHost([card]) as host:
        ...                            # run the pipeline: the pool sees the simulated card
    assert host.out_of_memory_events == []
    assert host.device_peak(0) <= host.devices[0].total_bytes

Inside the block, gpupool's pool and ``gpupool census`` read the simulated
host instead of NVML. The state lives in a small ledger file in a private
temporary directory, found by children through the ``GPUPOOL_SIMULATOR``
environment variable; leaving the block removes it and restores the
environment. See ``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gpupool._core.units import format_size, parse_size
from gpupool._sensors.own_pid import own_pid
from gpupool._sensors.select import SIMULATOR_ENV, read_simulator_ledger
from gpupool._sensors.simulated import (
    BOOKINGS_DIRECTORY,
    CO_TENANT_PID_BASE,
    LEDGER_VERSION,
    DeviceState,
    Ledger,
    LedgerGoneError,
    LedgerState,
    OutOfMemoryRecord,
    device_used_bytes,
    forget_ledger,
    ledger_at,
    simulated_uuid,
)
from gpupool._sensors.simulated_sensor import SimulatedSensor, simulated_sensor
from gpupool._sensors.simulated_state import ROWS_MODES

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "OutOfMemoryEvent",
    "SimulatedDevice",
    "SimulatedHost",
    "SimulatedOutOfMemory",
    "hold",
]

#: The CUDA context a process is charged on its first touch of a device. A
#: real context costs a few hundred MiB (more with lazy loading off); 300 MiB
#: is typical of a recent driver with CUDA's lazy module loading.
DEFAULT_CONTEXT = "300MiB"

_NO_HOST = (
    "no simulated host is installed in this process: gpupool.testing.hold() allocates on a "
    "SimulatedHost's devices. Run it inside `with gpupool.testing.SimulatedHost([...]):`, or in "
    f"a process started inside one (children inherit the {SIMULATOR_ENV} environment variable)."
)


class SimulatedOutOfMemory(RuntimeError):
    """A simulated card could not hold an allocation (a ``RuntimeError``, as torch's OOM is).

    Raised by :func:`hold` in the allocating process, and by
    :meth:`SimulatedHost.grow` when a co-tenant outgrows its card. It pickles
    with its attributes, so it crosses process boundaries intact.

    Attributes:
        device: the simulated device's index.
        requested_bytes: the allocation that was refused.
        used_bytes: the card's used bytes when it was refused.
        total_bytes: the card's total.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        device: int,
        requested_bytes: int,
        used_bytes: int,
        total_bytes: int,
    ) -> None:
        if message is None:
            message = (
                f"simulated device {device} out of memory: tried to allocate "
                f"{format_size(requested_bytes)}; {format_size(total_bytes - used_bytes)} free "
                f"of {format_size(total_bytes)}"
            )
        super().__init__(message)
        self.device = device
        self.requested_bytes = requested_bytes
        self.used_bytes = used_bytes
        self.total_bytes = total_bytes

    def __reduce__(self) -> tuple[Any, ...]:
        terms = {"device": self.device, "requested_bytes": self.requested_bytes}
        terms.update(used_bytes=self.used_bytes, total_bytes=self.total_bytes)
        return functools.partial(SimulatedOutOfMemory, str(self), **terms), ()

    @classmethod
    def _from_record(cls, record: OutOfMemoryRecord) -> SimulatedOutOfMemory:
        return cls(
            device=record["device"],
            requested_bytes=record["requested_bytes"],
            used_bytes=record["used_bytes"],
            total_bytes=record["total_bytes"],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class OutOfMemoryEvent:
    """One allocation a simulated card refused.

    Attributes:
        pid: the process that asked: a real PID for :func:`hold`, a co-tenant's
            fake PID (at or above ``2**22``) for :meth:`SimulatedHost.grow`.
        device: the simulated device's index.
        requested_bytes: the refused allocation (a process's context, on its
            first touch of a card that cannot hold even that).
        used_bytes: the card's used bytes when it refused.
        total_bytes: the card's total.
        time_s: when, in seconds since the epoch (``time.time()``).
    """

    pid: int
    device: int
    requested_bytes: int
    used_bytes: int
    total_bytes: int
    time_s: float

    @property
    def co_tenant(self) -> bool:
        """Whether a co-tenant (not a real process) ran out."""
        return self.pid >= CO_TENANT_PID_BASE


class SimulatedDevice:
    """One simulated card, as given to :class:`SimulatedHost`.

    Args:
        total: the card's capacity: bytes or a size string (``"44.39GiB"``).
        co_tenants: processes already on the card that are not the pool's
            (a serving parent, another team's job), by name, with their bytes.
            Each is listed by the sensor under a fake PID with its name.
        unified: the card shares host memory (GB10, Jetson): the sensor reports
            it as ``/proc/meminfo`` would, with ``total`` as ``MemTotal``.
        readable: ``False`` makes memory readings fail as a broken NVML does
            (:class:`~gpupool.DeviceUnreadableError`); allocation still works.
        mig: the device is a MIG instance (``total`` is the instance's memory):
            the driver lists its processes without a figure, as NVML's "not
            available", whatever the host's ``rows``.

    Raises:
        InvalidSizeError: a size could not be parsed.
    """

    __slots__ = ("_co_tenants", "_mig", "_readable", "_total_bytes", "_unified")

    def __init__(
        self,
        total: int | float | str,
        *,
        co_tenants: Mapping[str, int | float | str] | None = None,
        unified: bool = False,
        readable: bool = True,
        mig: bool = False,
    ) -> None:
        self._total_bytes = parse_size(total, name="total", allow_zero=False)
        self._mig = bool(mig)
        self._co_tenants = MappingProxyType(
            {
                str(name): parse_size(size, name=f"co_tenants[{name!r}]")
                for name, size in (co_tenants or {}).items()
            }
        )
        self._unified = bool(unified)
        self._readable = bool(readable)

    @property
    def total_bytes(self) -> int:
        """The card's capacity in bytes."""
        return self._total_bytes

    @property
    def co_tenants(self) -> Mapping[str, int]:
        """The co-tenants at the start, by name, in bytes (read-only)."""
        return self._co_tenants

    @property
    def unified(self) -> bool:
        """Whether the card shares host memory."""
        return self._unified

    @property
    def readable(self) -> bool:
        """Whether the card's memory can be read."""
        return self._readable

    @property
    def mig(self) -> bool:
        """Whether the device is a MIG instance."""
        return self._mig

    def __repr__(self) -> str:
        return (
            f"SimulatedDevice(total={self._total_bytes}, co_tenants={dict(self._co_tenants)!r}, "
            f"unified={self._unified}, readable={self._readable}, mig={self._mig})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SimulatedDevice):
            return NotImplemented
        mine = (self._total_bytes, dict(self._co_tenants), self._unified, self._readable, self._mig)
        return mine == (
            other._total_bytes,
            dict(other._co_tenants),
            other._unified,
            other._readable,
            other._mig,
        )

    def __hash__(self) -> int:
        return hash((self._total_bytes, tuple(self._co_tenants.items()), self._unified))


#: Ledgers of hosts that have exited in this process: a host exited after an
#: older one must not restore the variable to the older one's removed ledger.
_EXITED_LEDGERS: set[str] = set()


class SimulatedHost:
    """A simulated GPU host shared by this process and every process started inside the block.

    Entering the block writes the host's ledger to a private temporary
    directory and sets ``GPUPOOL_SIMULATOR`` in ``os.environ``, so that
    spawned children (and the pool's workers) share it; leaving it removes
    the ledger and restores the variable. The peaks and events stay readable
    after the block, for assertions.

    Args:
        devices: the cards, in index order; device ``i`` has UUID
            ``GPU-51a1a7ed-0000-4000-8000-00000000000i`` and the name
            ``"Simulated GPU"``.
        context: what a process is charged on its first allocation on a card,
            and keeps until it dies, as a CUDA context (``0`` allowed).
        cpus: the host's usable CPUs; ``None``: the real host's.
        host_ram: the host's available RAM; ``None``: the real host's.
        driver: ``False`` simulates a host without an NVIDIA driver: the
            sensor raises :class:`~gpupool.NoDriverError`.
        container: ``True`` simulates a container: the driver lists this
            host's processes under PIDs of another namespace, so no row is
            theirs (``rows="hidden"``).
        rows: how the driver lists this host's processes: ``"listed"`` (with
            their bytes, as on bare metal), ``"hidden"`` (a container),
            ``"zero"`` (0 bytes each, as drivers 535.113 to 560 do in a
            container) or ``"unavailable"`` (no figure, as on a MIG instance:
            ``SimulatedDevice(mig=True)`` lists its rows so whatever this says).
            Anything but ``"listed"`` is as strict as such a card: no process
            reports its own exact peak, so a pool's workers measure as they
            would there (frameworks' counters, the estimated context, and
            peaks flagged incomplete where a task's descendants went unread).

    Raises:
        InvalidSizeError: a size could not be parsed.
        ValueError: ``cpus`` is not a positive integer, a device is not a
            :class:`SimulatedDevice`, or ``rows`` is not one of the four.
    """

    def __init__(
        self,
        devices: Sequence[SimulatedDevice] = (),
        *,
        context: int | float | str = DEFAULT_CONTEXT,
        cpus: int | None = None,
        host_ram: int | float | str | None = None,
        driver: bool = True,
        container: bool = False,
        rows: str = "listed",
    ) -> None:
        for device in devices:
            if not isinstance(device, SimulatedDevice):
                raise ValueError(f"devices must be SimulatedDevice objects; got {device!r}")
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1):
            raise ValueError(f"cpus={cpus!r} must be a positive integer, or None for the host's")
        self._devices = tuple(devices)
        self._context_bytes = parse_size(context, name="context")
        self._cpus = cpus
        self._host_ram_bytes = None if host_ram is None else parse_size(host_ram, name="host_ram")
        self._driver = bool(driver)
        self._container = bool(container)
        if rows not in ROWS_MODES:
            raise ValueError(f"rows={rows!r} must be one of {', '.join(ROWS_MODES)}")
        if container and rows not in ("listed", "hidden"):
            raise ValueError(f"container=True hides the rows; rows={rows!r} contradicts it")
        self._rows = "hidden" if container else rows
        self._directory: str | None = None
        self._ledger: Ledger | None = None
        self._saved_env: str | None = None
        self._final: LedgerState | None = None
        self._owner_pid: int | None = None  # the process that entered the block

    # -- the block ---------------------------------------------------------------------------

    def __enter__(self) -> SimulatedHost:
        if self._ledger is not None:
            raise RuntimeError("this SimulatedHost is already entered; make a new one")
        if self._final is not None:
            raise RuntimeError("this SimulatedHost has exited; make a new one")
        directory = tempfile.mkdtemp(prefix="gpupool-sim-")
        path = os.path.join(directory, "ledger.json")
        Ledger.create(path, self._initial_state())
        self._directory = directory
        self._ledger = ledger_at(path)
        self._saved_env = read_simulator_ledger()
        self._owner_pid = own_pid()
        os.environ[SIMULATOR_ENV] = path
        return self

    def __exit__(self, *exc: object) -> None:
        ledger, directory = self._ledger, self._directory
        if ledger is None or directory is None:
            return
        if own_pid() != self._owner_pid:
            # A forked child leaving the block: the host is its parent's, whose pools and
            # processes go on reading the ledger. Nothing is removed.
            self._ledger = self._directory = None
            return
        try:
            self._final = ledger.remove()
        finally:
            self._ledger = self._directory = None
            # Restore only what this host set: hosts exited out of order must
            # not leave the variable naming a ledger that is gone.
            _EXITED_LEDGERS.add(ledger.path)
            if read_simulator_ledger() == ledger.path:
                if self._saved_env is None or self._saved_env in _EXITED_LEDGERS:
                    os.environ.pop(SIMULATOR_ENV, None)
                else:
                    os.environ[SIMULATOR_ENV] = self._saved_env
            forget_ledger(ledger.path)
            shutil.rmtree(directory, ignore_errors=True)

    def _initial_state(self) -> LedgerState:
        devices: list[DeviceState] = []
        next_fake_pid = CO_TENANT_PID_BASE
        for index, device in enumerate(self._devices):
            tenants: dict[str, list[int]] = {}
            for name, nbytes in device.co_tenants.items():
                tenants[name] = [next_fake_pid, nbytes]
                next_fake_pid += 1
            devices.append(
                DeviceState(
                    uuid=simulated_uuid(index),
                    total=device.total_bytes,
                    unified=device.unified,
                    readable=device.readable,
                    tenants=tenants,
                    procs={},
                    peaks={},
                    peak=sum(device.co_tenants.values()),
                    trees={},
                    mig=device.mig,
                )
            )
        return LedgerState(
            version=LEDGER_VERSION,
            driver=self._driver,
            container=self._container,
            rows=self._rows,
            context=self._context_bytes,
            cpus=self._cpus,
            ram=self._host_ram_bytes,
            next_fake_pid=next_fake_pid,
            devices=devices,
            ooms=[],
        )

    # -- what the host is --------------------------------------------------------------------

    @property
    def devices(self) -> tuple[SimulatedDevice, ...]:
        """The cards as given (their co-tenants as at the start)."""
        return self._devices

    @property
    def ledger_path(self) -> str:
        """The ledger file, also in ``os.environ["GPUPOOL_SIMULATOR"]`` inside the block.

        Raises:
            RuntimeError: outside the block.
        """
        return self._live().path

    @property
    def bookings_directory(self) -> str:
        """The host's booking table directory (created by the first pool that books).

        Every pool inside the block, in any process, shares it, and never the
        real host's table.

        Raises:
            RuntimeError: outside the block.
        """
        return os.path.join(os.path.dirname(self._live().path), BOOKINGS_DIRECTORY)

    def device_uuid(self, device: int) -> str:
        """The UUID of ``device``, as children are pinned by (``CUDA_VISIBLE_DEVICES=<uuid>``)."""
        if not 0 <= device < len(self._devices):
            raise ValueError(f"the simulated host has {len(self._devices)} device(s); no {device}")
        return simulated_uuid(device)

    def sensor(self) -> SimulatedSensor:
        """A sensor that reads this host as NVML reads a card (what the pool uses inside the block).

        Raises:
            RuntimeError: outside the block.
        """
        return simulated_sensor(self._live().path)

    # -- co-tenants --------------------------------------------------------------------------

    def grow(
        self, name: str, size: int | float | str, device: int = 0, *, listed: bool = True
    ) -> None:
        """Add ``size`` to co-tenant ``name`` on ``device``, creating it if new.

        A negative size shrinks it (see :meth:`shrink`). Call it while a pool
        runs to simulate another process growing on the card. A co-tenant made
        with ``listed=False`` is in no row of the driver's list, only in the
        card's used bytes: managed memory, or a process the driver does not list.

        Raises:
            SimulatedOutOfMemory: the card cannot hold the growth; nothing is
                added and the event is recorded (the co-tenant ran out).
            RuntimeError: outside the block.
        """
        nbytes = _signed_size(size)
        if nbytes < 0:
            self.shrink(name, -nbytes, device)
            return
        refusal = self._live().grow_tenant(device, name, nbytes, listed=listed)
        if refusal is not None:
            raise SimulatedOutOfMemory._from_record(refusal)

    def shrink(self, name: str, size: int | float | str, device: int = 0) -> None:
        """Take ``size`` from co-tenant ``name`` on ``device`` (at 0 bytes it leaves the card).

        Raises:
            ValueError: no such co-tenant, or it holds less than ``size``.
            RuntimeError: outside the block.
        """
        self._live().shrink_tenant(device, name, parse_size(size, name="size"))

    # -- the truth, for assertions (also after the block) -------------------------------------

    def used(self, device: int) -> int:
        """The bytes in use on ``device`` now: co-tenants, contexts and held bytes."""
        return device_used_bytes(self._device_state(device))

    def device_peak(self, device: int) -> int:
        """The most bytes ever in use on ``device`` during the block."""
        return self._device_state(device)["peak"]

    def process_peak(self, pid: int, device: int | None = None) -> int:
        """The most bytes process ``pid`` ever held on ``device`` (its context included).

        Args:
            pid: a real process's PID (it may have exited since).
            device: the device; ``None``: the largest of its peaks on any device.

        Returns:
            The peak in bytes; 0 for a process that never allocated there.
        """
        state = self._state()
        devices = state["devices"] if device is None else [_index(state, device)]
        return max((dev["peaks"].get(str(pid), 0) for dev in devices), default=0)

    @property
    def out_of_memory_events(self) -> list[OutOfMemoryEvent]:
        """Every allocation a card refused, oldest first (a new list on each access)."""
        return [
            OutOfMemoryEvent(
                pid=record["pid"],
                device=record["device"],
                requested_bytes=record["requested_bytes"],
                used_bytes=record["used_bytes"],
                total_bytes=record["total_bytes"],
                time_s=record["time_s"],
            )
            for record in self._state()["ooms"]
        ]

    # -- internals ---------------------------------------------------------------------------

    def _live(self) -> Ledger:
        if self._ledger is None:
            raise RuntimeError(
                "this SimulatedHost is not entered: use it as `with SimulatedHost([...]) as host:`"
            )
        return self._ledger

    def _state(self) -> LedgerState:
        if self._ledger is not None:
            return self._ledger.snapshot()
        if self._final is not None:
            return self._final
        raise RuntimeError("this SimulatedHost was never entered; it has no figures yet")

    def _device_state(self, device: int) -> DeviceState:
        return _index(self._state(), device)

    def __repr__(self) -> str:
        where = self._ledger.path if self._ledger is not None else "not entered"
        return f"<SimulatedHost {len(self._devices)} device(s), {where}>"


def _index(state: LedgerState, device: int) -> DeviceState:
    devices = state["devices"]
    if not 0 <= device < len(devices):
        raise ValueError(f"the simulated host has {len(devices)} device(s); no device {device}")
    return devices[device]


def _signed_size(size: int | float | str) -> int:
    """Like ``parse_size``, but a leading minus sign is allowed (it means shrink)."""
    if isinstance(size, str) and size.strip().startswith("-"):
        return -parse_size(size.strip()[1:], name="size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size < 0:
        return -parse_size(-size, name="size")
    return parse_size(size, name="size")


# -- allocation in the code under test ------------------------------------------------------


class _Hold:
    """The context manager :func:`hold` returns; entering allocates, leaving releases."""

    __slots__ = ("_device", "_entered", "_ledger", "_nbytes", "_pid")

    def __init__(self, nbytes: int, device: int | None) -> None:
        self._nbytes = nbytes
        self._device = device
        self._ledger: Ledger | None = None
        self._entered: int | None = None
        self._pid = 0

    def __enter__(self) -> int:
        if self._entered is not None:
            raise RuntimeError("this hold() is already entered; call hold() again for another")
        path = read_simulator_ledger()
        if not path:
            raise RuntimeError(_NO_HOST)
        ledger = ledger_at(path)
        try:
            driver, uuids = ledger.layout()
            if not driver:
                raise RuntimeError(
                    "the simulated host has no driver (SimulatedHost(driver=False)): "
                    "no device can be allocated on"
                )
            device = _pinned_device(uuids) if self._device is None else self._device
            pid = os.getpid()
            refusal = ledger.allocate(device, pid, self._nbytes)
        except LedgerGoneError as error:
            raise RuntimeError(f"{_NO_HOST} ({error})") from None
        if refusal is not None:
            raise SimulatedOutOfMemory._from_record(refusal)
        self._ledger, self._entered, self._pid = ledger, device, pid
        return device

    def __exit__(self, *exc: object) -> None:
        ledger, device = self._ledger, self._entered
        self._ledger = self._entered = None
        if ledger is None or device is None:
            return
        # When the host has exited there is nothing left to give back to.
        with contextlib.suppress(LedgerGoneError):
            ledger.release(device, self._pid, self._nbytes)


def _pinned_device(uuids: tuple[str, ...]) -> int:
    """The device this process is pinned to by ``CUDA_VISIBLE_DEVICES``; 0 when unpinned."""
    visible = os.environ.get(SimulatedSensor.visible_devices_env)
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if first in uuids:
        return uuids.index(first)
    if first.isascii() and first.isdigit() and int(first) < len(uuids):
        return int(first)
    raise RuntimeError(
        f"CUDA_VISIBLE_DEVICES={visible!r} names no simulated device (they are "
        f"{', '.join(uuids) or 'none'}); pin a process with CUDA_VISIBLE_DEVICES=<uuid>, "
        "or pass hold(..., device=<index>)"
    )


def hold(size: int | float | str, device: int | None = None) -> _Hold:
    """Hold simulated device bytes for the duration of a ``with`` block, in this process.

    ``with hold("6GiB") as device:`` allocates on entry, gives the device's
    index, and releases on exit. The first allocation a process makes on a
    device also charges it the host's context size, which it keeps until it
    exits. When the process exits (or is killed), the host frees everything
    it held, as the driver does.

    Args:
        size: bytes or a size string (``"6GiB"``).
        device: the simulated host's device index (as NVML numbers it, not a
            CUDA ordinal); ``None``: the device this process is pinned to, the
            one whose UUID is ``CUDA_VISIBLE_DEVICES``, or device 0 when the
            variable is unset.

    Raises:
        SimulatedOutOfMemory: on entry, when the card cannot hold it; nothing
            is charged and the event is recorded.
        RuntimeError: on entry, outside a simulated host, or when
            ``CUDA_VISIBLE_DEVICES`` names no simulated device.
        InvalidSizeError: ``size`` could not be parsed.
    """
    return _Hold(parse_size(size, name="size"), device)
