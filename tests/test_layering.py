"""The pure core stays pure: ``_core`` imports nothing that reads the world, and opens nothing.

Each ``src/gpupool/_core/*.py`` is parsed with :mod:`ast` (never imported),
so a forbidden import is caught even inside ``if TYPE_CHECKING:`` or a
function body. Within gpupool, ``_core`` may import only itself and
``gpupool._errors``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "src" / "gpupool" / "_core"

#: Modules that read the clock, the environment, files, devices or processes,
#: or start threads or processes. The core takes their answers as arguments.
FORBIDDEN_TOP_LEVEL = frozenset(
    {
        "os",
        "sys",
        "time",
        "subprocess",
        "threading",
        "logging",
        "pathlib",
        "pynvml",
        "psutil",
        "loky",
        "torch",
        "random",
        "importlib",
    }
)

#: The only gpupool modules the core may import.
ALLOWED_GPUPOOL = ("gpupool._core", "gpupool._errors")

#: Builtins that reach the world (``open``) or bypass the import rules above.
FORBIDDEN_CALLS = frozenset({"open", "__import__", "exec", "eval", "input", "print"})


def _absolute(module: str | None, level: int, package: str) -> str:
    """Resolve ``from ..x import y`` (``level`` dots) against ``package``."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def violations(source: str, *, package: str = "gpupool._core") -> list[str]:
    """Every forbidden import or call in ``source``, as ``"line N: what"``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        imported: list[str] = []
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            imported = [base]
            if base == "gpupool":
                # ``from gpupool import _pool`` imports a module by its attribute name.
                imported += [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else None
            if isinstance(func, ast.Attribute) and func.attr == "open":
                name = "open"
            if name in FORBIDDEN_CALLS:
                found.append(f"line {node.lineno}: calls {name}()")
        for name in imported:
            top = name.split(".")[0]
            if top in FORBIDDEN_TOP_LEVEL or (
                top == "gpupool"
                and name != "gpupool"
                and not name.startswith(ALLOWED_GPUPOOL)
                and not _reexported_from_pure(name)
            ):
                found.append(f"line {node.lineno}: imports {name}")
    return found


def _reexported_from_pure(name: str) -> bool:
    """``gpupool.parse_size`` is fine (it lives in _core); ``gpupool.GpuPoolExecutor`` is not."""
    head, _, attr = name.rpartition(".")
    if head != "gpupool":
        return False
    import gpupool

    value = vars(gpupool).get(attr)
    module = getattr(value, "__module__", "")
    return isinstance(module, str) and module.startswith(ALLOWED_GPUPOOL)


def core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_the_core_is_where_this_test_looks() -> None:
    """The check is not vacuous: it finds the core's modules, bound.py among them."""
    names = {path.relative_to(CORE).as_posix() for path in core_files()}
    assert {"__init__.py", "bound.py", "census.py", "units.py", "planner/fit.py"} <= names


