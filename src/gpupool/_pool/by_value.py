"""How calls and results are pickled, and what a function from ``__main__`` sees in a worker.

A worker imports the script the pool was started from as ``__mp_main__``, as the standard
library's spawn workers do (:func:`main_for_workers` decides when, with the standard
library's own rules: a script run by path or a module run with ``-m``): its top level runs
once per worker, and a function or class the script defines at its top level travels *by
name* and is the worker's own, whose state lasts for the worker's life. What a worker cannot
import travels *by value* (cloudpickle): everything of ``__main__`` when there is no script to
import (``python -c``, the REPL, a notebook, ``python -m pkg`` of a package's
``__main__``), and, with one, lambdas, closures and what the script defines only under
``if __name__ == "__main__":`` (:func:`by_name`).

A call or a result is pickled by plain pickle when that is enough, into a
buffer (:func:`dumps_call`): a pickle that names what of ``__main__`` a worker
cannot import by name is noticed while it is written, from each
function's, class's and object's ``__module__`` as the pickler meets it, and
redone by value with cloudpickle; nothing scans the pickled bytes.

Sent by value, a function's code object keeps its file name, so tracebacks
show the source line: cloudpickle rebuilds the code object in the worker, and
since cloudpickle 3.0 names its file ``<dynamic-code>``, so a failing task's
traceback would read ``File "<dynamic-code>", line 6, in bad`` with no source.
The standard pool imports ``__main__`` in its workers and shows the script's
file and line. This pickler sends the file name with the code object; the
worker's traceback then names the script, and :mod:`linecache` reads the line.

Every function of the script's globals sent by value shares one namespace
per worker (:func:`main_namespace`: the imported script's globals where the
worker imported it), as the standard pool's tasks share the worker's
``__mp_main__``: a global the initializer sets (``global MODEL;
MODEL = load()``) is seen by every task of that worker, and one a task sets
by the tasks after it. Each function still brings the values its code reads
from the script's globals as they were when it was sent; one the worker
rebound since (its initializer or a task assigned it) keeps the worker's
value, one it deleted stays deleted, and one the script did not rebind since
it was last sent (the same object there) keeps the worker's copy, with what
the worker changed in it in place (a cache the initializer or a task fills,
as the standard pool's workers keep it) (:func:`_main_setstate`).
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import pickle
import sys
import types
import weakref
from collections import ChainMap
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import ast

__all__ = [
    "adopt_main_namespace",
    "by_name",
    "dumps_by_value",
    "dumps_call",
    "main_for_workers",
    "main_namespace",
    "note_pool_made",
    "pickler_class",
    "named_code",
    "sender_ids",
]


def _cloudpickle() -> Any:
    """cloudpickle's module, imported on first use: a worker whose calls and results all
    pickle by name (and the parent until it pickles one by value) never loads it."""
    import cloudpickle

    return cloudpickle.cloudpickle


#: The module attributes a shared namespace takes from the script's globals.
_MODULE_ATTRS = ("__package__", "__name__", "__file__")

#: This process's namespace for the functions of the sender's ``__main__`` (created on
#: first use), and the value of each name in it as the sender last sent it.
_main_ns: dict[str, Any] | None = None
_main_sent: dict[str, Any] = {}
#: The sender's version (:func:`_version`) of each value in ``_main_sent`` (``None``: not
#: known), which tells a value the sender rebound from the same one sent again.
_main_ids: dict[str, int | None] = {}
#: In the sender: the last object sent for each global name (weakly where it can be), and
#: its version; and the versions to give.
_sent: dict[str, tuple[Any, int]] = {}
_versions = itertools.count(1)


def main_for_workers() -> dict[str, str]:
    """How a worker imports this process's ``__main__`` as ``__mp_main__``: the standard
    library's preparation entry (``init_main_from_name`` or ``init_main_from_path``), decided
    as :func:`multiprocessing.spawn.get_preparation_data` decides it; empty when the workers
    do not import it (no file: ``python -c``, the REPL, a notebook; a package's
    ``__main__``, which the standard library does not run again either).

    CPython removes ``__main__.__file__`` as the script's body ends; work submitted then
    (a pool left to finish at the interpreter's exit) goes to workers started after, which
    import the script from where it was last found (each pool's construction finds it)."""
    global _main_found
    main = sys.modules.get("__main__")
    if main is None or _unguarded:
        return {}
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str):
        if name == "__main__" or name.endswith(".__main__"):
            return {}
        return {"init_main_from_name": name}
    path = getattr(main, "__file__", None)
    if path is None and _main_found is not None and _main_found[0] is main:
        # The script's body ended (CPython removes ``__file__`` then) with work submitted:
        # the workers started for it at the interpreter's exit import the script all the same.
        return dict(_main_found[1])
    if not isinstance(path, str) or not os.path.isfile(path):
        return {}
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return {}
    from multiprocessing import process

    original = getattr(process, "ORIGINAL_DIR", None)
    if not os.path.isabs(path) and original is not None:
        path = os.path.join(original, path)
    found = {"init_main_from_path": os.path.normpath(path)}
    _main_found = (main, found)
    return dict(found)


def by_name(obj: object) -> bool:
    """Whether ``obj``, a function or class of this process's ``__main__``, reaches a worker
    by name: the worker imports the script, ``obj`` is what the script's ``__main__`` holds
    under its qualified name, and the script binds that name at its top level, not only
    under ``if __name__ == "__main__":`` (which a worker does not run)."""
    main = sys.modules.get("__main__")
    qualname = getattr(obj, "__qualname__", None)
    if main is None or _unguarded or not isinstance(qualname, str) or "<" in qualname:
        return False
    found: object = main
    for part in qualname.split("."):
        found = getattr(found, part, _MISSING)
    if found is not obj:
        return False
    return qualname.split(".")[0] in _top_level_names(main)


def note_pool_made() -> None:
    """Called as a pool is made, in the caller's thread. A pool the script's top level makes
    outside ``if __name__ == "__main__":`` (directly, or through a function it calls there)
    would be made again by every worker that imports the script, as the standard pool's
    spawn workers would; its workers cannot import the script. From then on this process
    sends what its workers need of the script by value, as for ``python -c``."""
    global _unguarded
    main_for_workers()  # found while the script's ``__file__`` is there (see its docstring)
    main = sys.modules.get("__main__")
    if _unguarded or main is None or getattr(main, "__name__", None) != "__main__":
        return
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            if main_for_workers():
                _, guards = _script_outline(main)
                line = frame.f_lineno
                _unguarded = not any(first <= line <= last for first, last in guards)
            return
        frame = frame.f_back


def _top_level_names(main: types.ModuleType) -> frozenset[str]:
    """The names the script ``main`` binds outside its ``if __name__ == "__main__":`` blocks
    (empty when its workers do not import it, or its source cannot be read)."""
    return _script_outline(main)[0]


def _script_outline(main: types.ModuleType) -> tuple[frozenset[str], tuple[tuple[int, int], ...]]:
    """What the script ``main`` binds outside its main guards, and the lines those guards
    span (first, last), read once from its source; nothing where its workers do not import
    it or the source cannot be read."""
    import ast  # the parent reads its script once; a worker never does

    global _outline
    if _outline is not None and _outline[0] is main:
        return _outline[1]
    found: tuple[frozenset[str], tuple[tuple[int, int], ...]] = (frozenset(), ())
    prepared = main_for_workers()
    try:
        path = prepared.get("init_main_from_path")
        if "init_main_from_name" in prepared:
            import importlib.util

            spec = importlib.util.find_spec(prepared["init_main_from_name"])
            path = None if spec is None else spec.origin
        if path is not None and os.path.isfile(path):
            with open(path, "rb") as file:
                body = ast.parse(file.read()).body
            found = (_bound_names(body), tuple(_guard_lines(body)))
    except (OSError, SyntaxError, ValueError, ImportError):
        pass
    _outline = (main, found)
    return found


def _guard_lines(body: list[ast.stmt]) -> list[tuple[int, int]]:
    """The lines each ``if __name__ == "__main__":`` block of ``body`` spans (not inside a
    function or class: those are not the script's top level)."""
    import ast

    spans: list[tuple[int, int]] = []
    for node in body:
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            spans.append((node.lineno, node.end_lineno or node.lineno))
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                spans += _guard_lines([n for n in inner if isinstance(n, ast.stmt)])
        for handler in getattr(node, "handlers", ()):
            spans += _guard_lines(handler.body)
    return spans


def _bound_names(body: list[ast.stmt]) -> frozenset[str]:
    """The names ``body`` binds when run as ``__mp_main__`` (a guard's body is skipped)."""
    import ast

    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If) and _is_main_guard(node.test):
            names |= _bound_names(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    names |= _bound_names([n for n in inner if isinstance(n, ast.stmt)])
            for handler in getattr(node, "handlers", ()):
                names |= _bound_names(handler.body)
    return frozenset(names)


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    import ast

    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )


