"""The simulator's ledger state: its layout, and what is computed from it (part of the ledger).

Functions of a parsed ledger (:class:`LedgerState`), with no I/O (:func:`refuse`
stamps the refusal it records with the time), used by
:class:`~gpupool._sensors.simulated.Ledger` under its lock and by
:class:`~gpupool._sensors.simulated_sensor.SimulatedSensor` to read a card.

A task's bytes may live in processes it starts. Every process's entry keeps its
ancestors as they were at its first allocation, so a tree is known even after a
middle process exits. A *tree window* (one per root PID and device, opened by
:meth:`~gpupool._sensors.simulated.Ledger.open_tree`) keeps the most bytes the root
and its descendants held together since it opened, updated under the ledger's lock
at every allocation: exact, as a driver's accounting would be, with no sampling.
"""

# No postponed annotations here: a typed dict's string annotations are compiled as it is made,
# which every process that reads the simulated ledger (a worker's sensor too) would pay.

import json
import time
from typing import TypedDict, cast

from gpupool._errors import DeviceUnreadableError
from gpupool._sensors.base import DeviceInfo, MemoryReading, ProcessReading

__all__ = [
    "SIMULATOR_ENV",
    "WRITES_FIELD",
    "DeviceState",
    "LedgerState",
    "OutOfMemoryRecord",
    "ProcessState",
    "Snapshot",
    "device_of",
    "device_used_bytes",
    "drop_dead",
    "encode_next",
    "is_pid_key",
    "memory_of",
    "named_processes",
    "note_peaks",
    "process_bytes",
    "refuse",
    "rows_of",
    "tree_bytes",
    "tree_window_problem",
]


class ProcessState(TypedDict):
    """A real process's charge on one device, as the ledger keeps it."""

    start: str  # identity token: start time, so a reused PID is not mistaken for us
    name: str
    context: int  # the one-off context charge, kept until the process dies
    held: int  # bytes held by open ``hold()`` blocks
    window: int  # high-water since the last reset_process_peak
    ancestors: list[int]  # parent, grandparent... at the first touch (tree windows)


class TreeWindow(TypedDict):
    """One open tree window: its root's identity and the tree's high-water since it opened."""

    start: str  # the root's start token: a reused PID is not the root
    window: int


class DeviceState(TypedDict):
    """One simulated device in the ledger."""

    uuid: str
    total: int
    unified: bool
    readable: bool
    tenants: dict[str, list[int]]  # name -> [fake pid, bytes] (+ [1]: not listed in the rows)
    procs: dict[str, ProcessState]  # str(pid) -> charge
    peaks: dict[str, int]  # str(pid) -> lifetime high-water (kept after death)
    peak: int  # the device's high-water of used bytes over the run
    trees: dict[str, TreeWindow]  # str(root pid) -> its tree's high-water window
    mig: bool  # a MIG instance (absent from older ledgers: not one)


class _RefusalFields(TypedDict):
    pid: int
    device: int
    requested_bytes: int
    used_bytes: int
    total_bytes: int
    time_s: float


class OutOfMemoryRecord(_RefusalFields, total=False):
    """An allocation the simulated card refused (fields as ``OutOfMemoryEvent``), with the
    asking process's ancestors where it is a real process (so its tree is known after it
    exits)."""

    ancestors: list[int]


class LedgerState(TypedDict):
    """The whole ledger: the host's options, its devices, and every refusal."""

    version: int
    driver: bool
    container: bool
    rows: str
    context: int
    cpus: int | None
    ram: int | None
    next_fake_pid: int
    devices: list[DeviceState]
    ooms: list[OutOfMemoryRecord]


#: Set by :class:`gpupool.testing.SimulatedHost` to its ledger's path, for the
#: processes started inside its block (a pool's workers get it from the
#: simulator's sensor, :meth:`SimulatedSensor.worker_env`).
SIMULATOR_ENV = "GPUPOOL_SIMULATOR"

#: One device's memory and rows, as :meth:`SimulatedSensor.read_snapshot` gives them.
Snapshot = tuple[MemoryReading, "tuple[ProcessReading, ...] | None"]


#: The ledger's count of writes, its first field (absent from a ledger never written to).
WRITES_FIELD = "writes"


def encode_next(state: LedgerState) -> bytes:
    """``state``'s text for the next write: its count of writes one higher (set in ``state``
    too), written first, so that no two writes ever give the file the same bytes."""
    fields = cast("dict[str, object]", state)
    count = fields.get(WRITES_FIELD, 0)
    fields[WRITES_FIELD] = (count if type(count) is int else 0) + 1
    return json.dumps({WRITES_FIELD: 0, **fields}, separators=(",", ":")).encode()


def device_used_bytes(device: DeviceState) -> int:
    """Everything on the card now: co-tenants, plus every process's context and held bytes."""
    used = sum(entry[1] for entry in device["tenants"].values())
    for proc in device["procs"].values():
        used += proc["context"] + proc["held"]
    return used


def process_bytes(proc: ProcessState) -> int:
    return proc["context"] + proc["held"]


def device_of(state: LedgerState, index: int) -> DeviceState:
    devices = state["devices"]
    if not 0 <= index < len(devices):
        raise ValueError(
            f"the simulated host has {len(devices)} device(s); there is no device {index}"
        )
    return devices[index]