@pytest.mark.parametrize("path", core_files(), ids=lambda path: path.relative_to(CORE).as_posix())
def test_core_module_imports_nothing_from_the_world(path: Path) -> None:
    """No _core module imports an I/O, clock, process or device module, or gpupool's I/O layers."""
    assert violations(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("import os", ["line 1: imports os"], id="import"),
        pytest.param("import os.path", ["line 1: imports os.path"], id="dotted"),
        pytest.param("from time import monotonic", ["line 1: imports time"], id="from"),
        pytest.param("import pynvml as nv", ["line 1: imports pynvml"], id="aliased"),
        pytest.param(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch",
            ["line 3: imports torch"],
            id="type-checking-only",
        ),
        pytest.param("def f():\n    import psutil", ["line 2: imports psutil"], id="in-function"),
        pytest.param(
            "from gpupool._sensors.base import Sensor",
            ["line 1: imports gpupool._sensors.base"],
            id="sensors",
        ),
        pytest.param(
            "from gpupool import _pool", ["line 1: imports gpupool._pool"], id="pool-by-attribute"
        ),
        pytest.param(
            "from .. import testing", ["line 1: imports gpupool.testing"], id="relative-testing"
        ),
        pytest.param(
            "import gpupool._commands.cli", ["line 1: imports gpupool._commands.cli"], id="cli"
        ),
        pytest.param(
            "from gpupool import GpuPoolExecutor",
            ["line 1: imports gpupool.GpuPoolExecutor"],
            id="lazy-pool-name",
        ),
        pytest.param("text = open('x').read()", ["line 1: calls open()"], id="open"),
        pytest.param("import io\nio.open('x')", ["line 2: calls open()"], id="io-open"),
        pytest.param("__import__('os')", ["line 1: calls __import__()"], id="dunder-import"),
        pytest.param("from gpupool._core.units import GiB", [], id="core-is-fine"),
        pytest.param("from .census import CardCensus", [], id="relative-core-is-fine"),
        pytest.param("from gpupool._errors import GpuPoolError", [], id="errors-are-fine"),
        pytest.param("from gpupool import parse_size", [], id="reexported-core-name-is-fine"),
        pytest.param("import math, re, dataclasses", [], id="pure-stdlib-is-fine"),
    ],
)
def test_the_checker_catches_what_it_should(source: str, expected: list[str]) -> None:
    """The checker flags each kind of forbidden import or call, and passes pure code."""
    assert violations(source) == expected


#: The pricing functions of the core. The planner's rules call them; nothing outside the
#: planner may (the process layer, the CLI, the postmortem), so that every start and every
#: width stated anywhere is decided in one place.
PRICING = frozenset(
    {
        "derive_bound",
        "derive_ceiling",
        "fits_together",
        "live_gate_admits",
        "learned_margin",
        "card_bound",
        "fit",
        "live_gate",
        "card_widths",
    }
)

#: Where pricing may happen: the planner's package, and the modules that define the terms.
PRICES = ("_core/planner/", "_core/bound.py", "_core/policy.py", "_core/__init__.py")


def _pricing_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpupool._core"):
            found += [f"line {node.lineno}: {a.name}" for a in node.names if a.name in PRICING]
        elif isinstance(node, ast.Attribute) and node.attr in PRICING:
            found.append(f"line {node.lineno}: {node.attr}")
    return found


def _outside_the_planner() -> list[Path]:
    package = CORE.parent
    return sorted(
        path
        for path in package.rglob("*.py")
        if not path.relative_to(package).as_posix().startswith(PRICES)
    )


def test_the_pricing_check_looks_everywhere() -> None:
    """The check reads the process layer, the CLI and the rest of the core."""
    names = {path.relative_to(CORE.parent).as_posix() for path in _outside_the_planner()}
    assert {
        "_pool/dispatcher.py",
        "_pool/executor.py",
        "_commands/cli.py",
        "_core/events.py",
    } <= names


@pytest.mark.parametrize(
    "path", _outside_the_planner(), ids=lambda path: path.relative_to(CORE.parent).as_posix()
)
def test_nothing_outside_the_planner_prices(path: Path) -> None:
    """Every price, admission and width decision is the planner's: no module outside it (the
    process layer, ``gpupool plan``, the postmortem) imports a pricing function."""
    assert _pricing_imports(path.read_text(encoding="utf-8")) == []


def test_the_pricing_check_is_not_vacuous() -> None:
    """The check flags a pricing import, and the planner's fit (which prices) is flagged by it."""
    assert _pricing_imports("from gpupool._core.planner.fit import card_widths") == [
        "line 1: card_widths"
    ]
    assert _pricing_imports((CORE / "planner" / "fit.py").read_text(encoding="utf-8"))


