"""A task defined in the script run as ``__main__`` fails with its file, line and source shown.

cloudpickle sends such a function by value; the traceback the worker formats
must still name the script and quote the failing line, as the standard pool's does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from support import run_script

SCRIPT = """\
from gpupool import GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


def bad(x):
    y = x + 1
    raise ValueError(f"bad value {y}")  # the failing line


if __name__ == "__main__":
    with SimulatedHost(devices=[SimulatedDevice(total="8GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(task_peak="1GiB") as ex:
            ex.submit(bad, 1).result()
"""


def test_a_main_function_traceback_shows_the_script_line_and_source(tmp_path: Path):
    """The error text names the script's path, the line number and the line's source."""
    done = run_script(tmp_path, "failing_script.py", textwrap.dedent(SCRIPT), timeout_s=120)
    script = tmp_path / "failing_script.py"
    assert done.returncode != 0
    err = done.stderr
    assert f'File "{script}", line 7, in bad' in err, err[-4000:]
    assert 'raise ValueError(f"bad value {y}")  # the failing line' in err, err[-4000:]
    assert "<dynamic-code>" not in err
    assert "ValueError: bad value 2" in err
