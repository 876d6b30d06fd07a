"""A second local user for the sharing tests: a forked child that becomes ``nobody``.

Possible where the suite runs as root (as in CI); elsewhere the tests that need it are
skipped with the reason (:data:`needs_nobody`).
"""

from __future__ import annotations

import os
import pwd
import select
from collections.abc import Callable

import pytest


def _nobody() -> tuple[int, int] | None:
    """(uid, gid) of ``nobody`` where this process may become it (root), else ``None``."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


NOBODY = _nobody()
needs_nobody = pytest.mark.skipif(
    NOBODY is None, reason="needs root to run a child as the user 'nobody' (a second user)"
)


class Forked:
    """A forked child that runs ``work`` (as ``nobody`` when given a user), says "ready"
    through a pipe, then runs ``loop`` over and over (when given) until :meth:`close`."""

    def __init__(
        self,
        work: Callable[[], None],
        user: tuple[int, int] | None = None,
        loop: Callable[[], None] | None = None,
    ) -> None:
        ready_r, ready_w = os.pipe()
        self.hold_r, self.hold_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(ready_r)
                os.close(self.hold_w)
                if user is not None:
                    os.setgroups([])
                    os.setgid(user[1])
                    os.setuid(user[0])
                work()
                os.write(ready_w, b"ready\n")
                if loop is not None:
                    while not select.select([self.hold_r], [], [], 0)[0]:
                        loop()
                os.read(self.hold_r, 1)  # until the test closes its end
                code = 0
            except BaseException as exc:
                os.write(ready_w, f"error {exc!r}\n".encode())
            finally:
                os._exit(code)
        self.pid = pid
        os.close(ready_w)
        os.close(self.hold_r)
        with os.fdopen(ready_r) as ready:
            self.line = ready.readline().strip()

    def close(self) -> None:
        if self.hold_w >= 0:
            os.close(self.hold_w)
            self.hold_w = -1
            os.waitpid(self.pid, 0)
