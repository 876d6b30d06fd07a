"""The planner's rooms own their fields: each field has one writer, the room that holds it.

The planner is one :class:`~gpupool._core.planner.Planner` composing rooms (its state,
the log, the durations, the order, the views, learning, the queue, the starts, the
out-of-memory room, the readings, the neighbours), not a chain of mixins over one bag of
attributes. These tests read the package's source with ``ast``: no planner class inherits
another, and no room writes another room's field (a store, an augmented store, a subscript
store, ``del``, or a mutating call such as ``.append``), whether through ``self._room.field``
or a local alias of it. A room changes another room's state only by calling its methods.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import gpupool

PLANNER = Path(gpupool.__file__).parent / "_core" / "planner"

#: Calls that change the container they are called on.
MUTATORS = frozenset(
    {
        "add", "append", "appendleft", "clear", "discard", "extend", "insert", "pop",
        "popitem", "popleft", "remove", "setdefault", "update",
    }
)  # fmt: skip


def _classes(source: str) -> Iterator[ast.ClassDef]:
    yield from (node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))


def _is_record(cls: ast.ClassDef) -> bool:
    """A dataclass (a record: written by the rules that hold it) or a protocol."""
    names = {ast.unparse(d).split("(")[0].split(".")[-1] for d in cls.decorator_list}
    return "dataclass" in names or any(ast.unparse(b) == "Protocol" for b in cls.bases)


def _self_stores(cls: ast.ClassDef) -> set[str]:
    """The fields ``cls`` stores on ``self`` (``self.X = ...``, ``+=``, annotated)."""
    fields = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    fields.add(sub.attr)
    return fields


def _rooms(sources: dict[str, str]) -> dict[str, set[str]]:
    """Each room class (not a record) and the fields it stores on itself."""
    return {
        cls.name: _self_stores(cls)
        for source in sources.values()
        for cls in _classes(source)
        if not _is_record(cls)
    }


def _through_a_room(node: ast.expr, refs: set[str]) -> str | None:
    """The room field ``node`` reaches as ``self.<ref>.<field>`` (or ``<alias>.<field>``,
    an alias of ``self.<ref>``), else ``None``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value
    if (
        isinstance(owner, ast.Attribute)
        and ast.unparse(owner.value) == "self"
        and owner.attr in refs
    ):
        return node.attr
    if isinstance(owner, ast.Name) and owner.id in refs:
        return node.attr
    return None


def _foreign_writes(sources: dict[str, str]) -> list[str]:
    """Every write of a room's field made from another room: ``"Class.method: field"``."""
    rooms = _rooms(sources)
    fields = set().union(*rooms.values())
    found = []
    for source in sources.values():
        for cls in _classes(source):
            if cls.name not in rooms:
                continue
            # The collaborators: the fields this room stores that hold another room.
            refs = {f for f in rooms[cls.name] if f.lstrip("_") in _REFS}
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                # Local names bound to a room: ``state = self._state``.
                aliases = {
                    target.id
                    for node in ast.walk(method)
                    if isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Attribute)
                    and ast.unparse(node.value.value) == "self"
                    and node.value.attr in refs
                    for target in node.targets
                    if isinstance(target, ast.Name)
                }
                for node in ast.walk(method):
                    for target in _written(node):
                        field = _through_a_room(target, refs | aliases)
                        if field is not None and field in fields:
                            found.append(f"{cls.name}.{method.name}: {field}")
    return found


def _written(node: ast.AST) -> list[ast.expr]:
    """What ``node`` writes: assigned, augmented, annotated or deleted targets, and the object
    a mutating method (:data:`MUTATORS`) is called on."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
    ):
        return [node.func.value]
    return []


#: The names the rooms are held by (``self._state``, ``self.views``, ...).
_REFS = frozenset(
    {
        "state", "log", "durations", "order", "views", "learning", "queue", "starts", "oom",
        "readings", "neighbours",
    }
)  # fmt: skip


def _sources() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in PLANNER.glob("*.py")}


def test_no_planner_class_inherits_another() -> None:
    """The planner is composed, not a chain of mixins: no class of the package has a base
    class defined in the package."""
    sources = _sources()
    names = {cls.name for source in sources.values() for cls in _classes(source)}
    inherited = [
        f"{cls.name}({ast.unparse(base)})"
        for source in sources.values()
        for cls in _classes(source)
        for base in cls.bases
        if ast.unparse(base) in names
    ]
    assert inherited == []


def test_each_field_has_one_writer() -> None:
    """No room writes a field of another room (each ``self.X`` is written by its own class
    only; another room asks through a method)."""
    assert _foreign_writes(_sources()) == []


def test_the_planner_is_composed_of_its_rooms() -> None:
    """The check is not vacuous: it sees the rooms and what each owns."""
    rooms = _rooms(_sources())
    assert {"Planner", "PlannerState", "Views", "Order", "Learning", "Queue", "Starts"} <= set(
        rooms
    )
    assert {"width", "refused"} <= rooms["Views"]
    assert "hold" in rooms["Order"]
    assert "queued" in rooms["Queue"]
    assert {"pending", "running", "ceiling", "counts"} <= rooms["PlannerState"]


def test_the_one_writer_check_flags_a_foreign_write() -> None:
    """A room that rebinds, augments or mutates another room's field is flagged, through
    the reference or a local alias of it."""
    source = """
