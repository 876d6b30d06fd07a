"""A sensor's readings (gpupool.DeviceInfo, MemoryReading, ProcessReading) behave as frozen
records: built by keyword, equal by value, hashable, immutable, pickled and printed by their
public path, matched by field, and turned into JSON by field name."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import sys
import types
import typing
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool import DeviceInfo, MemoryReading, ProcessReading
from gpupool._integration import jsonable

sizes = st.integers(min_value=0, max_value=2**50)
maybe = st.none() | sizes
names = st.text(max_size=12)

readings = st.one_of(
    st.builds(
        DeviceInfo,
        index=st.integers(0, 64),
        uuid=names,
        name=names,
        mig=st.booleans(),
        mig_index=st.none() | st.integers(0, 7),
        parent_uuid=st.none() | names,
        error=st.none() | names,
    ),
    st.builds(
        MemoryReading,
        total_bytes=sizes,
        free_bytes=sizes,
        used_bytes=sizes,
        reserved_bytes=maybe,
        unified=st.booleans(),
        source=names,
    ),
    st.builds(ProcessReading, pid=st.integers(1, 2**22), used_bytes=maybe, name=st.none() | names),
)


def _fields(reading: Any) -> dict[str, Any]:
    return {name: getattr(reading, name) for name in type(reading).__match_args__}


@given(readings)
def test_a_reading_is_a_value(reading: Any) -> None:
    """Equal to a copy, a deep copy, a pickle's round trip and a rebuild from its fields
    (and so hashed alike); printed as it is built; its JSON names each field."""
    rebuilt = type(reading)(**_fields(reading))
    for twin in (
        rebuilt,
        copy.copy(reading),
        copy.deepcopy(reading),
        pickle.loads(pickle.dumps(reading)),
    ):
        assert twin == reading
        assert hash(twin) == hash(reading)
    assert eval(repr(reading), {type(reading).__name__: type(reading)}) == reading
    assert reading.replace() == reading
    assert reading.replace(**_fields(rebuilt)) == reading
    assert json.loads(json.dumps(jsonable(reading))) == _fields(reading)


def test_readings_are_frozen_built_by_keyword_and_named_by_their_public_path() -> None:
    reading = ProcessReading(pid=7, used_bytes=None)
    with pytest.raises(AttributeError, match="ProcessReading is frozen: cannot assign to 'pid'"):
        reading.pid = 8  # type: ignore[misc]
    with pytest.raises(AttributeError, match="frozen"):
        del reading.name  # type: ignore[misc]
    with pytest.raises(AttributeError):
        reading.other = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        ProcessReading(7, None)  # type: ignore[call-arg]
    assert reading != (7, None, None)
    assert reading != ProcessReading(pid=7, used_bytes=0)
    assert b"gpupool\x94\x8c\x0eProcessReading" in pickle.dumps(reading, protocol=4)
    match MemoryReading(
        total_bytes=8, free_bytes=3, used_bytes=5, reserved_bytes=None, unified=False, source="x"
    ):
        case MemoryReading(total, free):
            assert (total, free) == (8, 3)


def test_replace_changes_the_fields_named_and_refuses_others() -> None:
    card = DeviceInfo(index=0, uuid="GPU-a", name="card")
    instance = card.replace(uuid="MIG-b", mig=True, mig_index=1, parent_uuid=card.uuid)
    assert instance == DeviceInfo(
        index=0, uuid="MIG-b", name="card", mig=True, mig_index=1, parent_uuid="GPU-a"
    )
    assert card.uuid == "GPU-a"  # the original is unchanged
    with pytest.raises(TypeError, match="DeviceInfo has no field colour"):
        card.replace(colour="red")
    if hasattr(copy, "replace"):  # Python 3.13's protocol
        assert copy.replace(card, name="other") == card.replace(name="other")


@pytest.mark.parametrize("cls", [DeviceInfo, MemoryReading, ProcessReading])
def test_the_type_hints_of_a_readings_methods_resolve(cls: type[Any]) -> None:
    """typing.get_type_hints (what a validator or a documentation tool asks of a method)
    resolves ``replace``: its type variable exists at run time, bound to the record class
    itself rather than to its name (a string bound is compiled as the variable is made)."""
    for method in (cls.replace, cls.__replace__):
        hints = typing.get_type_hints(method)
        assert hints["return"] is hints["self"]
        assert hints["self"].__bound__ is cls.__mro__[1]
        assert issubclass(cls, hints["self"].__bound__)


class _SlottedUsage(MemoryReading):
    """A user's own kind of reading, kept slotted as its base is."""

    __slots__ = ()

    def free_fraction(self) -> float:
        return self.free_bytes / self.total_bytes


def test_a_slotted_subclass_keeps_its_base_fields() -> None:
    """A subclass declaring ``__slots__ = ()`` compares, hashes, prints, pickles and turns
    into JSON by its base's fields (as when the readings were slotted dataclasses)."""
    fields = {
        "total_bytes": 8,
        "free_bytes": 2,
        "used_bytes": 6,
        "reserved_bytes": None,
        "unified": False,
        "source": "x",
    }
    usage = _SlottedUsage(**fields)
    other = _SlottedUsage(**{**fields, "free_bytes": 3})
    assert usage != other
    assert hash(usage) != hash(other) or usage._asdict() != other._asdict()
    assert repr(usage).endswith(
        "_SlottedUsage(total_bytes=8, free_bytes=2, used_bytes=6, reserved_bytes=None, "
        "unified=False, source='x')"
    )
    twin = pickle.loads(pickle.dumps(usage))
    assert twin == usage
    assert twin.free_fraction() == 0.25
    assert copy.deepcopy(usage) == usage
    assert usage.replace(free_bytes=3) == other
    assert jsonable(usage) == fields


def _pickled_as_dataclass(**fields: Any) -> bytes:
    """A pickle of a plain frozen dataclass named ``gpupool.ProcessReading`` with
    ``fields`` (its state is its ``__dict__``)."""
    fake = types.ModuleType("gpupool")
    made = dataclasses.make_dataclass(
        "ProcessReading", list(fields), frozen=True, kw_only=True, namespace={}
    )
    made.__module__ = "gpupool"
    fake.ProcessReading = made  # type: ignore[attr-defined]
    real = sys.modules["gpupool"]
    sys.modules["gpupool"] = fake
    try:
        return pickle.dumps(made(**fields))
    finally:
        sys.modules["gpupool"] = real


def test_a_pickle_of_a_dataclass_by_the_same_path_loads_by_field_name() -> None:
    """A pickle made where the public path named a plain frozen dataclass loads with each
    field's value, never the fields' names; one that lacks a field is refused."""
    loaded = pickle.loads(_pickled_as_dataclass(pid=7, used_bytes=5, name="python"))
    assert type(loaded) is ProcessReading
    assert loaded == ProcessReading(pid=7, used_bytes=5, name="python")
    with pytest.raises(KeyError, match="name"):
        pickle.loads(_pickled_as_dataclass(pid=7, used_bytes=5, other=None))
