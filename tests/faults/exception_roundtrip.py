"""Pickle every exception class gpupool defines, in a fresh interpreter; print the outcomes as JSON.

Run by ``test_exception_pickling.py`` in a child process: a library that
patches exception pickling process-wide (``distributed`` installs tblib's)
must not be loaded when the round trip is judged, and the test session may
have loaded it already.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
import pkgutil
import sys

import cloudpickle

import gpupool
from gpupool import GpuPoolError

#: Modules left out of the walk: they pull in distributed, which patches pickling.
SKIPPED = {"gpupool.dask", "gpupool._child.dask", "gpupool.__main__"}

#: A sample value for each keyword the exceptions' constructors take.
SAMPLES: dict[str, object] = {
    "value": "12 parsecs",
    "decision": {"event": "narrowed", "width_after": 1},
    "device": 1,
    "ask_bytes": 2**30,
    "detail": "CUDA out of memory",
    "exitcode": -9,
    "signal_name": "SIGKILL",
    "path": "/tmp/decisions.jsonl",
    "line": 7,
    "requested_bytes": 2**31,
    "used_bytes": 2**32,
    "total_bytes": 2**33,
    "run": "2",
    "runs": ("20261201T000000Z-0123456789ab",),
    "node": "10.0.0.7/0123abcd",
}


def exceptions() -> list[type[BaseException]]:
    """Every exception class a gpupool module defines, found by walking the package."""
    for info in pkgutil.walk_packages(gpupool.__path__, "gpupool."):
        if info.name in SKIPPED:
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra (matplotlib, tqdm) is missing
            continue
    found: dict[str, type[BaseException]] = {}
    todo: list[type[BaseException]] = [GpuPoolError, *BaseException.__subclasses__()]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] == "gpupool":
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


def instance(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` with a message and a sample for each keyword it takes."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except ValueError:  # Exception's own __init__: no signature to read
        return cls("the message")
    kwargs = {
        p.name: SAMPLES[p.name]
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in SAMPLES
    }
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return cls("the message", **kwargs) if positional else cls(**kwargs)


def outcome(cls: type[BaseException], dumps: object) -> str:
    """``"ok"``, or what differed after the round trip."""
    exc = instance(cls)
    try:
        back = pickle.loads(dumps(exc))  # type: ignore[operator]
    except Exception as error:
        return f"loads failed: {type(error).__name__}: {error}"
    for label, a, b in (
        ("type", type(back), cls),
        ("str", str(back), str(exc)),
        ("args", back.args, exc.args),
        ("attributes", vars(back), vars(exc)),
    ):
        if a != b:
            return f"{label} differs: {a!r} != {b!r}"
    return "ok"


def main() -> None:
    assert "distributed" not in sys.modules, "distributed patches exception pickling"
    report = {
        f"{cls.__module__}.{cls.__qualname__}": {
            "pickle": outcome(cls, pickle.dumps),
            "cloudpickle": outcome(cls, cloudpickle.dumps),
        }
        for cls in exceptions()
    }
    assert "distributed" not in sys.modules, "distributed patches exception pickling"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