#: The script whose source was read, what it binds at its top level and the lines of its main
#: guards (:func:`_script_outline`).
_outline: tuple[types.ModuleType, tuple[frozenset[str], tuple[tuple[int, int], ...]]] | None = None
#: This process's ``__main__`` and where its workers import it from, as last found with its
#: ``__file__`` (:func:`main_for_workers`).
_main_found: tuple[types.ModuleType, dict[str, str]] | None = None
#: Whether the script's top level made a pool outside its main guard (:func:`note_pool_made`):
#: then no worker imports it.
_unguarded = False


def _imported_script_globals() -> dict[str, Any] | None:
    """In a worker that imported the script as ``__mp_main__``: the globals its functions
    read (the standard library runs the script in a namespace of its own and keeps a copy
    as the module), else ``None``."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__name__", None) != "__mp_main__":
        return None
    for value in vars(main).values():
        if isinstance(value, types.FunctionType) and value.__module__ == "__mp_main__":
            return value.__globals__
    return vars(main)


def named_code(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` with its file name back (run in the process that unpickles it)."""
    return code.replace(co_filename=filename)


def main_namespace(attrs: dict[str, Any]) -> dict[str, Any]:
    """The one namespace of this process for functions of the sender's ``__main__`` (run in
    the process that unpickles them); ``attrs`` fill the module attributes it lacks."""
    global _main_ns
    if _main_ns is None:
        _main_ns = _imported_script_globals()
        if _main_ns is None:
            _main_ns = {}
    for name, value in attrs.items():
        _main_ns.setdefault(name, value)
    return _main_ns


