"""The command line: ``gpupool plan | census | top | demo | postmortem | plot | run | forget``.

The only module that prints.

Each subcommand is a function ``_cmd_<name>(args) -> int`` registered in
:func:`build_parser`; ``main`` returns the exit status, one of:

====  =====================================================================
0     done
1     the command ran and reports a failure (no sensor, the demo's pool ran
      a card out, the plot cannot be drawn or written); ``gpupool run``: 1-100
      commands failed, 101 more than 100 (as GNU parallel)
2     a usage error: a bad flag or value (argparse's own status), a value
      the pool would refuse, a ``--run`` that names no run
3     the input is not a readable decision log (a FIFO, a device, not JSON,
      a newer schema, an unreadable file)
4     the decision log is empty
130   interrupted (Ctrl-C)
141   standard output was closed early (``gpupool postmortem LOG | head``)
====  =====================================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool._core.bound import MAX_WORKERS_LIMIT, Ceiling, WidthDecision
from gpupool._core.census import CardCensus, Census, HostCensus
from gpupool._core.planner import DEFAULT_CHILD_RSS_PRIOR_BYTES, Planner, PlannerConfig, what_if
from gpupool._core.policy import DEFAULT_RESERVE_BYTES, Ask, AskTable, Policy
from gpupool._core.units import format_size, parse_pool_size, parse_size
from gpupool._errors import ConfigurationError, InvalidSizeError, SensorError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpupool._sensors.base import DeviceInfo, ProcessReading, Sensor

__all__ = [
    "EXIT_BAD_LOG",
    "EXIT_BROKEN_PIPE",
    "EXIT_EMPTY_LOG",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BAD_LOG = 3
EXIT_EMPTY_LOG = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

#: The plot formats, from the output's suffix.
PLOT_FORMATS = ("png", "svg", "pdf")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    from gpupool import __version__

    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="Pack GPU work onto cards by measured memory.",
        epilog=(
            "exit status: 0 done, 1 a failure reported, 2 usage error, 3 not a readable "
            "decision log, 4 an empty log, 130 interrupted, 141 output closed early"
        ),
    )
    parser.add_argument("--version", action="version", version=f"gpupool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_census(sub)
    _add_top(sub)
    _add_plan(sub)
    _add_postmortem(sub)
    _add_plot(sub)
    _add_demo(sub)
    _add_run(sub)
    _add_docs(sub)
    _add_forget(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    try:
        status: int = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing more, and let the
        # interpreter's last flush go to /dev/null instead of raising again.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        sys.stderr.write("gpupool: interrupted\n")
        return EXIT_INTERRUPTED
    return status


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _json_out(value: object) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


# -- gpupool census ------------------------------------------------------------


def _add_census(sub: Any) -> None:
    census = sub.add_parser(
        "census",
        help="show every device's memory and the host's CPUs and RAM, with their sources",
        description=(
            "Read every device the pool could use (narrowed by CUDA_VISIBLE_DEVICES) as a "
            "pool would at construction: total, reserved, used, free, this process's own "
            "bytes and the co-tenants' (total - free - own), each with its source."
        ),
    )
    census.add_argument("--json", action="store_true", help="print one JSON object")
    census.set_defaults(handler=_cmd_census)


def _host_json(host: HostCensus) -> dict[str, Any]:
    return {
        "cpus": host.cpus,
        "cpu_source": host.cpu_source,
        "available_ram_bytes": host.available_ram_bytes,
        "ram_source": host.ram_source,
    }


def _card_json(
    card: CardCensus, info: DeviceInfo, rows: tuple[ProcessReading, ...] | None, rows_note: str
) -> dict[str, Any]:
    return {
        "device": card.device,
        "index": info.index,
        "mig_index": info.mig_index,
        "uuid": card.uuid,
        "name": card.name,
        "mig": card.mig,
        "unified": card.unified,
        "total_bytes": card.total_bytes,
        "reserved_bytes": card.reserved_bytes,
        "used_bytes": card.used_bytes,
        "free_bytes": card.free_bytes,
        "own_bytes": card.own_bytes,
        "co_tenant_bytes": card.co_tenant_bytes,
        "sources": {
            "total_bytes": card.source,
            "reserved_bytes": card.source if card.reserved_bytes is not None else None,
            "used_bytes": f"total - free ({card.source})",
            "free_bytes": card.source,
            "own_bytes": card.own_source,
            "co_tenant_bytes": "total - free - own",
            "processes": rows_note,
        },
        "processes": (
            None
            if rows is None
            else [{"pid": row.pid, "used_bytes": row.used_bytes} for row in rows]
        ),
        "reason": card.reason,
    }


def _read_rows(sensor: Sensor, info: DeviceInfo) -> tuple[tuple[ProcessReading, ...] | None, str]:
    try:
        rows = sensor.read_processes(info)
    except SensorError as exc:
        return None, f"unreadable: {exc}"
    if rows is None:
        return None, f"{sensor.name}: not given by the driver"
    return rows, f"{sensor.name} per-process rows (compute and graphics, by PID)"


def _cmd_census(args: argparse.Namespace) -> int:
    from gpupool._sensors.census import live_census

    try:
        sensor, census, infos = live_census()
    except (SensorError, ConfigurationError) as exc:
        sys.stderr.write(f"gpupool census: {exc}\n")
        return EXIT_FAILURE
    try:
        devices = []
        for card, info in zip(census.cards, infos, strict=False):
            rows, note = _read_rows(sensor, info)
            devices.append(_card_json(card, info, rows, note))
        _add_bookings(sensor, devices)
    finally:
        sensor.close()
    if args.json:
        _json_out(
            {
                "driver": census.driver,
                "sensor": census.sensor,
                "reason": census.reason,
                "device_count": len(census.cards),
                "devices": devices,
                "host": _host_json(census.host),
            }
        )
        return 0
    if not census.driver:
        _out(f"no device: {census.reason}")
        _out("a pool here is a host-bounded process pool (no card to pack).")
    elif not census.cards:
        _out(f"no device visible{f': {census.reason}' if census.reason else ''}")
    elif census.reason:
        _out(f"note: {census.reason}")
    for device in devices:
        _print_card(device)
    host = census.host
    _out("host:")
    _out(f"  usable CPUs      {host.cpus:<12} {host.cpu_source}")
    _out(f"  available RAM    {format_size(host.available_ram_bytes):<12} {host.ram_source}")
    return 0


def _add_bookings(sensor: Sensor, devices: list[dict[str, Any]]) -> None:
    """Every live pool's bookings on each card, from the host-wide booking table."""
    from gpupool._sensors.bookings import open_booking_table

    table = open_booking_table(share=True, directory=None, sensor=sensor)
    if table is None:
        return
    try:
        for device in devices:
            rows = table.others(device["uuid"])
            device["bookings_table"] = str(table.directory)
            device["pools"] = (
                None
                if rows is None
                else [
                    {
                        "pool_id": pool.pool_id,
                        "pid": pool.pid,
                        "label": pool.label,
                        "updated_s": pool.updated_s,
                        "booked_bytes": pool.booked_bytes,
                        "reached_bytes": pool.reached_bytes,
                        "unreached_bytes": pool.unreached_bytes,
                        "tasks": [dataclasses.asdict(task) for task in pool.tasks],
                    }
                    for pool in rows.pools
                ]
            )
            device["sources"]["pools"] = (
                f"booking table in {table.directory}"
                if rows is not None
                else f"unknown: {table.unavailable_reason or 'the booking table failed'}"
            )
    finally:
        table.close()