def refuse(state: LedgerState, device: int, pid: int, nbytes: int) -> OutOfMemoryRecord | None:
    """The refusal of ``nbytes`` more on ``device`` (recorded), or ``None`` if it fits."""
    dev = state["devices"][device]
    used = device_used_bytes(dev)
    if used + nbytes <= dev["total"]:
        return None
    record = OutOfMemoryRecord(
        pid=pid,
        device=device,
        requested_bytes=nbytes,
        used_bytes=used,
        total_bytes=dev["total"],
        time_s=time.time(),
    )
    state["ooms"].append(record)
    return record


def note_peaks(dev: DeviceState, key: str, proc: ProcessState) -> None:
    now = process_bytes(proc)
    proc["window"] = max(proc["window"], now)
    dev["peaks"][key] = max(dev["peaks"].get(key, 0), now)
    dev["peak"] = max(dev["peak"], device_used_bytes(dev))
    note_trees(dev, key, proc)


def named_processes(state: LedgerState) -> set[tuple[int, str]]:
    """Every process the ledger names, with its start token: processes and tree roots."""
    named: set[tuple[int, str]] = set()
    for dev in state["devices"]:
        named.update((int(key), proc["start"]) for key, proc in dev["procs"].items())
        named.update((int(root), window["start"]) for root, window in dev["trees"].items())
    return named


def drop_dead(state: LedgerState, dead: set[tuple[int, str]]) -> bool:
    """Drop the processes and tree windows of ``dead`` (exited, or their PID reused);
    whether any was dropped."""
    if not dead:
        return False
    dropped = False
    for dev in state["devices"]:
        procs, trees = dev["procs"], dev["trees"]
        for key in [key for key, proc in procs.items() if (int(key), proc["start"]) in dead]:
            del procs[key]
            dropped = True
        for root in [
            root for root, window in trees.items() if (int(root), window["start"]) in dead
        ]:
            del trees[root]
            dropped = True
    return dropped


def memory_of(device: DeviceInfo, dev: DeviceState) -> MemoryReading:
    if not dev["readable"]:
        raise DeviceUnreadableError(
            f"simulated device {device.index} is unreadable (SimulatedDevice(readable=False))"
        )
    used = device_used_bytes(dev)
    return MemoryReading(
        total_bytes=dev["total"],
        free_bytes=dev["total"] - used,
        used_bytes=used,
        reserved_bytes=None,
        unified=dev["unified"],
        source="meminfo" if dev["unified"] else "simulator",
    )


#: How the simulated driver lists this host's processes (``SimulatedHost(rows=...)``):
#: with their bytes; not at all under any PID this host knows (a container: a real
#: driver lists them under the host's PIDs); with 0 bytes (drivers 535.113 to 560 in a
#: container); or without a figure (MIG's "not available").
ROWS_MODES = ("listed", "hidden", "zero", "unavailable")


def rows_of(state: LedgerState, dev: DeviceState) -> tuple[ProcessReading, ...] | None:
    if not dev["readable"]:
        return None
    rows = [
        ProcessReading(pid=entry[0], used_bytes=entry[1], name=name)
        for name, entry in dev["tenants"].items()
        if entry[1] > 0 and entry[2:] != [1]
    ]
    mode = "unavailable" if is_mig(dev) else rows_mode(state)
    if mode != "hidden":
        rows.extend(
            ProcessReading(
                pid=int(key),
                used_bytes={"listed": process_bytes(proc), "zero": 0}.get(mode),
                name=proc["name"],
            )
            for key, proc in dev["procs"].items()
        )
    return tuple(rows)


def is_mig(dev: DeviceState) -> bool:
    """Whether ``dev`` is a MIG instance (``SimulatedDevice(mig=True)``)."""
    return cast("dict[str, object]", dev).get("mig") is True


def rows_mode(state: LedgerState) -> str:
    """How the driver lists this host's processes (:data:`ROWS_MODES`)."""
    if state["container"]:
        return "hidden"
    mode = cast("dict[str, object]", state).get("rows", "listed")  # absent: an older ledger
    return mode if isinstance(mode, str) else "listed"


def _in_tree(key: str, proc: ProcessState, root: str) -> bool:
    return key == root or int(root) in proc["ancestors"]


def tree_bytes(dev: DeviceState, root: str) -> int:
    """What ``root`` and every process under it hold on ``dev`` now."""
    return sum(process_bytes(p) for key, p in dev["procs"].items() if _in_tree(key, p, root))


def note_trees(dev: DeviceState, key: str, proc: ProcessState) -> None:
    """After process ``key`` allocated: raise the window of every tree it belongs to."""
    for root, window in dev["trees"].items():
        if _in_tree(key, proc, root):
            window["window"] = max(window["window"], tree_bytes(dev, root))


def is_pid_key(key: object) -> bool:
    """Whether ``key`` is a PID as the ledger writes one: ASCII decimal digits, no leading 0
    (``str.isdigit`` alone takes a superscript "2", which ``int`` refuses, and other scripts'
    digits, which ``int`` reads as another spelling of a PID)."""
    return (
        isinstance(key, str)
        and key.isascii()
        and key.isdigit()
        and (key == "0" or not key.startswith("0"))
    )


def tree_window_problem(root: object, window: object) -> str | None:
    """What makes ``window`` not a tree window, or ``None``."""
    if not is_pid_key(root) or not isinstance(window, dict):
        return f"tree window {root!r} is {window!r}"
    size = window.get("window")
    if not isinstance(window.get("start"), str) or type(size) is not int or size < 0:
        return f"tree window {root!r} is {window!r}"
    return None