def sender_ids(fn: object) -> dict[str, int]:
    """The version (:func:`_version`) of each global ``fn`` reads, in the sender, when ``fn``
    is a function of its ``__main__`` (the initializer: :func:`adopt_main_namespace` takes
    them with it)."""
    main = sys.modules.get("__main__")
    if not isinstance(fn, types.FunctionType) or main is None or fn.__globals__ is not vars(main):
        return {}
    names = _cloudpickle()._extract_code_globals(fn.__code__)
    return {name: _version(name, fn.__globals__[name]) for name in names if name in fn.__globals__}


def _version(name: str, value: object) -> int:
    """The version of the script's global ``name`` as sent now: the same while it is the
    same object as last sent, a new one (never used before) once the script rebound it.

    The last object sent is held by a weak reference, or, for a dict, list, set or
    bytearray (which take none, and may be changed in place), by a strong one until the
    name is sent again rebound; any other value (immutable) gets a new version each time.
    """
    entry = _sent.get(name)
    if entry is not None:
        holder, version = entry
        held = holder() if isinstance(holder, weakref.ref) else holder
        if held is value:
            return version
    # Never one given before, whichever pool's thread asks (a race only adds a version).
    version = next(_versions)
    try:
        _sent[name] = (weakref.ref(value), version)
    except TypeError:
        if isinstance(value, (dict, list, set, bytearray)):
            _sent[name] = (value, version)
        else:
            _sent.pop(name, None)
    return version


def adopt_main_namespace(fn: object, ids: dict[str, int] | None = None) -> None:
    """Make the globals of ``fn`` this process's namespace for ``__main__`` when ``fn`` is a
    function of the sender's ``__main__`` that arrived by value (the initializer, which
    the process launcher's cloudpickle sent) and none exists yet; what it holds counts
    as sent (``ids``: their versions in the sender, :func:`sender_ids`), so the
    initializer's own assignments, and what it puts in them in place, are the worker's."""
    global _main_ns
    if _main_ns is not None or not isinstance(fn, types.FunctionType):
        return
    if _imported_script_globals() is not None:
        main_namespace({})  # the imported script's globals are the namespace
        return
    main = sys.modules.get("__main__")
    if fn.__module__ != "__main__" or (main is not None and fn.__globals__ is vars(main)):
        return
    _main_ns = fn.__globals__
    _main_sent.update(_main_ns)
    for name in _main_ns:
        _main_ids[name] = (ids or {}).get(name)