def _print_pools(device: dict[str, Any]) -> None:
    pools = device.get("pools", ())
    if pools is None:
        _out(f"  pools            {device['sources']['pools']}")
        return
    if "pools" not in device:
        return
    booked = sum(pool["booked_bytes"] for pool in pools)
    reached = sum(pool["reached_bytes"] for pool in pools)
    noun = "pool" if len(pools) == 1 else "pools"
    summary = (
        f"{len(pools)} {noun}, {format_size(booked)} booked, {format_size(reached)} reached"
        if pools
        else "none booked"
    )
    _out(f"  pools            {summary} ({device['sources']['pools']})")
    for pool in pools:
        _out(
            f"    pool {pool['pool_id']:<12} pid {pool['pid']:<8} {pool['label'] or '-':<16} "
            f"{len(pool['tasks'])} task(s)  {format_size(pool['booked_bytes'])} booked, "
            f"{format_size(pool['reached_bytes'])} reached"
        )


def _print_card(device: dict[str, Any]) -> None:
    kind = " (MIG instance)" if device["mig"] else ""
    kind += " (unified memory)" if device["unified"] else ""
    _out(
        f"device {device['device']}: NVML index {device['index']}{kind}, "
        f"{device['name']}, {device['uuid']}"
    )
    sources = device["sources"]
    for label, key in (
        ("total", "total_bytes"),
        ("reserved", "reserved_bytes"),
        ("used", "used_bytes"),
        ("free", "free_bytes"),
        ("own", "own_bytes"),
        ("co-tenant", "co_tenant_bytes"),
    ):
        source = sources[key] or "not given by the driver"
        _out(f"  {label:<16} {format_size(device[key]):<12} {source}")
    if device["processes"] is None:
        _out(f"  processes        {sources['processes']}")
    else:
        _out(f"  processes        {len(device['processes'])} ({sources['processes']})")
        for row in device["processes"]:
            _out(f"    pid {row['pid']:<10} {format_size(row['used_bytes'])}")
    _print_pools(device)
    if device["reason"]:
        _out(f"  note: {device['reason']}")


