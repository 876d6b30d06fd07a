"""CUDA's visible devices and worker pinning, the defaults of every sensor (I/O edge).

NVML and the simulator (whose cards are simulated NVIDIA cards) speak CUDA through
:class:`~gpupool._sensors.base.Sensor`'s defaults; another vendor's sensor overrides
them. NVML orders cards by PCI bus and ignores ``CUDA_VISIBLE_DEVICES``; CUDA numbers
them "fastest first" unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. So a worker is pinned
by UUID, in PCI bus order, never by an index (:func:`pin_env`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpupool._errors import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpupool._sensors.readings import DeviceInfo

__all__ = [
    "DEVICE_ORDER_ENV",
    "VISIBLE_DEVICES_ENV",
    "count_cards",
    "match_entry",
    "parse_visible_devices",
    "pin_env",
]

#: The variable that hides devices from a CUDA process; a parent's narrows the pool's cards.
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

#: How CUDA numbers the cards its index entries name (``PCI_BUS_ID``: NVML's order).
DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"

#: Values of CUDA_VISIBLE_DEVICES that hide every device.
_HIDE_ALL = frozenset({"", "-1", "nodevfiles"})


def parse_visible_devices(
    value: str | None, listed: Sequence[DeviceInfo], *, device_order: str | None = None
) -> tuple[tuple[DeviceInfo, ...], str | None]:
    """Narrow ``listed`` to what a ``CUDA_VISIBLE_DEVICES`` value lets CUDA see.

    Entries are NVML indexes, ``GPU-`` UUIDs or ``MIG-`` UUIDs, each
    possibly a unique prefix. An index, or the ``GPU-`` UUID of a
    MIG-enabled card, selects that card's MIG instances. As in CUDA, the
    first entry that matches nothing (or several cards) hides itself and
    every entry after it.

    An index is CUDA's index, which is NVML's (PCI bus) order only with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; CUDA's default order is "fastest
    first". Where the two orders can differ (the cards are not all the same
    model), index entries without ``PCI_BUS_ID`` are refused, never guessed.

    Args:
        value: the variable's value; ``None`` (unset) leaves every device.
        listed: the devices the driver lists.
        device_order: the value of ``CUDA_DEVICE_ORDER`` (``None``: unset).

    Returns:
        The visible devices in the variable's order, and a note for the
        census' reason when some entry was ignored or everything is hidden.

    Raises:
        ConfigurationError: index entries, ``CUDA_DEVICE_ORDER`` other than
            ``PCI_BUS_ID``, and cards of more than one model.
    """
    if value is None:
        return tuple(listed), None
    stripped = value.strip()
    if stripped.lower() in _HIDE_ALL:
        return (), f"CUDA_VISIBLE_DEVICES={value!r} hides every device"
    _check_index_order(value, listed, device_order)
    chosen: list[DeviceInfo] = []
    for raw in stripped.split(","):
        entry = raw.strip()
        matches = match_entry(entry, listed)
        if len(matches) == 0 or (
            not (entry.isascii() and entry.isdigit()) and count_cards(matches) > 1
        ):
            why = "matches no device" if not matches else "is ambiguous"
            note = (
                f"CUDA_VISIBLE_DEVICES entry {entry!r} {why}; like CUDA, gpupool ignores it "
                "and every entry after it"
            )
            return tuple(chosen), note
        for info in matches:
            if info not in chosen:
                chosen.append(info)
    if not chosen:
        return (), f"CUDA_VISIBLE_DEVICES={value!r} hides every device"
    return tuple(chosen), None


def _check_index_order(value: str, listed: Sequence[DeviceInfo], device_order: str | None) -> None:
    """Refuse index entries whose meaning depends on an order CUDA may not share with NVML."""
    if (device_order or "").strip().upper() == "PCI_BUS_ID":
        return
    entries = [raw.strip() for raw in value.split(",")]
    if not any(entry.isascii() and entry.isdigit() for entry in entries):
        return
    models: dict[int, str] = {}
    for info in listed:
        if info.error is None:  # a card that cannot be read has no model to compare
            models.setdefault(info.index, info.name)
    if len(set(models.values())) <= 1:
        return  # one model: fastest first is PCI bus order
    cards = ", ".join(f"{index}: {name}" for index, name in sorted(models.items()))
    raise ConfigurationError(
        f"CUDA_VISIBLE_DEVICES={value!r} names cards by index, but CUDA_DEVICE_ORDER is "
        f"{device_order!r} (CUDA's default numbers cards fastest first) and this host has "
        f"cards of different models ({cards}), so CUDA's card numbers may not be NVML's. "
        "Set CUDA_DEVICE_ORDER=PCI_BUS_ID, or name the cards by UUID "
        "(CUDA_VISIBLE_DEVICES=GPU-...; `nvidia-smi -L` lists them)."
    )


def count_cards(matches: Sequence[DeviceInfo]) -> int:
    """How many physical cards ``matches`` covers (a card's MIG instances are one card)."""
    return len({info.parent_uuid or info.uuid or f"index {info.index}" for info in matches})


def match_entry(entry: str, listed: Sequence[DeviceInfo]) -> list[DeviceInfo]:
    """The devices one entry names: an NVML index, or a ``GPU-``/``MIG-`` UUID or its prefix."""
    if entry.isascii() and entry.isdigit():
        return [info for info in listed if info.index == int(entry)]
    lowered = entry.lower()
    if lowered.startswith(("gpu-", "mig-")):
        exact = [
            info
            for info in listed
            if lowered in (info.uuid.lower(), (info.parent_uuid or "").lower())
        ]
        if exact:
            return exact
        return [
            info
            for info in listed
            if (info.uuid and info.uuid.lower().startswith(lowered))
            or (info.parent_uuid or "").lower().startswith(lowered)
        ]
    return []


def pin_env(device: DeviceInfo) -> dict[str, str]:
    """The variables that pin a worker to ``device``: its UUID, in PCI bus order."""
    return {VISIBLE_DEVICES_ENV: device.uuid, DEVICE_ORDER_ENV: "PCI_BUS_ID"}
