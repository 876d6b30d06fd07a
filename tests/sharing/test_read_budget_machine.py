"""The read budget of other users' files, as a state machine: users' files change at random
and steps read them; after every step, what was read is within the budget, no unchanged text
is parsed again, and every change is seen within as many steps as there are files.

Real files owned by other uids (root makes them theirs); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpupool._core.bookings import PoolBooking
from gpupool._sensors.booking_foreign import ForeignReader, ForeignStep

UUID = "GPU-00000000-1111-2222-3333-666666666666"
FIRST_UID = 40_000
#: Every file's text has this length (the labels are padded), so that a budget of one
#: file's bytes reads exactly one changed file a step.
TEXT_BYTES = 400

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to make files owned by other uids (other users)"
)


def _text(uid: int, version: int) -> bytes:
    row = {
        "pid": 4_000_000 + uid,
        "start": "1",
        "label": f"v{version}",
        "updated_s": 1.0,
        "tasks": [[4_100_000, "k", 1, 0]],
    }
    body = json.dumps({"version": 1, "card_uuid": UUID, "pools": {f"{uid}.1": row}})
    return body.ljust(TEXT_BYTES).encode()


class ReadBudgetMachine(RuleBasedStateMachine):
    """Files of ``files`` users, a reader whose byte budget holds one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="gpupool-budget-"))
        self.versions: dict[int, int] = {}
        self.changed_at: dict[int, int] = {}  # uid -> the step its unseen change was made
        self.seen: dict[int, int] = {}  # uid -> the version the reader last gave
        self.steps = 0
        self.last: ForeignStep | None = None
        self.parses_before = 0
        self.pending_before = 0

    @initialize(files=st.integers(1, 4))
    def build(self, files: int) -> None:
        self.reader = ForeignReader(budget_bytes=TEXT_BYTES, budget_s=3600.0, share=1.0)
        for uid in range(FIRST_UID, FIRST_UID + files):
            self.versions[uid] = 0
            self._write(uid)

    def _write(self, uid: int) -> None:
        path = self.root / f"{UUID}.uid{uid}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, _text(uid, self.versions[uid]), 0)  # in place: same inode and size
            os.fchown(fd, uid, uid)
        finally:
            os.close(fd)
        self.changed_at.setdefault(uid, self.steps)

    @rule(data=st.data())
    def change(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(sorted(self.versions)))
        self.versions[uid] += 1
        self._write(uid)

    @rule()
    def step(self) -> None:
        self.parses_before = self.reader.parses
        # Files whose text is not the one the reader last gave: the most a step may parse.
        self.pending_before = sum(
            1 for uid, version in self.versions.items() if self.seen.get(uid) != version
        )
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:

            def keep_all(pools: dict[str, PoolBooking], uid: int) -> None:
                pass

            self.last = self.reader.read(fd, UUID, f"{UUID}.uid", -1, keep_all)
        finally:
            os.close(fd)
        self.steps += 1
        for row in self.last.rows:
            uid = int(row.pool_id.split(".")[0])
            self.seen[uid] = int(row.label[1:])
            if self.seen[uid] == self.versions[uid]:
                self.changed_at.pop(uid, None)

    @invariant()
    def within_the_budget(self) -> None:
        if self.last is not None:
            assert self.last.read_bytes <= self.reader.budget_bytes
            assert not self.last.refused

    @invariant()
    def no_text_is_parsed_twice(self) -> None:
        if self.last is not None:
            assert self.reader.parses - self.parses_before <= self.pending_before

    @invariant()
    def every_change_is_seen_in_turn(self) -> None:
        for uid, since in self.changed_at.items():
            assert self.steps - since <= len(self.versions), (uid, since, self.steps)

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


ReadBudgetMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReadBudget = ReadBudgetMachine.TestCase