# -- gpupool top ---------------------------------------------------------------


def _add_top(sub: Any) -> None:
    from gpupool._observe.top import DEFAULT_INTERVAL_S, interval_type

    top = sub.add_parser(
        "top",
        help="a live view of every gpupool pool on this host's cards",
        description=(
            "Every card (total, used, co-tenants, room left) and every gpupool pool on it "
            "(booked and measured bytes, running tasks, waiting tasks, last decision), from "
            "the host's booking table and the sensor, redrawn in place (needs "
            "pip install 'gpupool[top]'); --once and --json work without it."
        ),
    )
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.add_argument(
        "--json",
        action="store_true",
        help="print JSON: one object with --once, else one line per refresh",
    )
    top.add_argument(
        "--interval",
        type=interval_type,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between refreshes, 0.1 to 3600 (default {DEFAULT_INTERVAL_S:g})",
    )
    top.set_defaults(handler=_cmd_top)


def _cmd_top(args: argparse.Namespace) -> int:
    from gpupool._commands.top import run_top

    return run_top(args, sys.stdout.write)


# -- gpupool plan --------------------------------------------------------------


def _size_type(flag: str, *, allow_zero: bool = True, pool: bool = False) -> Callable[[str], int]:
    """A size flag; ``pool``: one the pool takes too, refused over the pool's 1 PiB bound."""
    parse = parse_pool_size if pool else parse_size

    def convert(text: str) -> int:
        try:
            return parse(text, name=flag, allow_zero=allow_zero)
        except InvalidSizeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _count_type(flag: str) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}={text!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag}={text!r} must be at least 1")
        if value > MAX_WORKERS_LIMIT:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} must be at most {MAX_WORKERS_LIMIT} (a pool's most workers)"
            )
        return value

    return convert


def _add_plan(sub: Any) -> None:
    """``gpupool plan``'s parser."""
    plan = sub.add_parser(
        "plan",
        help="show the memory bound term by term and the width it implies",
        description=(
            "Price a pool: room = total - co-tenant - own high-water - reserve, width = "
            "min(floor(room / ask), ceiling). With --total, plan from the numbers given "
            "(what-if); without it, from this host's live census."
        ),
    )
    for flag, kind, text in _plan_flags():
        plan.add_argument(flag, type=kind, help=text)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(handler=_cmd_plan, parser=plan)


def _plan_flags() -> tuple[tuple[str, Callable[[str], int], str], ...]:
    """``gpupool plan``'s flags of a size or a count, in its help's order: (flag, type, help)."""
    size, count = _size_type, _count_type
    return (
        (
            "--total",
            size("--total", allow_zero=False),
            "card capacity (what-if mode: only the figures given, none of this host's)",
        ),
        ("--co-tenant", size("--co-tenant"), "bytes held by other processes (default 0)"),
        ("--own", size("--own"), "this (parent) process's device high-water (default 0)"),
        (
            "--reserve",
            size("--reserve", pool=True),
            f"bytes kept free (default {format_size(DEFAULT_RESERVE_BYTES)})",
        ),
        (
            "--task-peak",
            size("--task-peak", allow_zero=False, pool=True),
            "the estimated device peak of one task",
        ),
        (
            "--measured-peak",
            size("--measured-peak", allow_zero=False, pool=True),
            "a child's measured device peak: also plan the width after children report",
        ),
        (
            "--margin",
            size("--margin", pool=True),
            "margin over a measured peak (default: the policy's, the larger of 256 MiB and 10%%)",
        ),
        (
            "--max-workers",
            count("--max-workers"),
            "the pool's max_workers (default: the usable CPUs; what-if: what the card holds)",
        ),
        (
            "--cpus",
            count("--cpus"),
            "usable CPUs (default: this host's; what-if: no CPU term unless given)",
        ),
        (
            "--host-ram",
            size("--host-ram"),
            "available host RAM (default: this host's; what-if: no RAM term unless given)",
        ),
        (
            "--child-rss",
            size("--child-rss", allow_zero=False),
            "a child's host RSS high-water; with the host RAM it caps the width",
        ),
    )


