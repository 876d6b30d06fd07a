"""This process's PID as the probe and the simulator's ledger ask for it: renewed at each fork."""

from __future__ import annotations

import os

import pytest

from gpupool._sensors.own_pid import own_pid
from support import answered_in_a_fork


def test_own_pid_is_this_process():
    assert own_pid() == os.getpid()


# Python 3.12+ warns that forking a process with threads may deadlock; the child here only
# writes one number and leaves.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_child_forked_through_python_knows_its_own_pid():
    """``os.fork``'s child answers its own PID, not its parent's; the parent's is unchanged."""
    child, answered = answered_in_a_fork(lambda: str(own_pid()).encode())
    assert int(answered) == child
    assert own_pid() == os.getpid() != child
