"""Several keys on one card: the key whose pending work would take longest runs first, and
the others leave it room (pure core; a discrete-event run of the planner, simulated seconds)."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool._core.census import CardCensus
from gpupool._core.events import Decision
from gpupool._core.peak import PeakReport
from gpupool._core.planner import CardReading, Planner, PlannerConfig, Start
from gpupool._core.policy import AskTable, Policy
from gpupool._core.units import GiB, MiB
from support import card_census, census_of

TOTAL_BYTES = 40 * GiB
CO_TENANT_BYTES = 7 * GiB
OWN_BYTES = 3 * GiB


@dataclass(frozen=True)
class Job:
    key: str
    peak_bytes: int
    duration_s: float


@dataclass
class Run:
    """What a simulated run did: its makespan, the most of each key at once, the records."""

    makespan_s: float = 0.0
    most_at_once: dict[str, int] = field(default_factory=dict)
    records: list[Decision] = field(default_factory=list)
    finished: int = 0


def learned_planner(
    cards: list[CardCensus], records: list[Decision], *, estimate_bytes: int, max_workers: int
) -> Planner:
    """A constructed planner with the learned margin on ``cards`` (64 CPUs, 512 GiB of RAM)."""
    policy = Policy(learned=True)
    planner = Planner(
        census=census_of(cards, cpus=64, available_ram_bytes=512 * GiB),
        asks=AskTable(policy=policy, default_estimate_bytes=estimate_bytes),
        config=PlannerConfig(
            max_workers=max_workers, reserve_bytes=policy.reserve_bytes, parent_pid=1
        ),
        emit=records.append,
    )
    planner.construct(0.0)
    return planner


def simulate(
    jobs: list[Job],
    hints: dict[str, int],
    *,
    max_workers: int = 8,
    seed: int = 0,
    jitter: float = 0.03,
) -> Run:
    """Drive a learned-margin planner through ``jobs`` on one 40 GiB card (7 GiB co-tenant,
    3 GiB parent) in simulated time: each task holds its peak for its duration (times a
    jitter up to ``jitter``, and 5 ms of dispatch), ends one at a time, and reports its peak.
    Asserts the bound at every start."""
    out = Run()
    card = card_census(
        total_bytes=TOTAL_BYTES,
        free_bytes=TOTAL_BYTES - CO_TENANT_BYTES - OWN_BYTES,
        own_bytes=OWN_BYTES,
    )
    planner = learned_planner(
        [card], out.records, estimate_bytes=max(hints.values()), max_workers=max_workers
    )
    policy = planner.state.asks.policy
    for task, job in enumerate(jobs):
        planner.submit(task, job.key, hints.get(job.key))
    rng = random.Random(seed)
    ends: list[tuple[float, int]] = []
    now = 0.0
    terms = CO_TENANT_BYTES + OWN_BYTES + policy.reserve_bytes
    while True:
        while True:
            held = sum(jobs[t].peak_bytes for t in planner.state.running)
            planner.readings.observe(
                0,
                CardReading(
                    free_bytes=TOTAL_BYTES - CO_TENANT_BYTES - OWN_BYTES - held,
                    used_bytes=CO_TENANT_BYTES + OWN_BYTES + held,
                    process_bytes={1: OWN_BYTES}
                    | {1000 + t: jobs[t].peak_bytes for t in planner.state.running},
                ),
                now,
            )
            verdict = planner.next_start(now)
            if not isinstance(verdict, Start):
                break
            if not verdict.past_bound:
                booked = sum(r.booked_bytes for r in planner.state.running.values())
                assert booked + verdict.booked_bytes + terms <= TOTAL_BYTES
            planner.started(verdict.task, verdict.device, 1000 + verdict.task, now)
            job = jobs[verdict.task]
            heapq.heappush(
                ends, (now + job.duration_s * (1 + rng.uniform(0, jitter)) + 0.005, verdict.task)
            )
            running = [jobs[t].key for t in planner.state.running]
            for key in set(running):
                out.most_at_once[key] = max(out.most_at_once.get(key, 0), running.count(key))
        if not ends:
            break
        now, task = heapq.heappop(ends)
        report = PeakReport(
            device=0, device_peak_bytes=jobs[task].peak_bytes, device_source="simulator"
        )
        planner.finished(task, report, now)
        out.finished += 1
    out.makespan_s = now
    assert not planner.state.pending and not planner.state.running
    return out


def mixed_jobs(large: int = 20, small: int = 20, seed: int = 12) -> list[Job]:
    """The benchmark's mixed workload: 9 GiB and 2 GiB tasks of 0.5 s, shuffled."""
    jobs = [Job("large", 9 * GiB, 0.5)] * large + [Job("small", 2 * GiB, 0.5)] * small
    random.Random(seed).shuffle(jobs)
    return jobs


HINTS = {"large": 11 * GiB, "small": int(2.5 * GiB)}


