"""Decision records to the ``gpupool`` logger, a JSON Lines file, and memory.

The log grows with decisions, not with tasks: a pool that runs 100,000
tasks at one width writes a handful of records.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import IO

from gpupool._core.events import Decision
from gpupool._errors import ConfigurationError

__all__ = ["LOGGER", "DecisionLog", "check_log_path"]

LOGGER = logging.getLogger("gpupool")


def check_log_path(log_path: str | os.PathLike[str]) -> Path:
    """Validate ``log_path`` at construction: its directory exists and is writable.

    Raises:
        ConfigurationError: naming the path and what is wrong with it.
    """
    path = Path(log_path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigurationError(
            f"log_path={str(log_path)!r}: the directory {str(parent)!r} does not exist; "
            "create it or pass a path in an existing directory."
        )
    if path.is_dir():
        raise ConfigurationError(
            f"log_path={str(log_path)!r} is a directory; pass a file path such as run.jsonl."
        )
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise ConfigurationError(
            f"log_path={str(log_path)!r} cannot be written ({exc.strerror}); "
            "pass a path in a writable directory."
        ) from exc
    return path


class DecisionLog:
    """Keeps every decision; writes each to the logger and, if asked, a JSON Lines file.

    Args:
        path: a JSON Lines file to append to, or ``None``.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._records: list[Decision] = []
        self._lock = threading.Lock()
        self._file: IO[str] | None = path.open("a", encoding="utf-8") if path else None

    def append(self, decision: Decision) -> None:
        """Record one decision."""
        with self._lock:
            self._records.append(decision)
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps(decision.to_dict(), sort_keys=False) + "\n")
                self._file.flush()
        level = logging.WARNING if decision.event in _WARN else logging.INFO
        LOGGER.log(level, "%s: %s", decision.event, decision.reason, extra={"gpupool": decision})

    def records(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        with self._lock:
            return tuple(self._records)

    def close(self) -> None:
        """Close the file, if any. Idempotent."""
        with self._lock:
            if self._file is not None:
                self._file.close()


_WARN = frozenset(
    {
        "out_of_memory",
        "worker_lost",
        "fixed_width_over_bound",
        "serial_start",
        "narrowed",
        "sensor_error",
    }
)
