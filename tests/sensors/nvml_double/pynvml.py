"""``import pynvml`` where this directory is first on the path: the simulated host's NVML double.

``bench/gpu_check.py --dry-run`` puts this directory, then ``tests/sensors``, first on
its workers' ``PYTHONPATH``, so that the real NVML sensor reads a simulated host
(:mod:`simulated_pynvml`). The module replaces itself with the double (the import
statement returns what ``sys.modules`` holds once the module has run).
"""

from __future__ import annotations

import sys

from simulated_pynvml import SimulatedPynvml

sys.modules[__name__] = SimulatedPynvml()