def _bound_json(decision: WidthDecision) -> dict[str, Any]:
    bound = decision.bound
    return {
        "device": bound.device,
        "width": decision.width,
        "limit": decision.limit,
        "total_bytes": bound.total_bytes,
        "co_tenant_bytes": bound.co_tenant_bytes,
        "own_high_water_bytes": bound.own_high_water_bytes,
        "reserve_bytes": bound.reserve_bytes,
        "room_bytes": bound.room_bytes,
        "tasks_fit": bound.tasks_fit,
        "describe": decision.describe(),
    }


def _ceiling_json(ceiling: Ceiling) -> dict[str, Any]:
    return {
        "value": ceiling.value,
        "limit": ceiling.limit,
        "max_workers": ceiling.max_workers,
        "cpus": ceiling.cpus,
        "host_ram_bytes": ceiling.host_ram_bytes,
        "child_rss_bytes": ceiling.child_rss_bytes,
    }


#: The widest a plan without max_workers or a CPU count is planned at (what the cards hold):
#: the most workers a pool runs.
MAX_PLANNED_WIDTH = MAX_WORKERS_LIMIT


def _phase(
    census: Census,
    *,
    asks: AskTable,
    ask: Ask | None,
    config: PlannerConfig,
    planned_from_cards: bool = False,
) -> dict[str, Any]:
    """One width decision (estimated or measured) as a JSON-ready dict with every term: the
    planner's own, asked of a planner built on ``census`` (the plan prices nothing itself).

    ``planned_from_cards``: ``max_workers`` was not given and was planned at what the cards
    hold, so where it "set" a width the card's room did (its limit is named ``memory``)."""
    phase: dict[str, Any] = {
        "ask_bytes": None if ask is None else ask.ask_bytes,
        "ask_basis": None if ask is None else ask.basis,
        "ask": None if ask is None else ask.describe(),
        "estimate_bytes": None if ask is None else ask.estimate_bytes,
        "measured_peak_bytes": None if ask is None else ask.measured_peak_bytes,
        "margin_bytes": None if ask is None else ask.margin_bytes,
        "reserve_bytes": config.reserve_bytes,
    }
    if not census.cards or ask is None:
        answer = what_if(census, asks, config, None)
        phase.update(
            ceiling=_ceiling_json(answer.ceiling),
            width=answer.ceiling.value,
            limit=answer.ceiling.limit,
            devices=[],
        )
        return phase
    answer = what_if(census, asks, config, ask)
    decisions = [
        dataclasses.replace(decision, limit="memory")
        if planned_from_cards
        and decision.limit == "max_workers"
        and decision.width == decision.bound.tasks_fit
        else decision
        for decision in answer.decisions
    ]
    devices = [_bound_json(decision) for decision in decisions]
    phase["ceiling"] = _ceiling_json(answer.ceiling)
    phase["width"] = answer.width
    phase["devices"] = devices
    if len(devices) == 1:
        only = devices[0]
        for key in (
            "limit",
            "total_bytes",
            "co_tenant_bytes",
            "own_high_water_bytes",
            "room_bytes",
            "tasks_fit",
        ):
            phase[key] = only[key]
    else:
        phase["limit"] = "per-device"
    return phase


