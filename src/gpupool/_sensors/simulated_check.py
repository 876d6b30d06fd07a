"""Whether a parsed JSON value is a simulated host's ledger (part of the ledger).

A ledger is read from a file any process of the host may write, so every
field's type is checked once per content before the state is used
(:class:`~gpupool._sensors.simulated.Ledger` parses each new content once).
"""

from __future__ import annotations

from gpupool._sensors.simulated_state import ROWS_MODES, is_pid_key, tree_window_problem

__all__ = ["ledger_problem"]

_TOP_FIELDS: dict[str, tuple[type, ...]] = {
    "driver": (bool,),
    "container": (bool,),
    "context": (int,),
    "cpus": (int, type(None)),
    "ram": (int, type(None)),
    "next_fake_pid": (int,),
    "devices": (list,),
    "ooms": (list,),
}
_DEVICE_FIELDS: dict[str, tuple[type, ...]] = {
    "uuid": (str,),
    "total": (int,),
    "unified": (bool,),
    "readable": (bool,),
    "tenants": (dict,),
    "procs": (dict,),
    "peaks": (dict,),
    "peak": (int,),
    "trees": (dict,),
}
_PROC_FIELDS: dict[str, tuple[type, ...]] = {
    "start": (str,),
    "name": (str,),
    "context": (int,),
    "held": (int,),
    "window": (int,),
    "ancestors": (list,),
}


def _field_problem(
    value: dict[str, object], fields: dict[str, tuple[type, ...]], where: str
) -> str | None:
    for key, types in fields.items():
        if key not in value:
            return f"{where} has no {key!r}"
        if not isinstance(value[key], types) or (
            isinstance(value[key], bool) and bool not in types
        ):
            return f"{where}'s {key!r} is {value[key]!r}"
        number = value[key]
        if isinstance(number, int) and number < 0:  # every count and size is >= 0
            return f"{where}'s {key!r} is {number!r}"
    return None


def ledger_problem(value: dict[str, object]) -> str | None:
    """What makes ``value`` not a ledger, or ``None`` when every field has its type."""
    problem = _field_problem(value, _TOP_FIELDS, "the ledger")
    if problem is not None:
        return problem
    rows = value.get("rows", "listed")  # absent from ledgers written before the modes
    if rows not in ROWS_MODES:
        return f"the ledger's 'rows' is {rows!r:.40}"
    writes = value.get("writes", 0)  # the count of writes, absent before the first
    if type(writes) is not int or writes < 0:
        return f"the ledger's 'writes' is {writes!r}"
    devices = value["devices"]
    assert isinstance(devices, list)
    for index, dev in enumerate(devices):
        where = f"device {index}"
        if not isinstance(dev, dict):
            return f"{where} is {dev!r}"
        problem = _field_problem(dev, _DEVICE_FIELDS, where)
        if problem is not None:
            return problem
        for name, entry in dev["tenants"].items():
            if not (
                isinstance(entry, list)
                and len(entry) in (2, 3)  # a third: 1 for a co-tenant the driver does not list
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry)
            ):
                return f"{where}'s co-tenant {name!r} is {entry!r}"
        for key, proc in dev["procs"].items():
            if not is_pid_key(key) or not isinstance(proc, dict):
                return f"{where}'s process {key!r} is {proc!r}"
            problem = _field_problem(proc, _PROC_FIELDS, f"{where}'s process {key}")
            if problem is not None:
                return problem
        for key, peak in dev["peaks"].items():
            if not is_pid_key(key) or type(peak) is not int or peak < 0:
                return f"{where}'s peak of {key!r} is {peak!r}"
        for root, window in dev["trees"].items():
            problem = tree_window_problem(root, window)
            if problem is not None:
                return f"{where}'s {problem}"
    ooms = value["ooms"]
    assert isinstance(ooms, list)
    for record in ooms:
        if not isinstance(record, dict):
            return f"an out-of-memory record is {record!r}"
    return None
