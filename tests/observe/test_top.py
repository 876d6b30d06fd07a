"""``gpupool top``: the snapshot of every pool on the simulated host's cards, the JSON, the text
and the live view in a real terminal (tmux), and the row fields it reads from strangers."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gpupool.testing as gt
from gpupool._commands.cli import main
from gpupool._core.bookings import (
    MAX_DECISION_REASON_CHARS,
    MAX_WAITS,
    LastDecision,
    PoolBooking,
    TaskBooking,
    WaitBooking,
    format_booking_table,
    group_waits,
    last_decision,
    parse_booking_table,
)
from gpupool._core.events import EVENTS
from gpupool._core.units import GiB
from gpupool._observe.top import Gatherer, plain_text
from gpupool._sensors.bookings import BookingTable, read_start_token
from gpupool._sensors.select import SIMULATOR_ENV

SCRIPT = str(Path(__file__).with_name("top_pool_script.py"))
UUID = "GPU-00000000-1111-2222-3333-444444444444"
#: A safety net so that a broken test fails instead of hanging; never waited out in a pass.
PATIENCE_S = 120.0
TASKS = 5


def _own_row(pool_id: str, **fields: Any) -> PoolBooking:
    """A row for a pool whose process (and only worker) is this test's process."""
    start = read_start_token(os.getpid())
    assert start is not None
    task = TaskBooking(worker_pid=os.getpid(), key="fit", booked_bytes=6 * GiB, reached_bytes=0)
    return PoolBooking(
        pool_id=pool_id,
        pid=os.getpid(),
        start=start,
        label="train.py",
        updated_s=time.time(),
        tasks=(task,),
        **fields,
    )


# -- the row's optional fields ------------------------------------------------------------


def test_rows_round_trip_with_waits_and_last_and_old_rows_still_parse() -> None:
    """Rows with the new fields read back equal; a row written without them reads as none."""
    row = _own_row(
        "1.1",
        waiting=3,
        need_bytes=6 * GiB,
        waits=(WaitBooking(key="fit", ask_bytes=6 * GiB, count=3),),
        last=LastDecision(kind="narrowed", reason="card 0: ...", time_s=1.5e9),
    )
    assert parse_booking_table(format_booking_table(UUID, [row]), card_uuid=UUID) == {"1.1": row}
    old = (
        b'{"version":1,"card_uuid":"%s","pools":{"2.1":{"pid":2,"start":"9","label":"x",'
        b'"updated_s":1.0,"waiting":0,"need_bytes":0,"tasks":[]}}}' % UUID.encode()
    )
    parsed = parse_booking_table(old, card_uuid=UUID)["2.1"]
    assert (parsed.waits, parsed.last) == ((), None)


def test_group_waits_and_last_decision_keep_their_bounds() -> None:
    """Waits group by key and ask in queue order, at most MAX_WAITS; a long reason is cut."""
    entries = [("a", 1), ("b", 2), ("a", 1)] + [(f"k{n}", n) for n in range(40)]
    waits = group_waits(entries)
    assert len(waits) == MAX_WAITS
    assert waits[:2] == (
        WaitBooking(key="a", ask_bytes=1, count=2),
        WaitBooking(key="b", ask_bytes=2, count=1),
    )
    cut = last_decision("narrowed", "x" * 500, 2.0)
    assert len(cut.reason) == MAX_DECISION_REASON_CHARS
    assert cut.reason.endswith("...")
    row = _own_row("1.1", waits=waits, last=cut)
    assert parse_booking_table(format_booking_table(UUID, [row]), card_uuid=UUID) == {"1.1": row}


