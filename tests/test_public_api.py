"""The public surface: a cheap import, a sorted ``__all__``, and every name in it resolving."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpupool

#: Heavy or driver-touching modules that ``import gpupool`` must not load:
#: the pool (loky), the sensors (pynvml, psutil) and any framework (torch)
#: load on first use only.
HEAVY = ("pynvml", "loky", "torch", "psutil")


def _modules_after(statement: str) -> set[str]:
    """The heavy modules present in a fresh interpreter after running ``statement``."""
    script = (
        "import json, sys\n"
        f"{statement}\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return set(json.loads(completed.stdout.strip().splitlines()[-1]))


def test_import_gpupool_loads_no_heavy_module() -> None:
    """``import gpupool`` in a fresh interpreter loads none of pynvml, loky, torch, psutil."""
    assert _modules_after("import gpupool") == set()


def test_the_fresh_interpreter_check_can_see_a_heavy_module() -> None:
    """The subprocess check is not vacuous: an import of a heavy module is seen."""
    assert "psutil" in _modules_after("import gpupool, psutil")


def test_all_is_sorted_and_unique() -> None:
    """``gpupool.__all__`` is sorted and names each export once."""
    assert list(gpupool.__all__) == sorted(gpupool.__all__)
    assert len(set(gpupool.__all__)) == len(gpupool.__all__)


@pytest.mark.parametrize("name", gpupool.__all__)
def test_every_public_name_resolves(name: str) -> None:
    """Each name in ``__all__`` is an attribute of gpupool (lazy names load on first use)."""
    assert getattr(gpupool, name) is not None


def test_dir_lists_the_public_names() -> None:
    """``dir(gpupool)`` offers the public names, lazy ones included, for completion."""
    assert set(gpupool.__all__) <= set(dir(gpupool))


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    """A misspelt name raises AttributeError naming it, not an import of something else."""
    with pytest.raises(AttributeError, match=r"^module 'gpupool' has no attribute 'GpuPool'$"):
        _ = gpupool.GpuPool  # type: ignore[attr-defined]


def test_public_errors_keep_the_standard_library_contracts() -> None:
    """Configuration errors are ValueErrors; a lost worker is a BrokenProcessPool."""
    from concurrent.futures.process import BrokenProcessPool

    assert issubclass(gpupool.InvalidSizeError, gpupool.ConfigurationError)
    assert issubclass(gpupool.ConfigurationError, ValueError)
    assert issubclass(gpupool.WidthError, RuntimeError)
    assert issubclass(gpupool.WorkerLostError, BrokenProcessPool)
    for name in gpupool.__all__:
        value = getattr(gpupool, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, gpupool.GpuPoolError), name


RECORDS = (
    "Ask",
    "Bound",
    "CardCensus",
    "Ceiling",
    "Census",
    "Decision",
    "DeviceInfo",
    "HostCensus",
    "MemoryReading",
    "ProcessReading",
    "Sensor",
    "TaskIdentity",
)


@pytest.mark.parametrize("name", RECORDS)
def test_record_types_have_a_public_path(name: str) -> None:
    """The records the pool returns are importable from gpupool and name it as their module."""
    value = getattr(gpupool, name)
    assert value.__module__ == "gpupool"
    assert name in gpupool.__all__


def test_a_public_record_pickles_by_its_public_path() -> None:
    """A record pickled names gpupool.CardCensus and comes back equal."""
    import pickle

    card = gpupool.CardCensus(
        device=0, uuid="GPU-0", name="card", total_bytes=8, free_bytes=4, own_bytes=0, source="s"
    )
    data = pickle.dumps(card, protocol=0)
    assert b"gpupool\nCardCensus" in data
    assert b"_core" not in data
    assert pickle.loads(data) == card


def test_track_is_public() -> None:
    """The progress helper for futures (as_completed) is gpupool.track."""
    assert list(gpupool.track(iter([1, 2]), enabled=False)) == [1, 2]
