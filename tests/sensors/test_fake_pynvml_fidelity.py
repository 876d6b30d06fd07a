"""The fake pynvml is held to the installed nvidia-ml-py: same names, signatures, values, fields."""

from __future__ import annotations

import ctypes
import inspect

import pytest
from fake_pynvml import FAKE_ONLY, FakePynvml, h100

real = pytest.importorskip("pynvml", reason="nvidia-ml-py (a gpupool dependency) is not installed")


def _public(fake: FakePynvml) -> dict[str, object]:
    # A module's dir() lists its __dict__ only: the functions are the class's.
    names = {name for name in [*vars(fake), *vars(type(fake))] if not name.startswith("_")}
    names -= FAKE_ONLY
    return {name: getattr(fake, name) for name in sorted(names)}


def test_every_name_the_fake_defines_exists_in_the_real_binding() -> None:
    """Each function, constant, struct and error class of the fake is in nvidia-ml-py."""
    missing = [name for name in _public(FakePynvml([h100(0)])) if not hasattr(real, name)]
    assert missing == []


def test_functions_have_the_real_signatures() -> None:
    """Every fake function takes the real function's parameters (names, kinds, defaults)."""
    functions = {n: v for n, v in _public(FakePynvml([h100(0)])).items() if inspect.ismethod(v)}
    assert len(functions) >= 20  # every nvml* function of the fake is compared
    for name, value in functions.items():
        if inspect.ismethod(value):
            fake_sig = inspect.signature(value)
            real_sig = inspect.signature(getattr(real, name))
            assert [(p.name, p.kind, p.default) for p in fake_sig.parameters.values()] == [
                (p.name, p.kind, p.default) for p in real_sig.parameters.values()
            ], name


def test_constants_have_the_real_values() -> None:
    """NVML_* constants and nvmlMemory_v2 equal the binding's."""
    for name, value in _public(FakePynvml([h100(0)])).items():
        if isinstance(value, int) and not isinstance(value, bool):
            assert getattr(real, name) == value, name


def test_structs_have_the_real_fields() -> None:
    """Each fake ctypes struct has the real struct's field names, in order, and types."""
    for name, value in _public(FakePynvml([h100(0)])).items():
        if isinstance(value, type) and issubclass(value, ctypes.Structure):
            real_fields = [(f[0], ctypes.sizeof(f[1])) for f in getattr(real, name)._fields_]
            fake_fields = [(f[0], ctypes.sizeof(f[1])) for f in value._fields_]
            assert fake_fields == real_fields, name


def test_error_classes_map_codes_as_the_real_ones_do() -> None:
    """NVMLError(code) builds the same-named subclass in both, with the same message."""
    fake = FakePynvml([h100(0)])
    for name, value in _public(fake).items():
        if isinstance(value, type) and issubclass(value, fake.NVMLError) and name != "NVMLError":
            code = next(c for c, cls in fake.NVMLError._value_class.items() if cls is value)
            real_error = real.NVMLError(code)
            fake_error = fake.NVMLError(code)
            assert type(real_error).__name__ == type(fake_error).__name__ == name
            assert str(fake_error) == real.NVMLError._errcode_to_string.get(code, str(real_error))


def test_process_rows_have_the_real_fields() -> None:
    """A fake process row has exactly the fields of the binding's process-info struct."""
    fake = FakePynvml([h100(0, compute=[(1, 5), (2, None)])])
    fake.nvmlInit()
    rows = fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
    fields = [f[0] for f in real.c_nvmlProcessInfo_v2_t._fields_]
    assert [sorted(vars(row)) for row in rows] == [sorted(fields)] * 2
    assert rows[1].usedGpuMemory is None


def test_accounting_not_available_raises_what_the_binding_raises() -> None:
    """The binding's None into a c_ulonglong field raises TypeError; so does the fake's."""
    with pytest.raises(TypeError):
        real.c_nvmlAccountingStats_t().maxMemoryUsage = None
    fake = FakePynvml([h100(0, accounting={7: None})])
    fake.nvmlInit()
    with pytest.raises(TypeError):
        fake.nvmlDeviceGetAccountingStats(fake.nvmlDeviceGetHandleByIndex(0), 7)