HOSTILE = {
    "too_many_waits": {"waits": [["k", 1, 1]] * (MAX_WAITS + 1)},
    "wait_key_not_text": {"waits": [[7, 1, 1]]},
    "wait_key_too_long": {"waits": [["k" * 201, 1, 1]]},
    "wait_count_zero": {"waits": [["k", 1, 0]]},
    "wait_ask_negative": {"waits": [["k", -1, 1]]},
    "wait_ask_bool": {"waits": [["k", True, 1]]},
    "waits_not_a_list": {"waits": "k"},
    "last_not_a_list": {"last": "narrowed"},
    "last_reason_too_long": {"last": ["narrowed", "r" * 201, 1.0]},
    "last_kind_not_text": {"last": [1, "r", 1.0]},
    "last_time_not_a_number": {"last": ["narrowed", "r", "now"]},
    "last_time_huge": {"last": ["narrowed", "r", 10**400]},
}


def _hostile_file(good: PoolBooking) -> bytes:
    """The table with ``good`` and one row per HOSTILE entry, each otherwise like ``good``."""
    rows = json.loads(format_booking_table(UUID, [good]))
    fields = rows["pools"][good.pool_id]
    for name, bad in HOSTILE.items():
        rows["pools"][name] = {**fields, **bad}
    return json.dumps(rows).encode()


def test_hostile_optional_fields_are_left_out_and_their_rows_bookings_kept() -> None:
    """Oversized waits, long reasons and wrong types leave that field out (read as none);
    the row itself, whose bookings other pools price by, is kept whole."""
    last = LastDecision(kind="widened", reason="ok", time_s=1.0)
    good = _own_row("good.1", waits=(WaitBooking(key="fit", ask_bytes=GiB, count=2),), last=last)
    rows = parse_booking_table(_hostile_file(good), card_uuid=UUID)
    assert rows.pop("good.1") == good
    assert sorted(rows) == sorted(HOSTILE)
    for name, row in rows.items():
        bad_field = next(iter(HOSTILE[name]))
        kept = {"waits": good.waits, "last": good.last}
        kept[bad_field] = () if bad_field == "waits" else None
        assert row == dataclasses.replace(good, pool_id=name, **kept), name
        assert row.booked_bytes == 6 * GiB


