"""A ``pynvml`` double fed by a simulated host: :class:`FakePynvml` whose cards are the ledger's.

``bench/gpu_check.py --dry-run`` runs the pool's workers through the real NVML
sensor (:class:`gpupool._sensors.nvml.NvmlSensor`, the tree sensor and the probe's
sampled path) over this double instead of the simulator's exact ledger, so that a
defect in the sensor code can make the dry run fail. It is :class:`FakePynvml`
(held to the installed ``nvidia-ml-py`` by ``test_fake_pynvml_fidelity.py``) with one
difference: before each call on a device handle, that card's total, free bytes and
compute-process rows are read again from the simulated host named by
``GPUPOOL_SIMULATOR``, through the simulator's own reading of its ledger
(:meth:`~gpupool._sensors.simulated_sensor.SimulatedSensor.read_snapshot`). So the
rows follow ``SimulatedHost(rows=...)`` as a driver's would: listed with their bytes,
hidden (a container), 0 bytes (drivers 535.113 to 560), or without a figure; a
``SimulatedDevice(mig=True)`` is a MIG instance of a MIG-enabled parent card, its rows
without a figure; an unreadable device answers every memory and process call with
``NVML_ERROR_UNKNOWN``. Accounting stays off, as on most cards. Unified devices are
not modelled (NVML reads those from ``/proc/meminfo``).

``nvml_double/pynvml.py`` installs one as the module ``pynvml``: put that directory
(and this one) first on ``PYTHONPATH``. Without ``GPUPOOL_SIMULATOR``, ``nvmlInit``
raises ``NVMLError_DriverNotLoaded``, as on a host without a driver.
"""

from __future__ import annotations

import collections
import os
from typing import Any

from fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_UNKNOWN,
    FakeCard,
    FakePynvml,
    NVMLError,
)

#: The variable a simulated host's processes find its ledger by (gpupool's own name).
SIMULATOR_ENV = "GPUPOOL_SIMULATOR"
#: The memory and process calls an unreadable simulated device fails.
_UNREADABLE_CALLS = (
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
)


def parent_uuid_of(uuid: str) -> str:
    """The UUID the double gives the parent card of a simulated MIG instance ``uuid``."""
    return f"{uuid}-mig-parent"


class SimulatedPynvml(FakePynvml):
    """:class:`FakePynvml` over the simulated host at ``$GPUPOOL_SIMULATOR``, read at each call.

    The host is looked up again at each call, so a ``SimulatedHost`` entered inside
    another (a dry run's step on a card with hidden rows) is read while it lasts.
    """

    def __init__(self) -> None:
        super().__init__(cards=[])
        # FakePynvml keeps every call for tests; a worker samples for minutes: keep the last.
        self.calls = collections.deque(maxlen=256)  # type: ignore[assignment]
        self._path: str | None = None
        self._sensor: Any = None
        self._by_uuid: dict[str, FakeCard] = {}

    # -- the simulated host --

    def _host(self) -> Any:
        """The simulator's sensor of the host named now (the layout rebuilt when it changed)."""
        path = os.environ.get(SIMULATOR_ENV)
        if not path:
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
        if path != self._path:
            from gpupool._sensors.simulated_sensor import SimulatedSensor

            self._sensor, self._path = SimulatedSensor(path), path
            self._lay_out()
        return self._sensor

    def _lay_out(self) -> None:
        """One card per simulated device; a MIG device is the one instance of a parent card."""
        from gpupool._sensors.simulated_state import device_of

        state = self._sensor._view()
        cards: list[FakeCard] = []
        by_uuid: dict[str, FakeCard] = {}
        for index, info in enumerate(self._sensor.read_devices()):
            if device_of(state, index)["unified"]:
                raise ValueError(
                    f"simulated device {index} is unified memory, which the NVML double does "
                    "not model (NVML reads it from /proc/meminfo): use a discrete device"
                )
            card = FakeCard(uuid=info.uuid, name=info.name, reserved=0, mig_capable=info.mig)
            by_uuid[info.uuid] = card
            if info.mig:
                parent = parent_uuid_of(info.uuid)
                cards.append(FakeCard(uuid=parent, name=info.name, mig_slots=[card]))
            else:
                cards.append(card)
        self.cards, self._by_uuid = cards, by_uuid

    def _refresh(self, card: FakeCard) -> None:
        """``card``'s total, free bytes and rows as the simulated host has them now."""
        sensor = self._host()
        fresh = self._by_uuid.get(card.uuid)
        if fresh is None:
            if any(c.uuid == card.uuid for c in self.cards):
                return  # a MIG instance's parent card: nothing of its own is read
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)  # a card of a host that has exited
        info = next(d for d in sensor.read_devices() if d.uuid == card.uuid)
        from gpupool._errors import DeviceUnreadableError

        try:
            memory, rows = sensor.read_snapshot(info)
        except DeviceUnreadableError:
            card.errors = dict.fromkeys(_UNREADABLE_CALLS, NVML_ERROR_UNKNOWN)
            return
        card.errors = {}
        card.total, card.free = memory.total_bytes, memory.free_bytes
        card.compute = [(row.pid, row.used_bytes) for row in rows or ()]

    # -- FakePynvml's hooks --

    def nvmlInit(self) -> None:
        self._host()  # no simulated host: no driver
        super().nvmlInit()

    def nvmlDeviceGetCount(self) -> int:
        self._host()
        return super().nvmlDeviceGetCount()

    def _check(self, handle: Any, function: str) -> None:
        super()._check(handle, function)
        if handle is not None:
            self._refresh(handle.card)