def _cmd_plan(args: argparse.Namespace) -> int:
    """``gpupool plan``: the width a pool would take, from the figures given or this host."""
    parser: argparse.ArgumentParser = args.parser
    _check_plan_flags(parser, args)
    reserve = DEFAULT_RESERVE_BYTES if args.reserve is None else args.reserve
    notes: list[str] = []
    census = _read_plan_census(parser, args, notes)
    if census is None:
        return EXIT_FAILURE
    _check_plan_reserve(parser, census, reserve)
    table, estimated_ask, measured_ask = _plan_asks(args, census, reserve)
    config = _decide_plan_config(args, census, table, measured_ask or estimated_ask, notes)
    # As _decide_plan_config: neither max_workers nor a CPU count, so the cards set it.
    planned = args.max_workers is None and args.cpus is None and args.total is not None
    estimated = _phase(
        census, asks=table, ask=estimated_ask, config=config, planned_from_cards=planned
    )
    measured = (
        None
        if measured_ask is None
        else _phase(census, asks=table, ask=measured_ask, config=config, planned_from_cards=planned)
    )
    if not census.cards:
        notes.append(
            "no device: a host-bounded process pool, as wide as the ceiling"
            if not census.driver
            else "no device is visible: a host-bounded process pool, as wide as the ceiling"
        )
    result: dict[str, Any] = {
        "mode": "what-if" if args.total is not None else "live",
        "driver": census.driver,
        "device_count": len(census.cards),
        **(measured if measured is not None else estimated),
        "estimated": estimated,
        "measured": measured,
        "notes": notes,
    }
    _show_plan(args, result, census, planned=planned)
    return 0


def _check_plan_reserve(parser: argparse.ArgumentParser, census: Census, reserve: int) -> None:
    """Refuse a reserve as large as a card (a usage error, exit 2)."""
    for card in census.cards:
        # The pool refuses this at construction (ConfigurationError): so does the plan.
        if card.total_bytes is not None and reserve >= card.total_bytes:
            parser.error(
                f"--reserve {format_size(reserve)} is not smaller than card {card.device}'s "
                f"{format_size(card.total_bytes)}; a pool refuses it. Pass a smaller reserve."
            )


def _plan_asks(
    args: argparse.Namespace, census: Census, reserve: int
) -> tuple[AskTable, Ask | None, Ask | None]:
    """The plan's ask table, and its task's ask from ``--task-peak`` and after
    ``--measured-peak`` (``None``: not given). Without ``--task-peak`` the table prices a
    task as a pool given no ``task_peak`` does (the roomiest card's room)."""
    if args.margin is not None:
        policy = Policy(margin_bytes=args.margin, margin_fraction=0.0, reserve_bytes=reserve)
    else:
        policy = Policy(reserve_bytes=reserve)
    default = args.task_peak
    if default is None:
        default = Planner.price_without_peak(census, reserve)
    table = AskTable(policy=policy, default_estimate_bytes=default)
    estimated_ask: Ask | None = None
    measured_ask: Ask | None = None
    if args.task_peak is not None:
        estimated_ask = table.ask("plan")
        if args.measured_peak is not None:
            measured_ask = table.measure("plan", args.measured_peak)
    return table, estimated_ask, measured_ask


def _show_plan(
    args: argparse.Namespace, result: dict[str, Any], census: Census, *, planned: bool
) -> None:
    """Print the plan: as JSON with ``--json``, else in words."""
    if args.json:
        _json_out(result)
    else:
        co_tenant = (
            "total - free - own"
            if args.total is None
            else "given"
            if args.co_tenant is not None
            else "not given: 0"
        )
        _print_plan(result, census.cards, co_tenant_source=co_tenant, planned=planned)