def _main_setstate(func: types.FunctionType, state: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """cloudpickle's state restore, except that a global the worker rebound or deleted since
    it was last sent (by the initializer or a task) keeps the worker's value, or stays
    deleted, and one the sender sends again as the same object (its version there
    unchanged: :func:`_version`) keeps the worker's copy, with what the worker changed in
    it in place."""
    namespace = func.__globals__
    sent: dict[str, Any] = state[1]["__globals__"]
    ids: dict[str, int] = state[1].pop(_SENDER_IDS, None) or {}
    for name in list(sent):
        last = _main_sent.get(name, _MISSING)
        if namespace.get(name, _MISSING) is not last:
            del sent[name]  # rebound, deleted or first set in this worker: its state wins
        elif last is not _MISSING and _main_ids.get(name) == ids.get(name, _NO_ID):
            del sent[name]  # the sender's same object again: the worker's copy stands
        else:
            _main_sent[name] = sent[name]
            _main_ids[name] = ids.get(name)
    _cloudpickle()._function_setstate(func, state)


#: The key of a function's state under which the sender puts the version of each global it
#: sends with it (the pickler's ``_dynamic_function_reduce``, :func:`pickler_class`).
_SENDER_IDS = "_gpupool_sender_ids"
_MISSING = object()
#: Stands for a sender's id that was not sent (never equal to one recorded).
_NO_ID = -1


class _MainGlobals:
    """Pickles as the receiving process's :func:`main_namespace`."""

    __slots__ = ("attrs",)

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs

    def __reduce__(self) -> Any:
        return main_namespace, (self.attrs,)


class _Unnamed:
    """A code object that pickles as cloudpickle pickles it, file name dropped."""

    __slots__ = ("code",)

    def __init__(self, code: types.CodeType) -> None:
        self.code = code

    def __reduce__(self) -> Any:
        return _cloudpickle().Pickler.dispatch_table[types.CodeType](self.code)


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    return named_code, (_Unnamed(code), code.co_filename)


@functools.cache
def pickler_class() -> type[Any]:
    """cloudpickle's pickler, every code object keeping its file and every function of
    ``__main__`` the receiver's :func:`main_namespace` (made on first use)."""
    base: Any = _cloudpickle().Pickler

    class _Pickler(base):  # type: ignore[misc]
        dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
            {types.CodeType: _reduce_code}, base.dispatch_table
        )

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (type, types.FunctionType)) and _imported_by_name(obj):
                return NotImplemented  # pickled by name: the worker's own
            return super().reducer_override(obj)

        def _dynamic_function_reduce(self, func: types.FunctionType) -> Any:
            reduced = super()._dynamic_function_reduce(func)
            main = sys.modules.get("__main__")
            if main is None or func.__globals__ is not vars(main):
                return reduced
            make, (code, _, name, defaults, closure), state, items, pairs, _ = reduced
            slots = state[1]
            slots[_SENDER_IDS] = {k: _version(k, v) for k, v in slots["__globals__"].items()}
            attrs = {k: func.__globals__[k] for k in _MODULE_ATTRS if k in func.__globals__}
            newargs = (code, _MainGlobals(attrs), name, defaults, closure)
            return make, newargs, state, items, pairs, _main_setstate

    return _Pickler


def dumps_by_value(obj: object) -> bytes:
    """``cloudpickle.dumps(obj)`` at the highest protocol, every code object keeping its file
    and every function of ``__main__`` the receiver's :func:`main_namespace`."""
    with io.BytesIO() as file:
        pickler_class()(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return file.getvalue()


def _imported_by_name(obj: type | types.FunctionType) -> bool:
    """Whether cloudpickle should leave ``obj`` to plain pickle's by-name reference: a
    function or class of ``__main__`` that the worker's imported script holds."""
    return getattr(obj, "__module__", None) == "__main__" and by_name(obj)


class _NamesMain(Exception):
    """The object being pickled names ``__main__``: it goes by value."""


class _ByName(pickle.Pickler):
    """Plain pickle that stops at the first function, class or object of ``__main__``
    (or of no module, which pickle would look for in ``__main__``)."""

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object that is not a plain value (numbers, strings, bytes and
        # the built-in containers are not), before pickle looks up a global by name.
        named = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        module = named.__module__
        if (module == "__main__" and not by_name(named)) or module is None:
            raise _NamesMain
        return NotImplemented


def dumps_call(obj: object) -> bytes:
    """Pickle a task or a result: plain pickle when it is enough, cloudpickle otherwise.

    Plain pickle is several times cheaper per call, and suffices for
    functions and classes that the other process can import by name, the
    script's included where the worker imports it (:func:`by_name`).
    cloudpickle is needed for lambdas, closures and what of ``__main__`` a
    worker cannot import: plain pickle refuses the first two, and the last is
    noticed while pickling (:class:`_ByName`).
    """
    with io.BytesIO() as file:
        try:
            _ByName(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
            return file.getvalue()
        except Exception:
            pass
    return dumps_by_value(obj)  # tracebacks keep the file; one namespace for __main__
