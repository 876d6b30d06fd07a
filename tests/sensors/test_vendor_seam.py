"""Vendors stay behind the sensor: outside ``_sensors`` no code tests a sensor's class or reads a
vendor's variable, and ``GPUPOOL_SIMULATOR`` is read in one place.

Each ``src/gpupool/**/*.py`` is parsed with :mod:`ast` (never imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gpupool"

#: The sensor classes gpupool defines; a test of one of them outside ``_sensors`` is a vendor leak.
SENSOR_CLASSES = frozenset({"Sensor", "NvmlSensor", "SimulatedSensor"})

#: Variables only a sensor reads (``sensor.read_visible_devices()``, ``read_simulator_ledger()``).
VENDOR_VARIABLES = frozenset(
    {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUPOOL_SIMULATOR", "SIMULATOR_ENV"}
)


def _environ_read(node: ast.AST) -> str | None:
    """The variable ``os.environ.get(X)`` or ``os.environ[X]`` reads, by literal or by name."""
    key: ast.expr | None = None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and ast.unparse(node.func.value) == "os.environ"
        and node.args
    ):
        key = node.args[0]
    elif (
        isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Load)
        and ast.unparse(node.value) == "os.environ"
    ):
        key = node.slice
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    if isinstance(key, ast.Name):
        return key.id
    return None


def _leaks() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        inside = where.startswith("_sensors/")
        for node in ast.walk(ast.parse(path.read_text())):
            read = _environ_read(node)
            simulator = read in ("GPUPOOL_SIMULATOR", "SIMULATOR_ENV")
            allowed = where == "_sensors/select.py" if simulator else inside
            if read in VENDOR_VARIABLES and not allowed:
                found.append(f"{where}:{node.lineno}: reads {read}")
            if (
                not inside
                and isinstance(node, ast.Call)
                and ast.unparse(node.func) == "isinstance"
                and len(node.args) == 2
                and SENSOR_CLASSES
                & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            ):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_vendor_fact_is_read_outside_the_sensors() -> None:
    """No isinstance on a sensor class, no CUDA or simulator variable read, outside _sensors."""
    assert _leaks() == []


def test_the_check_sees_a_leak() -> None:
    """The walk finds each kind of leak it looks for (so an empty answer means something)."""
    source = (
        "import os\n"
        "a = os.environ.get('CUDA_VISIBLE_DEVICES')\n"
        "b = os.environ[SIMULATOR_ENV]\n"
        "c = isinstance(s, (NvmlSensor, int))\n"
    )
    tree = ast.parse(source)
    reads = [_environ_read(node) for node in ast.walk(tree)]
    assert "CUDA_VISIBLE_DEVICES" in reads and "SIMULATOR_ENV" in reads
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance"
    ]
    assert {n.id for n in ast.walk(calls[0].args[1]) if isinstance(n, ast.Name)} & SENSOR_CLASSES