class Views:
    def __init__(self, state):
        self._state = state
        self.width = 1

class Starts:
    def __init__(self, state, views):
        self._state = state
        self._views = views
        self.own = 0

    def rule(self):
        self.own = 2
        self._views.width = 3
        self._state.pending.append(1)
        state = self._state
        state.running[1] = 2

class PlannerState:
    def __init__(self):
        self.pending = []
        self.running = {}
"""
    assert sorted(_foreign_writes({"x.py": source})) == [
        "Starts.rule: pending",
        "Starts.rule: running",
        "Starts.rule: width",
    ]


def _record_writes(sources: dict[str, str], record: str) -> dict[str, set[str]]:
    """By field of the record class ``record``: the modules that write it from outside the
    record's own methods (a store, an augmented store, or a mutating call)."""
    fields = {
        node.target.id
        for source in sources.values()
        for cls in _classes(source)
        if cls.name == record
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    writers: dict[str, set[str]] = {}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            for target in _written(node):
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and sub.attr in fields
                        and ast.unparse(sub.value) != "self"
                    ):
                        writers.setdefault(sub.attr, set()).add(name)
    return writers


#: The records a card holds, by field: each record's class and the one module that writes it
#: (``state.py``: the card's own methods).
CARD_PARTS = {
    "sums": ("RunSums", "state.py"),
    "live": ("LiveTerms", "readings.py"),
    "cap": ("CapTerms", "out_of_memory.py"),
    "gate": ("GateClock", "starts.py"),
    "sample": ("LastSample", "samples.py"),
    "pools": ("PoolsHere", "sharing.py"),
    "turns": ("Turns", "sharing.py"),
    "memo": ("Memos", "fit.py"),
}


def _card_parts(sources: dict[str, str]) -> dict[str, str]:
    """The fields of ``Card`` that hold a record of the package, and the record's class."""
    records = {
        cls.name for source in sources.values() for cls in _classes(source) if _is_record(cls)
    }
    return {
        node.target.id: ast.unparse(node.annotation)
        for source in sources.values()
        for cls in _classes(source)
        if cls.name == "Card"
        for node in cls.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and ast.unparse(node.annotation) in records
    }


def _card_writes_astray(sources: dict[str, str]) -> list[str]:
    """Every write of a card that its rule does not own: a field of one of its records
    written from another module than the record's owner, a record rebound from another
    module, or a field of the card itself written from two modules (``"Class.field: modules"``)."""
    found = []
    for field, writers in sorted(_record_writes(sources, "Card").items()):
        owner = CARD_PARTS[field][1] if field in CARD_PARTS else None
        if len(writers) > 1 or (owner is not None and writers != {owner}):
            found.append(f"Card.{field}: {', '.join(sorted(writers))}")
    for record, owner in CARD_PARTS.values():
        for field, writers in sorted(_record_writes(sources, record).items()):
            if writers != {owner}:
                found.append(f"{record}.{field}: {', '.join(sorted(writers))}")
    return found


def test_each_card_field_has_one_writing_module() -> None:
    """A card's fields are written by one rule each: its runs and their sums by its own methods,
    the width by the views, and each of its records (the live reading, the cap, the gate's
    clock, the last sample, the other pools, the turns, the memos) by the one rule that owns it;
    no rule writes another's record, nor rebinds one."""
    sources = _sources()
    assert _card_parts(sources) == {part: record for part, (record, _) in CARD_PARTS.items()}
    assert _card_writes_astray(sources) == []
    # Not vacuous: it sees who writes what.
    writers = _record_writes(sources, "Card")
    assert writers["width"] == {"views.py"}
    for part, (record, owner) in CARD_PARTS.items():
        assert set().union(*_record_writes(sources, record).values()) == {owner}, part
    assert _record_writes(sources, "CapTerms")["oom_cap"] == {"out_of_memory.py"}
    assert _record_writes(sources, "PoolsHere")["others_bytes"] == {"sharing.py"}
    live = _record_writes(sources, "LiveTerms")
    assert live["reading"] == live["own_high_water_bytes"] == {"readings.py"}


def test_the_card_check_flags_a_write_of_another_rules_record() -> None:
    """A rule that writes a field of another rule's record on a card (a store, a mutating
    call), or rebinds that record, is flagged."""
    sources = _sources()
    sources["starts.py"] += """

def _astray(card):
    card.sample.sampled_s = 0.0
    card.turns.starved_since_s.clear()
    card.cap = None
"""
    assert _card_writes_astray(sources) == [
        "Card.cap: out_of_memory.py, starts.py",
        "Card.sample: samples.py, starts.py",
        "Card.turns: sharing.py, starts.py",
        "LastSample.sampled_s: samples.py, starts.py",
        "Turns.starved_since_s: sharing.py, starts.py",
    ]