def _check_plan_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the flags that mean nothing without another (a usage error, exit 2)."""
    if args.total is None:
        for flag, value in (("--co-tenant", args.co_tenant), ("--own", args.own)):
            if value is not None:
                parser.error(f"{flag} is a what-if figure: give --total with it")
    if args.margin is not None and args.measured_peak is None:
        parser.error("--margin applies to a measured peak: give --measured-peak with it")
    if args.measured_peak is not None and args.task_peak is None:
        parser.error("--measured-peak needs --task-peak (the estimate it replaces)")


def _read_plan_census(
    parser: argparse.ArgumentParser, args: argparse.Namespace, notes: list[str]
) -> Census | None:
    """The census a pool would take here, or the figures given, with the host's flags over
    it (``None``: this host's census could not be read; the reason is on standard error)."""
    from gpupool._sensors.census import live_census

    cards: tuple[CardCensus, ...]
    host: HostCensus | None
    if args.total is not None:
        # What-if numbers are the ones typed, never this machine's: a term not
        # given (CPUs, host RAM) does not bound the plan.
        cards, driver, host = (_what_if_card(parser, args),), True, None
    else:
        try:
            sensor, census, _infos = live_census()
        except (SensorError, ConfigurationError) as exc:
            sys.stderr.write(f"gpupool plan: {exc}\n")
            return None
        sensor.close()
        cards, driver, host = census.cards, census.driver, census.host
        if census.reason:
            notes.append(census.reason)
        if cards and args.task_peak is None:
            parser.error("--task-peak is required to plan a pool on a device")
    cpus = args.cpus if args.cpus is not None else (host.cpus if host else None)
    host_ram = (
        args.host_ram if args.host_ram is not None else (host.available_ram_bytes if host else None)
    )
    return Census(
        cards=cards,
        host=HostCensus(
            cpus=cpus if cpus is not None else 1,
            available_ram_bytes=host_ram,
            cpu_source="given" if args.cpus is not None or host is None else host.cpu_source,
            ram_source="given" if args.host_ram is not None or host is None else host.ram_source,
        ),
        driver=driver,
        sensor="given",
    )


def _what_if_card(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CardCensus:
    """The one card of a what-if plan, from ``--total``, ``--co-tenant`` and ``--own``."""
    co_tenant = args.co_tenant or 0
    own = args.own or 0
    if co_tenant + own > args.total:
        parser.error(
            f"--co-tenant plus --own ({format_size(co_tenant + own)}) exceed --total "
            f"({format_size(args.total)})"
        )
    return CardCensus(
        device=0,
        uuid="what-if",
        name="what-if card",
        total_bytes=args.total,
        free_bytes=args.total - co_tenant - own,
        own_bytes=own,
        source="given",
        own_source="given",
    )


def _decide_plan_config(
    args: argparse.Namespace, census: Census, table: AskTable, ask: Ask | None, notes: list[str]
) -> PlannerConfig:
    """The configuration the pool would have: as a pool, an explicit max_workers is not
    capped by the CPU count; without one or a CPU count, as wide as the cards hold."""
    reserve = table.policy.reserve_bytes
    # A what-if plan without --cpus has no CPU term (its census counts 1 CPU).
    cpus = None if args.cpus is None and args.total is not None else census.host.cpus
    if args.max_workers is not None or cpus is not None:
        max_workers = args.max_workers if args.max_workers is not None else cpus
        assert max_workers is not None
    else:
        # Neither max_workers nor a CPU count: plan as wide as the cards hold at the ask.
        widest = PlannerConfig(max_workers=MAX_PLANNED_WIDTH, reserve_bytes=reserve)
        answer = what_if(census, table, widest, ask)
        max_workers = max(1, answer.width) if answer.decisions else 1
        notes.append(
            f"max_workers not given: planned at {max_workers}, what the card holds "
            "(a pool's default is its host's usable CPUs)"
        )
    return PlannerConfig(
        max_workers=max_workers,
        max_workers_given=args.max_workers is not None or cpus is None,
        reserve_bytes=reserve,
        child_rss_prior_bytes=(
            args.child_rss if args.child_rss is not None else DEFAULT_CHILD_RSS_PRIOR_BYTES
        ),
    )


def _print_plan(
    result: dict[str, Any],
    cards: Sequence[CardCensus],
    *,
    co_tenant_source: str,
    planned: bool,
) -> None:
    _out(f"gpupool plan ({'what-if numbers' if result['mode'] == 'what-if' else 'live census'})")
    for note in result["notes"]:
        _out(f"note: {note}")
    estimated = result["estimated"]
    for card, device in zip(cards, estimated["devices"], strict=False):
        _out(f"card {card.device} ({card.name}, {card.uuid}):")
        _out(f"  total            {format_size(device['total_bytes']):>12}   {card.source}")
        _out(
            f"  co-tenant        {format_size(device['co_tenant_bytes']):>12}   {co_tenant_source}"
        )
        _out(
            f"  own high-water   {format_size(device['own_high_water_bytes']):>12}   "
            f"{card.own_source}"
        )
        _out(f"  reserve          {format_size(device['reserve_bytes']):>12}")
        _out(
            f"  room             {format_size(device['room_bytes']):>12}   "
            "= total - co-tenant - own high-water - reserve"
        )
        if card.reason:
            _out(f"  note: {card.reason}")
    ceiling = estimated["ceiling"]
    _out(
        f"ceiling          {ceiling['value']} (max_workers={ceiling['max_workers']}, "
        f"cpus={ceiling['cpus']}, host RAM {format_size(ceiling['host_ram_bytes'])}, "
        f"child RSS {format_size(ceiling['child_rss_bytes'])}), set by {ceiling['limit']}"
        + (" (planned at what the card holds: the card sets the width)" if planned else "")
    )
    for label in ("estimated", "measured"):
        phase = result[label]
        if phase is None:
            continue
        ask = phase["ask"] or "none (no --task-peak)"
        _out(f"{label}: ask {ask} -> width {phase['width']} (limit: {phase['limit']})")
        for device in phase["devices"]:
            _out(f"  {device['describe']}")
    _out(f"width            {result['width']}")


# -- gpupool postmortem ----------------------------------------------------------


def _add_postmortem(sub: Any) -> None:
    postmortem = sub.add_parser(
        "postmortem",
        help="read a decision log: the run's widths and asks, and why a card ran out",
        description=(
            "Read a JSON Lines decision log (GpuPoolExecutor(log_path=...)): widths over "
            "time, each task key's ask and its basis, retries and lost tasks, and for every "
            "out-of-memory the card as it stood and the term that was wrong. A log appended "
            "by several pools is read as several runs, each reported on its own. Exit "
            "status: 0 read, 2 no such --run, 3 not a readable decision log, 4 empty log."
        ),
    )
    postmortem.add_argument(
        "log", metavar="LOG.jsonl", help="the decision log; - reads standard input"
    )
    postmortem.add_argument(
        "--run", metavar="RUN", help="only this run: its number in the file (1, 2, ...) or its id"
    )
    postmortem.add_argument(
        "--json", action="store_true", help='print one JSON object: {"path", "runs": [...]}'
    )
    postmortem.set_defaults(handler=_cmd_postmortem)


def _read_log(command: str, path: str, run: str | None) -> tuple[Any, int]:
    """The runs of ``path``, or ``(None, status)`` after saying what is wrong.

    A last line cut short (a pool killed mid-write, or still writing) is
    dropped, and said on stderr in one line; the records before it are read.
    """
    from gpupool._observe.log_reader import CutLine, DecisionLogError, EmptyLogError
    from gpupool._observe.postmortem import NoSuchRunError, read_runs

    def say_cut(cut: CutLine) -> None:
        sys.stderr.write(f"gpupool {command}: {cut}\n")

    try:
        return read_runs(path, run=run, on_cut=say_cut), EXIT_OK
    except (DecisionLogError, NoSuchRunError) as exc:
        sys.stderr.write(f"gpupool {command}: {exc}\n")
        if isinstance(exc, NoSuchRunError):
            return None, EXIT_USAGE
        return None, EXIT_EMPTY_LOG if isinstance(exc, EmptyLogError) else EXIT_BAD_LOG


def _cmd_postmortem(args: argparse.Namespace) -> int:
    from gpupool._core.events import SCHEMA_VERSION
    from gpupool._observe.postmortem import format_runs

    runs, status = _read_log("postmortem", args.log, args.run)
    if runs is None:
        return status
    if args.json:
        runs_json = [pm.to_dict() for pm in runs]
        _json_out({"path": runs[0].path, "schema": SCHEMA_VERSION, "runs": runs_json})
        return EXIT_OK
    for line in format_runs(runs):
        _out(line)
    return EXIT_OK


# -- gpupool plot ----------------------------------------------------------------


def _add_plot(sub: Any) -> None:
    plot = sub.add_parser(
        "plot",
        help="draw a decision log: booked and read memory and the width over time, per card",
        description=(
            "Draw, per card and per run, what the pool booked (census co-tenant, own "
            "high-water, width x ask) against the card's total, the card's used bytes where a "
            "record read them, the width and its ceiling, with every out-of-memory, live-gate "
            "wait and refused widen marked. The format follows the output's suffix (.png, "
            ".svg, .pdf); -o - writes to standard output (--format, default png). Needs the "
            "'plot' extra (matplotlib)."
        ),
    )
    plot.add_argument("log", metavar="LOG.jsonl", help="the decision log; - reads standard input")
    plot.add_argument(
        "-o", "--output", default="run.png", help="the file to write (run.png); - for stdout"
    )
    plot.add_argument(
        "--format",
        choices=PLOT_FORMATS,
        help="the format (default: from the output's suffix; png for -o -)",
    )
    plot.add_argument(
        "--run", metavar="RUN", help="only this run: its number in the file (1, 2, ...) or its id"
    )
    plot.set_defaults(handler=_cmd_plot, parser=plot)


def _plot_format(parser: argparse.ArgumentParser, output: str, given: str | None) -> str:
    if output == "-":
        return given or "png"
    suffix = os.path.splitext(output)[1].lower().lstrip(".")
    if given is not None:
        if suffix and suffix != given:
            parser.error(f"--format {given} does not match the output {output!r} (.{suffix})")
        return given
    if suffix not in PLOT_FORMATS:
        parser.error(
            f"-o {output!r}: cannot tell the format from its suffix; end it in "
            + ", ".join(f".{f}" for f in PLOT_FORMATS)
            + " (or pass --format)"
        )
    return suffix


def _cmd_plot(args: argparse.Namespace) -> int:
    import io

    from gpupool._observe.plot import PlotUnavailableError, write_plot

    fmt = _plot_format(args.parser, args.output, args.format)
    if args.output == "-" and sys.stdout.isatty():
        args.parser.error(f"-o - would write {fmt.upper()} bytes to a terminal; redirect it")
    runs, status = _read_log("plot", args.log, args.run)
    if runs is None:
        return status
    try:
        if args.output == "-":
            buffer = io.BytesIO()
            write_plot(runs, buffer, fmt=fmt)
            sys.stdout.buffer.write(buffer.getvalue())
            sys.stdout.buffer.flush()
            return EXIT_OK
        write_plot(runs, args.output, fmt=fmt)
    except PlotUnavailableError as exc:
        sys.stderr.write(f"gpupool plot: {exc}\n")
        return EXIT_FAILURE
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        sys.stderr.write(f"gpupool plot: cannot write {args.output}: {exc.strerror or exc}\n")
        return EXIT_FAILURE
    _out(f"wrote {args.output}")
    return EXIT_OK


# -- gpupool demo ----------------------------------------------------------------


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="run the incident's pipeline (36 entries, a 44.39 GiB card) and compare",
        description=(
            "Run the canonical incident through GpuPoolExecutor: 36 entries of 6.02 GiB on "
            "a 44.39 GiB card beside a 9.54 GiB serving co-tenant and a 16.20 GiB parent, "
            "task_peak 9.9GiB, max_workers 4; then the same tasks under a fixed "
            "ProcessPoolExecutor(max_workers=4). On the simulated host unless a real "
            "NVIDIA card and torch are present."
        ),
    )
    demo.add_argument(
        "--log",
        metavar="PATH",
        help="decision log to write (default: gpupool-demo.jsonl in a directory of your own "
        "under the temporary directory, named when the demo ends)",
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="draw the run here when matplotlib is installed (default: gpupool-demo.png "
        "beside the log)",
    )
    demo.add_argument(
        "--simulate", action="store_true", help="use the simulated host even with a real card"
    )
    demo.add_argument(
        "--no-progress", action="store_true", help="no progress bar, even on a terminal"
    )
    demo.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from gpupool._commands.demo import (
        DEMO_LOG_NAME,
        DEMO_PLOT_NAME,
        demo_directory,
        run_demo_isolated,
    )

    # Nothing is written into the current directory (a source tree) unless asked.
    log = Path(args.log) if args.log else None
    plot = Path(args.plot) if args.plot else None
    if log is None or plot is None:
        directory = log.parent if log is not None else demo_directory()
        log = log or directory / DEMO_LOG_NAME
        plot = plot or directory / DEMO_PLOT_NAME
    return run_demo_isolated(
        log_path=log,
        plot_path=plot,
        simulate=args.simulate,
        progress=False if args.no_progress else None,
        say=_out,
    )


# -- gpupool run -----------------------------------------------------------------


def _add_run(sub: Any) -> None:
    from gpupool._commands.run import add_run_parser

    add_run_parser(sub, handler=_cmd_run, size_type=_size_type, count_type=_count_type)


def _cmd_run(args: argparse.Namespace) -> int:
    from gpupool._commands.run import run_from_args

    return run_from_args(args, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)


# -- gpupool docs ----------------------------------------------------------------


def _add_docs(sub: Any) -> None:
    from gpupool._commands.docs import add_docs_parser

    add_docs_parser(sub, handler=_cmd_docs)


def _cmd_docs(args: argparse.Namespace) -> int:
    from gpupool._commands.docs import run_docs

    return run_docs(args, out=_out)


# -- gpupool forget --------------------------------------------------------------


def _add_forget(sub: Any) -> None:
    from gpupool._commands.forget import add_forget_parser

    add_forget_parser(sub, handler=_cmd_forget)


def _cmd_forget(args: argparse.Namespace) -> int:
    from gpupool._commands.forget import run_forget

    return run_forget(args, out=_out, err=_err)


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
