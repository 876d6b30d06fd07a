"""A pool built from its options: the sensor and the census, the planner's first widths,
the decision log, the booking table and the dispatcher (process layer).

:func:`build_dispatcher` is the constructor's I/O, done once: the cards are read
before any child of the pool exists (the census is never retaken). The options
(:mod:`gpupool._pool.options`) were checked before it runs; it checks only what needs
the cards (a reserve as large as one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpupool._child.probe import ALLOCATOR_CAP_NOTE
from gpupool._core.planner import Planner, PlannerConfig
from gpupool._core.policy import AskTable
from gpupool._core.units import format_size
from gpupool._errors import ConfigurationError, WidthError
from gpupool._observe.log import DecisionLog
from gpupool._pool.dispatcher import DeviceState, Dispatcher
from gpupool._pool.options import PoolOptions
from gpupool._sensors.select import default_sensor

if TYPE_CHECKING:
    from gpupool._core.census import Census
    from gpupool._sensors.base import DeviceInfo, Sensor

__all__ = ["build_dispatcher", "read_cards", "worker_environment"]


def build_dispatcher(options: PoolOptions) -> Dispatcher:
    """The pool's dispatcher, its first widths decided and recorded, not yet started.

    Raises:
        ConfigurationError: ``reserve`` is not smaller than a card, or the census refused
            the ``devices`` selection.
        WidthError: ``strict=True`` and the bound is narrower than ``max_workers``.
    """
    sensor, census, infos = read_cards(options.sensor, options.devices)
    reserve_bytes = options.policy.reserve_bytes
    _check_reserve(census, reserve_bytes)
    devices = [
        DeviceState(i, info, card)
        for i, (info, card) in enumerate(zip(infos, census.cards, strict=True))
    ]
    peak_bytes = options.task_peak_bytes
    if peak_bytes is None:
        peak_bytes = Planner.price_without_peak(census, reserve_bytes)
    workers = options.workers
    log = DecisionLog(options.log_path, settings=options.settings())
    config = PlannerConfig(
        max_workers=options.max_workers or census.host.cpus,
        max_workers_given=options.max_workers is not None,
        fixed_width=options.width,
        strict=options.strict,
        retry_oom=options.retry_oom,
        max_retries=options.max_retries,
        room_wait_s=options.room_wait_s,
        reserve_bytes=reserve_bytes,
        parent_pid=os.getpid(),
    )
    from gpupool._sensors.bookings import new_pool_id, open_booking_table

    share, directory = options.share_bookings, options.bookings_dir
    dispatcher = Dispatcher(
        census=census,
        devices=devices,
        sensor=sensor,
        asks=AskTable(policy=options.policy, default_estimate_bytes=peak_bytes),
        config=config,
        max_tasks_per_child=workers.max_tasks_per_child,
        initializer=workers.initializer,
        log=log,
        env=worker_environment(workers.env),
        cap_allocator=workers.cap_allocator,
        bookings=open_booking_table(share=share, directory=directory, sensor=sensor)
        if devices
        else None,
        pool_id=new_pool_id(),
    )
    try:
        _decide_first_widths(dispatcher, priced=options.task_peak_bytes is not None)
    except BaseException:
        dispatcher.close()  # no thread will: give its descriptors back
        raise
    return dispatcher


def read_cards(
    sensor: Sensor | None, devices: Sequence[int | str] | None
) -> tuple[Sensor, Census, tuple[DeviceInfo, ...]]:
    """The sensor the pool reads (the one given, else the default: NVML, or the simulator
    inside a ``SimulatedHost``) and its census of the cards the pool may use: ``devices``,
    among those the sensor's visible-devices variable leaves visible."""
    chosen = sensor if sensor is not None else default_sensor()
    from gpupool._sensors.census import read_census

    census, infos = read_census(
        chosen,
        devices=devices,
        visible_devices=chosen.read_visible_devices(),
        pid=os.getpid(),
    )
    return chosen, census, infos


def worker_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Every worker's extra variables: JAX told not to preallocate 75 % of the card, then
    ``env=``, which wins (the sensor adds its own pinning when a worker starts)."""
    worker_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    worker_env.update(env)
    return worker_env


def _check_reserve(census: Census, reserve_bytes: int) -> None:
    for card in census.cards:
        if card.total_bytes is not None and reserve_bytes >= card.total_bytes:
            raise ConfigurationError(
                f"reserve={format_size(reserve_bytes)} is not smaller than card "
                f"{card.device}'s {format_size(card.total_bytes)}; pass a smaller reserve."
            )


def _decide_first_widths(dispatcher: Dispatcher, *, priced: bool) -> None:
    """The construction records: each card's first width, from the census and the bookings
    other pools hold now. Raises :class:`WidthError` where ``strict=True`` refuses it."""
    dispatcher.read_census_terms()
    note = "" if priced else " (no task_peak: priced at the room)"
    extra = {"allocator_cap": ALLOCATOR_CAP_NOTE} if dispatcher.cap_allocator else {}
    # Time 0 is the census: the construction records say so, however long
    # the readings beside it took on a loaded host.
    refused = dispatcher.planner.construct(0.0, note=note, extra=extra)
    if refused is not None:
        raise WidthError(refused.reason, decision=refused.decision.to_dict())