#: What the process layer may ask of the planner: events in, verdicts, records and
#: views out. Its state (``running``, ``pending``, ``queued``, ``tasks``, ``ceiling``,
#: ``asks``, ``refused``, the cards) stays in the core.
PLANNER_SURFACE = frozenset(
    {
        # events in
        "submit", "withdraw", "requeue", "started", "finished", "ended", "settle",
        "out_of_memory", "lost", "flush_asks", "construct", "not_run", "remember",
        # verdicts out
        "next_start", "queue_behind", "run_queued", "still_admits", "take_grown",
        "strict_refusal", "shutdown_record",
        # views out
        "width", "widths", "widths_by_key", "pending_tasks", "ask_of", "unsettled", "counts",
        "has_pending", "may_start", "is_queued", "waiting_for_room",
        # the rooms asked directly, through their own surfaces (ROOM_SURFACES)
        "readings", "neighbours",
    }
)  # fmt: skip

#: The planner's rooms that the process layer asks directly, each by its own client, and what
#: it may ask of each: the card reader's readings in, and the booking link's exchange with the
#: host's other pools (their bookings in; this pool's bookings and waits, and the warm limit
#: that leaves them their room, out). Nothing else of those rooms is read outside the core.
ROOM_SURFACES = {
    "readings": frozenset({"observe", "observe_error", "sample_cards"}),
    "neighbours": frozenset(
        {"observe_others", "warm_limit", "waiting_count", "need_bytes", "waiting_asks",
         "bookings_on", "booked_on"}
    ),
}  # fmt: skip


def _is_planner(node: ast.expr) -> bool:
    """Whether ``node`` names a planner: ``planner`` or ``<anything>.planner``."""
    return (isinstance(node, ast.Name) and node.id == "planner") or (
        isinstance(node, ast.Attribute) and node.attr == "planner"
    )


def _planner_members(source: str) -> list[tuple[int, str]]:
    """Every ``planner.X`` or ``self.planner.X`` read in ``source``, as ``(line, X)``; a read
    of a room asked directly (``planner.readings.X``) is also ``(line, "readings.X")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if _is_planner(owner):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(owner, ast.Attribute)
            and owner.attr in ROOM_SURFACES
            and _is_planner(owner.value)
        ):
            found.append((node.lineno, f"{owner.attr}.{node.attr}"))
    return found


def _allowed(name: str) -> bool:
    """Whether the process layer may read ``name`` (a member, or ``room.member``)."""
    room, _, member = name.partition(".")
    if member:
        return member in ROOM_SURFACES[room]
    return name in PLANNER_SURFACE


def _outside_the_core() -> list[Path]:
    package = CORE.parent
    return sorted(path for path in package.rglob("*.py") if CORE not in path.parents)


def test_the_planner_surface_check_is_not_vacuous() -> None:
    """The check sees the dispatcher's and the booking link's planner calls, and flags a read
    of raw state, through the planner or through a room asked directly."""
    dispatcher = (CORE.parent / "_pool" / "dispatcher.py").read_text(encoding="utf-8")
    assert {"next_start", "started"} <= {name for _, name in _planner_members(dispatcher)}
    raw = "n = len(self.planner.running) < planner.ceiling.value"
    assert _planner_members(raw) == [(1, "running"), (1, "ceiling")]
    link = (CORE.parent / "_pool" / "booking_link.py").read_text(encoding="utf-8")
    assert "neighbours.need_bytes" in {name for _, name in _planner_members(link)}
    reach = "self.planner.readings.observe(0); planner.neighbours._state.running"
    members = [name for _, name in _planner_members(reach) if not _allowed(name)]
    assert members == ["neighbours._state"]


@pytest.mark.parametrize(
    "path", _outside_the_core(), ids=lambda path: path.relative_to(CORE.parent).as_posix()
)
def test_the_process_layer_reads_no_planner_state(path: Path) -> None:
    """Outside the core, the planner is asked through its events, verdicts and views only:
    nothing reads ``running``, ``queued``, ``ceiling`` or any other of its fields, and of a
    room asked directly, nothing but what ``ROOM_SURFACES`` lists for it."""
    members = _planner_members(path.read_text(encoding="utf-8"))
    assert [(line, name) for line, name in members if not _allowed(name)] == []
