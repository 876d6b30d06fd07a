"""The planner's memos against a fresh computation, over the terms the state machine in
``test_planner.py`` never varies: other pools' bookings (and theirs at the census), sized
tasks, unified memory with a child RSS that moves the ceiling, and failed readings."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_fit_memo import walked_fit
from test_planner import PlannerMachine

from gpupool._core.bookings import OtherPools, PoolBooking, TaskBooking
from gpupool._core.events import TaskIdentity
from gpupool._core.planner import Planner, PlannerConfig
from gpupool._core.planner.fit import _card_bound, card_bound, card_widths
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB, MiB
from support import card_census, census_of

SIZES = (1.0, 2.0, 3.0, 8.0, 20.0)
#: The key whose tasks are given sizes (its runs are booked at their sized asks).
SIZED = "sized"


class MemoTermsMachine(PlannerMachine):
    @initialize(
        totals=st.lists(st.integers(20, 80), min_size=1, max_size=3),
        co_tenant_gib=st.integers(0, 10),
        estimate_gib=st.integers(1, 12),
        max_workers=st.integers(1, 8),
        learned=st.booleans(),
        unified=st.booleans(),
    )
    def build_terms(self, totals, co_tenant_gib, estimate_gib, max_workers, learned, unified):
        cards = [
            card_census(
                device=i,
                total_bytes=t * GiB,
                free_bytes=(t - co_tenant_gib) * GiB,
                own_bytes=0,
                unified=unified,
            )
            for i, t in enumerate(totals)
        ]
        self.census = census_of(cards, cpus=4, available_ram_bytes=64 * GiB)
        self.asks = AskTable(
            policy=Policy(reserve_bytes=256 * MiB, learned=learned),
            default_estimate_bytes=estimate_gib * GiB,
        )
        self.config = PlannerConfig(
            max_workers=max_workers,
            reserve_bytes=256 * MiB,
            parent_pid=1,
            room_wait_s=30.0,
            max_retries=3,
        )
        self.planner = Planner(
            census=self.census, asks=self.asks, config=self.config, emit=self.emitted
        )
        self.planner.construct(0.0)
        self.live_used = {i: co_tenant_gib * GiB for i in range(len(totals))}
        self.own_bytes = {i: 0 for i in range(len(totals))}
        self.other_pid = 5000

    def build(self, *args, **kwargs):  # the parent's initializer is replaced by build_terms
        raise AssertionError

    @rule(size=st.sampled_from(SIZES))
    def submit_sized(self, size: float) -> None:
        identity = TaskIdentity(task_id=self.next_task, entry=self.next_task, label=SIZED)
        self.planner.submit(self.next_task, SIZED, None, size=size, identity=identity)
        self.next_task += 1
        self.submitted += 1

    @rule(
        device=st.integers(0, 2),
        booked_gib=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=3),
        census=st.booleans(),
    )
    def others(self, device: int, booked_gib: list[tuple[int, int]], census: bool) -> None:
        if device >= len(self.census.cards):
            return
        uuid = self.census.cards[device].uuid
        tasks = []
        for gib, reached_gib in booked_gib:
            self.other_pid += 1
            tasks.append(
                TaskBooking(
                    worker_pid=self.other_pid,
                    key="o",
                    booked_bytes=gib * GiB,
                    reached_bytes=reached_gib * GiB,
                )
            )
        pool = PoolBooking(
            pool_id="9.1", pid=9, start="s", label="other", updated_s=0.0, tasks=tuple(tasks)
        )
        self.planner.neighbours.observe_others(
            device, OtherPools(card_uuid=uuid, pools=(pool,)), self.now_s, census=census
        )

    @rule(device=st.integers(0, 2))
    def sensor_fails(self, device: int) -> None:
        if device < len(self.census.cards):
            self.planner.readings.observe_error(device, "nvml: gone", self.now_s)

    @invariant()
    def a_keys_bookings_are_its_price_together(self) -> None:
        """As the state machine's, for the unsized keys; a sized task is booked at its ask."""
        if not hasattr(self, "planner"):
            return
        groups: dict[tuple[int, str], list[int]] = {}
        for run in self.planner.state.running.values():
            if run.device is None:
                continue
            if run.key == SIZED:
                assert run.booked_bytes == self.asks.ask_for(SIZED, run.size).ask_bytes
                continue
            groups.setdefault((run.device, run.key), []).append(run.booked_bytes)
        for (_, key), booked in groups.items():
            ask = self.asks.ask(key)
            assert sum(booked) == ask.together_bytes(len(booked)) <= len(booked) * ask.ask_bytes

    @invariant()
    def sized_asks_and_their_fits_are_fresh(self) -> None:
        if not hasattr(self, "planner"):
            return
        planner = self.planner
        terms = {"reserve_bytes": self.config.reserve_bytes, "ceiling": planner.state.ceiling}
        slots = planner.state.ceiling.value - len(planner.state.running)
        fresh_table = AskTable(
            policy=self.asks.policy,
            default_estimate_bytes=self.asks.default_estimate_bytes,
            rooms_bytes=self.asks.rooms_bytes,
        )
        fresh_table._keys = self.asks._keys
        for size in SIZES:
            ask = self.asks.ask_for(SIZED, size)
            assert ask == fresh_table.ask_for(SIZED, size), size
            fits = []
            for card in planner.state.cards:
                assert card_bound(card, ask, **terms) == _card_bound(card, ask, **terms)
                walked = walked_fit(card, ask, list(card.runs.values()), slots=slots, **terms)
                assert planner.views.fit(card.index, ask) == walked
                fits.append(walked)
            assert planner.views.decide(ask) == card_widths(fits, planner.state.ceiling)


MemoTermsMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemoTerms = MemoTermsMachine.TestCase