def test_top_lists_every_row_of_a_hostile_table_without_its_bad_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gpupool top --once --json` over a planted table: every row, a bad field left out."""
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        uuid = host.device_uuid(0)
        directory = Path(host.bookings_directory)
        directory.mkdir(mode=0o700, exist_ok=True)
        good = _own_row("good.1", last=LastDecision(kind="widened", reason="ok", time_s=1.0))
        text = _hostile_file(good).replace(UUID.encode(), uuid.encode())
        path = directory / f"{uuid}.json"
        path.write_bytes(text)
        path.chmod(0o600)
        capsys.readouterr()
        assert main(["top", "--once", "--json"]) == 0
        card = json.loads(capsys.readouterr().out)["cards"][0]
    pools = {pool["pool_id"]: pool for pool in card["pools"]}
    assert sorted(pools) == sorted(["good.1", *HOSTILE])
    assert pools["good.1"]["last"]["kind"] == "widened"
    assert pools["last_reason_too_long"]["last"] is None
    assert pools["too_many_waits"]["waits"] == []
    assert all(pool["booked_bytes"] == 6 * GiB for pool in pools.values())


def test_keys_with_escape_sequences_and_markup_are_shown_inert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key or reason holding terminal escapes or rich markup is printed as text: no escape
    reaches the terminal, and the markup is shown as written."""
    key = "[bold]fit[/] \x1b]0;title\x07\x1b[2J\nnext"
    # A terminal as wide as the row: a narrower one cuts the reason (the text is the view's).
    monkeypatch.setenv("COLUMNS", "200")
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]) as host:
        table = BookingTable(host.bookings_directory)
        row = _own_row("me.1")
        task = TaskBooking(worker_pid=os.getpid(), key=key, booked_bytes=GiB, reached_bytes=0)
        last = LastDecision(kind="narrowed\x1b[31m", reason="\x1b[2J[/]", time_s=time.time())
        assert table.exchange(host.device_uuid(0), row.pool_id, (task,), last=last)
        gatherer = Gatherer()
        try:
            snapshot = gatherer.snapshot()
        finally:
            gatherer.close()
            table.close()
    assert snapshot["cards"][0]["pools"][0]["running"][0]["key"] == key  # the JSON keeps it
    texts = [plain_text(snapshot)]
    try:
        from gpupool._observe.top_view import render_text
    except ImportError:
        pass
    else:
        texts.append(render_text(snapshot))
    for text in texts:
        assert "\x1b" not in text and "\x07" not in text
        assert "task [bold]fit[/] ?]0;title??[2J?next" in text
        assert "narrowed?[31m" in text and "?[2J[/]" in text


# -- the snapshot -------------------------------------------------------------------------


def test_the_snapshot_splits_the_card_into_pools_co_tenants_and_room() -> None:
    """Co-tenants are the used bytes no pool's worker holds; room is free less the bookings
    not yet reached; a pool's measured bytes are its workers' rows."""
    card = gt.SimulatedDevice("40GiB", co_tenants={"serve": "3GiB"})
    with gt.SimulatedHost([card]) as host, gt.hold("2GiB"):
        uuid = host.device_uuid(0)
        table = BookingTable(host.bookings_directory)
        row = _own_row("me.1")
        waits = (WaitBooking(key="fit", ask_bytes=6 * GiB, count=4),)
        last = LastDecision(kind="live_gate_wait", reason="held back", time_s=time.time())
        assert table.exchange(uuid, row.pool_id, row.tasks, 4, 6 * GiB, waits=waits, last=last)
        gatherer = Gatherer()
        try:
            snapshot = gatherer.snapshot()
        finally:
            gatherer.close()
            table.close()
    (card_view,) = snapshot["cards"]
    (pool,) = card_view["pools"]
    used = card_view["used_bytes"]
    held = used - 3 * GiB  # 2 GiB and this process's context
    assert pool["measured_bytes"] == held
    assert card_view["co_tenant_bytes"] == 3 * GiB
    assert card_view["room_bytes"] == card_view["free_bytes"] - (6 * GiB - held)
    assert (pool["pid"], pool["workers_on_card"]) == (os.getpid(), 1)
    assert pool["running"] == [
        {
            "worker_pid": os.getpid(),
            "key": "fit",
            "booked_bytes": 6 * GiB,
            "reached_bytes": 0,
            "measured_bytes": held,
        }
    ]
    assert (pool["waiting"], pool["need_bytes"]) == (4, 6 * GiB)
    assert pool["waits"] == [{"key": "fit", "ask_bytes": 6 * GiB, "count": 4}]
    assert pool["last"]["kind"] == "live_gate_wait"
    assert pool["last"]["reason"] == "held back"
    text = plain_text(snapshot)
    assert "3.00 GiB co-tenants" in text
    assert f"pool me.1 {pool['label']}" in text
    assert "waiting 4" in text
    assert "first needs 6.00 GiB; asks: fit 6.00 GiB x4" in text
    assert "live_gate_wait" in text


def test_the_live_view_refuses_an_output_that_is_not_a_terminal() -> None:
    """`gpupool top` into a pipe is a usage error pointing at --once and --json."""
    pytest.importorskip("rich", reason="without rich the live view names the extra first")
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "top"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )
    assert done.returncode == 2
    assert "not a terminal" in done.stderr
    assert "--once" in done.stderr and "--json" in done.stderr


def test_interval_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    """--interval refuses what is not a number of seconds within its range, saying so."""
    for bad in ("0", "-1", "nan", "soon", "7200"):
        with pytest.raises(SystemExit) as exit_info:
            main(["top", "--once", "--interval", bad])
        assert exit_info.value.code == 2
        assert f"--interval {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--once"], ["--once", "--json"]])
def test_a_bad_cpu_cap_in_the_environment_is_one_line_and_status_1(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """LOKY_MAX_CPU_COUNT that the census refuses: a line naming it, status 1 (as ``gpupool
    census``), no traceback."""
    monkeypatch.setenv("LOKY_MAX_CPU_COUNT", "abc")
    with gt.SimulatedHost([gt.SimulatedDevice("40GiB")]):
        assert main(["top", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("gpupool top: LOKY_MAX_CPU_COUNT='abc': set it to")
    assert len(captured.err.splitlines()) == 1


# -- a pool in another process ------------------------------------------------------------


@pytest.fixture
def pool_elsewhere(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A pool in another process on a simulated 16 GiB card: two of its tasks hold 2 GiB
    each and block on a file this test controls; the others wait for room."""
    gate = tmp_path / "gate"
    gate.mkdir()
    with gt.SimulatedHost([gt.SimulatedDevice("16GiB")], cpus=8, host_ram="64GiB"):
        child = subprocess.Popen(
            [sys.executable, SCRIPT, str(gate), str(TASKS)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + PATIENCE_S
            while len(list(gate.glob("started-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(list(gate.glob("started-*"))) == 2
            yield child, gate
            (gate / "go").touch()
            assert child.stdout.readline().strip() == "done"
            assert child.wait(timeout=PATIENCE_S) == 0
        finally:
            (gate / "go").touch()
            if child.poll() is None:
                child.kill()
                child.wait(timeout=PATIENCE_S)
            if child.stdout is not None:
                child.stdout.close()


def test_top_once_json_lists_a_pool_of_another_process(
    pool_elsewhere: tuple[subprocess.Popen[str], Path],
) -> None:
    """`gpupool top --once --json`, run as a command, shows the other process's pool: its
    running tasks with keys, bookings and measured bytes, its waiting tasks, its last decision."""
    child, _gate = pool_elsewhere
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "top", "--once", "--json"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (card,) = json.loads(done.stdout)["cards"]
    (pool,) = card["pools"]
    assert (pool["pid"], pool["label"]) == (child.pid, "top_pool_script.py")
    assert [task["key"] for task in pool["running"]] == ["train-step"] * 2
    assert {task["booked_bytes"] for task in pool["running"]} == {6 * GiB}
    assert all(task["measured_bytes"] >= 2 * GiB for task in pool["running"])
    assert pool["measured_bytes"] >= 4 * GiB
    assert pool["booked_bytes"] == 12 * GiB
    assert 1 <= pool["waiting"] <= TASKS - 2
    assert pool["need_bytes"] == 6 * GiB
    assert pool["waits"] == [{"key": "train-step", "ask_bytes": 6 * GiB, "count": pool["waiting"]}]
    assert pool["last"]["kind"] in EVENTS
    assert pool["last"]["reason"]
    assert card["co_tenant_bytes"] == card["used_bytes"] - pool["measured_bytes"]
    assert pool["workers_on_card"] == 2
    text = subprocess.run(
        [sys.executable, "-m", "gpupool", "top", "--once"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )
    assert text.returncode == 0, text.stderr
    assert re.search(rf"pool \S+ top_pool_script\.py +{child.pid} ", text.stdout), text.stdout
    assert "task train-step" in text.stdout
    assert "Ctrl-C" not in text.stdout  # the live view's hint only


def test_json_alone_prints_one_line_per_refresh_until_interrupted(
    pool_elsewhere: tuple[subprocess.Popen[str], Path],
) -> None:
    """`gpupool top --json` writes one JSON object per line per refresh; Ctrl-C ends it (0)."""
    child, _gate = pool_elsewhere
    top = subprocess.Popen(
        [sys.executable, "-m", "gpupool", "top", "--json", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert top.stdout is not None
        lines = [json.loads(top.stdout.readline()) for _ in range(2)]
        top.send_signal(signal.SIGINT)
        assert top.wait(timeout=PATIENCE_S) == 0
    finally:
        if top.poll() is None:
            top.kill()
            top.wait(timeout=PATIENCE_S)
        if top.stdout is not None:
            top.stdout.close()
    assert lines[0]["time_s"] < lines[1]["time_s"]
    for snapshot in lines:
        assert [pool["pid"] for pool in snapshot["cards"][0]["pools"]] == [child.pid]


def _without_rich(*argv: str) -> subprocess.CompletedProcess[str]:
    """``gpupool ARGV`` in a fresh interpreter where ``import rich`` fails."""
    code = (
        "import sys; sys.modules['rich'] = None; from gpupool._commands.cli import main; "
        f"sys.exit(main({list(argv)!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )


def test_without_rich_once_prints_text_and_the_live_view_names_the_extra(
    pool_elsewhere: tuple[subprocess.Popen[str], Path],
) -> None:
    """Without rich, `--once` prints plain text; the live view exits 1 naming the extra."""
    child, _gate = pool_elsewhere
    once = _without_rich("top", "--once")
    assert once.returncode == 0, once.stderr
    assert f"top_pool_script.py  {child.pid}" in once.stdout
    assert "task train-step" in once.stdout
    live = _without_rich("top")
    assert live.returncode == 1
    assert "pip install 'gpupool[top]'" in live.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_live_view_draws_the_pool_in_a_terminal(
    pool_elsewhere: tuple[subprocess.Popen[str], Path], tmp_path: Path
) -> None:
    """`gpupool top` in a 160x50 tmux pane shows the other process's pool and its task key."""
    pytest.importorskip("rich", reason="the live view needs rich")
    child, _gate = pool_elsewhere
    env = {SIMULATOR_ENV: os.environ[SIMULATOR_ENV], "TERM": "xterm-256color"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    command = shlex.join(
        # COLUMNS and LINES (set under pytest) would override the pane's size.
        ["env", "-u", "COLUMNS", "-u", "LINES", *(f"{k}={v}" for k, v in env.items())]
    )
    command += " " + shlex.join([sys.executable, "-m", "gpupool"])
    command += " top --interval 0.2"
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock"), "-f", os.devnull]
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "160", "-y", "50", "-s", "top", command],
        check=True,
        timeout=PATIENCE_S,
    )
    try:
        pane = ""
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            pane = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "top"],
                capture_output=True,
                text=True,
                check=True,
                timeout=PATIENCE_S,
            ).stdout
            if "task train-step" in pane:
                break
            time.sleep(0.05)
        (tmp_path / "pane.txt").write_text(pane)
        sys.stdout.write(pane)
        assert "gpupool top" in pane
        assert "top_pool_script.py" in pane and str(child.pid) in pane
        assert "task train-step" in pane
        assert "co-tenants" in pane and "room left" in pane
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, timeout=PATIENCE_S)


def test_the_waiting_count_shown_is_the_current_one(tmp_path: Path) -> None:
    """A pool's row is rewritten when its count of waiting tasks changes, not only when it
    goes from none to some: with two tasks running on a card with room for two (6 GiB tasks
    on 16 GiB, max_workers=6), one more waits, then three; `gpupool top` shows 1, then 3."""
    import observe_tasks

    from gpupool import GpuPoolExecutor

    def wait_until(what: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + PATIENCE_S
        while True:
            gatherer = Gatherer()
            try:
                snapshot = gatherer.snapshot()
            finally:
                gatherer.close()
            pools = snapshot["cards"][0]["pools"]
            if pools and check(pools[0]):
                return snapshot
            assert time.monotonic() < deadline, f"top never showed {what}: {pools}"
            time.sleep(0.05)

    gate = str(tmp_path)
    with gt.SimulatedHost([gt.SimulatedDevice("16GiB")], cpus=8, host_ram="64GiB"):
        with GpuPoolExecutor(max_workers=6, task_peak="6GiB") as pool:
            futures = [pool.submit(observe_tasks.hold_until, i, "2GiB", gate) for i in range(2)]
            wait_until("2 running", lambda p: len(p["running"]) == 2)
            futures.append(pool.submit(observe_tasks.hold_until, 2, "2GiB", gate))
            wait_until("1 waiting", lambda p: p["waiting"] == 1)
            futures += [pool.submit(observe_tasks.hold_until, i, "2GiB", gate) for i in (3, 4)]
            snapshot = wait_until(
                "3 waiting", lambda p: p["waiting"] == 3 and len(p["running"]) == 2
            )
            assert "2 running, 3 waiting" in plain_text(snapshot)
            Path(gate, "release").touch()
            assert [f.result(timeout=PATIENCE_S) for f in futures] == list(range(5))
