"""Checks of constructor inputs that would otherwise fail far from where they were given:
a sensor that is not one (an ``AttributeError`` from inside the census) and a ``PYTHONHOME``
in ``env=`` that names no Python (every worker dies at boot, "exited with code 1")."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from gpupool._errors import ConfigurationError

__all__ = ["check_python_home", "check_sensor"]

#: What a sensor must answer (``gpupool._sensors.base.Sensor`` implements them all).
SENSOR_METHODS = ("read_devices", "read_memory", "read_host")


def check_sensor(sensor: object) -> None:
    """Refuse a ``sensor=`` that lacks a method the census calls, naming what is missing."""
    missing = [name for name in SENSOR_METHODS if not callable(getattr(sensor, name, None))]
    if missing:
        raise ConfigurationError(
            f"sensor={sensor!r}: not a sensor (it has no {', '.join(missing)}). Pass a "
            "gpupool sensor (a subclass of gpupool._sensors.base.Sensor, such as "
            "gpupool.testing.SimulatedHost(...).sensor()), or None for the default."
        )


def check_python_home(env: Mapping[str, str]) -> None:
    """Refuse an ``env`` ``PYTHONHOME`` under which no worker could start.

    Python looks for its standard library in ``<prefix>/lib/pythonX.Y`` under the
    ``PYTHONHOME`` prefix (``prefix:exec_prefix``); without it the interpreter
    exits with code 1 before running any code of gpupool's. An empty ``PYTHONHOME``
    is accepted: Python ignores it, as it ignores every empty ``PYTHON*`` variable.
    """
    home = env.get("PYTHONHOME")
    if not home or os.name != "posix":
        return
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    fix = (
        f"no worker could start (Python looks for its standard library there). Pass the "
        f"prefix of this Python (sys.prefix is {sys.base_prefix!r}), or leave PYTHONHOME out."
    )
    for prefix in home.split(":"):
        if not os.path.isdir(prefix):
            raise ConfigurationError(
                f"env: PYTHONHOME={home!r}: the directory {prefix!r} does not exist; {fix}"
            )
        if not os.path.isdir(os.path.join(prefix, "lib", version)):
            raise ConfigurationError(
                f"env: PYTHONHOME={home!r}: {prefix!r} has no lib/{version}; {fix}"
            )