def test_the_key_with_most_work_left_runs_at_its_width_and_the_run_takes_eight_waves() -> None:
    """29.75 GiB of room: 9.06 GiB large and 2.06 GiB small asks once measured. Started in
    queue order the card settles at 2 large + 5 small, the small ones run out first and the
    last large ones run three at a time alone: nine waves. With the large key first (its 20
    tasks at 3 at once take longest) and the small ones leaving it room, 3 large + 1 small
    run together and the 40 tasks take the eight waves the bytes allow."""
    run = simulate(mixed_jobs(), HINTS)
    assert run.finished == 40
    assert run.most_at_once["large"] == 3
    waves = run.makespan_s / 0.5
    assert waves < 8.5, f"{waves:.2f} waves"
    held = [r for r in run.records if r.event == "critical_wait"]
    assert held, "the small key was never held back"
    record = held[0].to_dict()
    assert record["critical_key"] == "large" and record["held_key"] == "small"
    assert record["critical_width"] == 3
    assert record["critical_time_left_s"] > record["runner_up_time_left_s"]
    assert "waits rather than take that room" in record["reason"]


def test_until_every_key_was_timed_the_queue_order_stands() -> None:
    """No task has ended yet: the first wave starts in the order submitted (the first fits)."""
    records: list[Decision] = []
    card = card_census(total_bytes=TOTAL_BYTES, free_bytes=30 * GiB, own_bytes=OWN_BYTES)
    planner = learned_planner([card], records, estimate_bytes=11 * GiB, max_workers=8)
    order = ["small", "small", "large", "small", "large"]
    for task, key in enumerate(order):
        planner.submit(task, key, HINTS[key])
    started = []
    while isinstance(verdict := planner.next_start(0.0), Start):
        planner.started(verdict.task, verdict.device, 100 + verdict.task, 0.0)
        started.append(verdict.task)
    assert started == [0, 1, 2, 3, 4]
    assert not [r for r in records if r.event == "critical_wait"]


@settings(max_examples=60, deadline=None)
@given(
    spec=st.lists(
        st.tuples(
            st.integers(1, 12),  # tasks
            st.integers(512, 14 * 1024),  # peak, MiB
            st.sampled_from([0.1, 0.25, 0.5, 1.0, 2.0]),  # duration, s
        ),
        min_size=2,
        max_size=4,
    ),
    max_workers=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    shuffled=st.booleans(),
)
def test_every_task_of_every_key_runs_and_the_bound_holds_at_every_start(
    spec: list[tuple[int, int, float]], max_workers: int, seed: int, shuffled: bool
) -> None:
    """Whatever the keys' counts, sizes and durations: every task starts and ends (no key is
    held back for good), and each start fits the bound."""
    jobs = [
        Job(f"k{i}", peak_mib * MiB, duration_s)
        for i, (count, peak_mib, duration_s) in enumerate(spec)
        for _ in range(count)
    ]
    if shuffled:
        random.Random(seed).shuffle(jobs)
    hints = {f"k{i}": int(peak_mib * MiB * 1.2) for i, (_, peak_mib, _) in enumerate(spec)}
    run = simulate(jobs, hints, max_workers=max_workers, seed=seed, jitter=0.2)
    assert run.finished == len(jobs)


def test_a_card_the_critical_key_cannot_use_still_takes_the_other_keys_tasks() -> None:
    """Two cards: 40 GiB and 12 GiB. The large key's 19.8 GiB ask fits only the first; eight
    small tasks (3.3 GiB) hold it. Ending two of them lets a large task start there, so the
    small key leaves that card the room; the second card, where no large task can ever run,
    still takes small tasks meanwhile (three of them) instead of standing empty."""
    records: list[Decision] = []
    cards = [
        card_census(device=0, total_bytes=40 * GiB, free_bytes=40 * GiB),
        card_census(device=1, total_bytes=12 * GiB, free_bytes=12 * GiB),
    ]
    planner = learned_planner(cards, records, estimate_bytes=20 * GiB, max_workers=16)
    task = 0

    def submit(key: str, count: int, hint: int | None = None) -> None:
        nonlocal task
        for _ in range(count):
            planner.submit(task, key, hint)
            task += 1

    def start_all(now: float) -> list[int]:
        started = []
        while isinstance(verdict := planner.next_start(now), Start):
            planner.started(verdict.task, verdict.device, 100 + verdict.task, now)
            started.append(verdict.task)
        return started

    submit("large", 1, 20 * GiB)
    submit("small", 1, 4 * GiB)
    start_all(0.0)
    for ran, (peak, now) in zip(
        list(planner.state.running), [(18 * GiB, 1.0), (3 * GiB, 2.0)], strict=True
    ):
        planner.finished(ran, PeakReport(device=0, device_peak_bytes=peak, device_source="s"), now)
    submit("small", 8)
    assert len(start_all(2.0)) == 8
    assert {r.device for r in planner.state.running.values()} == {0}
    submit("large", 10)
    submit("small", 20)
    start_all(2.0)
    on_second = [r for r in planner.state.running.values() if r.device == 1]
    assert [r.key for r in on_second] == ["small"] * 3
    assert not [r for r in planner.state.running.values() if r.key == "large"]
    assert sum(1 for r in planner.state.running.values() if r.device == 0) == 8
    assert [r for r in records if r.event == "critical_wait"]
