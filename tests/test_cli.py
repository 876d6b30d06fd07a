"""The command line: ``gpupool census`` (driverless and fake hosts) and ``gpupool plan``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpupool._commands.cli import (
    EXIT_BAD_LOG,
    EXIT_BROKEN_PIPE,
    EXIT_EMPTY_LOG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    build_parser,
    main,
)
from gpupool._core.units import GiB

sys.path.insert(0, str(Path(__file__).parent / "sensors"))
from fake_pynvml import FakePynvml, h100

WHAT_IF = [
    "plan",
    "--json",
    "--total",
    "44.39GiB",
    "--co-tenant",
    "9.54GiB",
    "--own",
    "16.20GiB",
    "--reserve",
    "0",
    "--task-peak",
    "9.9GiB",
    "--max-workers",
    "4",
    "--cpus",
    "16",
    "--host-ram",
    "128GiB",
]
MEASURED = ["--measured-peak", "6.02GiB", "--margin", "1GiB"]


@pytest.fixture
def real_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as it is: no simulator, the real (driverless) pynvml, no device restriction."""
    monkeypatch.delenv("GPUPOOL_SIMULATOR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if isinstance(sys.modules.get("pynvml"), FakePynvml):
        monkeypatch.delitem(sys.modules, "pynvml")


def has_driver() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    value = json.loads(out)
    assert isinstance(value, dict)
    return value


# -- census --------------------------------------------------------------------


@pytest.mark.usefixtures("real_host")
def test_census_json_without_driver(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpupool census --json` on a driverless host: exit 0, no device, real CPUs, positive RAM."""
    if has_driver():
        pytest.skip("this host has an NVIDIA driver")
    data = run_json(capsys, ["census", "--json"])
    assert data["driver"] is False
    assert data["devices"] == []
    assert str(data["reason"]).startswith("no NVIDIA driver or library")
    host = data["host"]
    assert isinstance(host, dict)
    assert 1 <= host["cpus"] <= len(os.sched_getaffinity(0))
    assert host["available_ram_bytes"] > 0


@pytest.mark.usefixtures("real_host")
def test_census_json_subprocess_without_driver() -> None:
    """`python -m gpupool census --json` in a fresh interpreter exits 0 and reports no device."""
    if has_driver():
        pytest.skip("this host has an NVIDIA driver")
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_SIMULATOR"}
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "census", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["driver"] is False
    assert data["device_count"] == 0
    assert 1 <= data["host"]["cpus"] <= len(os.sched_getaffinity(0))
    assert data["host"]["available_ram_bytes"] > 0


@pytest.mark.usefixtures("real_host")
def test_census_text_without_driver(capsys: pytest.CaptureFixture[str]) -> None:
    """The human census says plainly that there is no device, and shows the host."""
    if has_driver():
        pytest.skip("this host has an NVIDIA driver")
    assert main(["census"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no device: no NVIDIA driver or library")
    assert "usable CPUs" in out
    assert "available RAM" in out


def test_census_json_on_a_fake_host(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a (fake) driver: one block per device with every figure, its source and the rows."""
    monkeypatch.delenv("GPUPOOL_SIMULATOR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    cards = [h100(0), h100(1, total=80 * GiB, free=50 * GiB, reserved=0, compute=[(99, 30 * GiB)])]
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml(cards))
    data = run_json(capsys, ["census", "--json"])
    assert data["driver"] is True
    devices = data["devices"]
    assert isinstance(devices, list)
    first = devices[0]
    assert first["index"] == 1
    assert first["total_bytes"] == 80 * GiB
    assert first["co_tenant_bytes"] == 30 * GiB
    assert first["own_bytes"] == 0
    assert first["processes"] == [{"pid": 99, "used_bytes": 30 * GiB}]
    assert first["sources"]["total_bytes"] == "nvml-v2"
    assert first["sources"]["own_bytes"] == "baseline"
    assert first["sources"]["co_tenant_bytes"] == "total - free - own"
    assert main(["census"]) == 0
    text = capsys.readouterr().out
    for label in ("total", "reserved", "used", "free", "own", "co-tenant", "pid 99"):
        assert label in text


# -- plan ----------------------------------------------------------------------


def test_plan_estimated_width_1(capsys: pytest.CaptureFixture[str]) -> None:
    """The incident's card: 18.65 GiB of room holds 1 task at the 9.9 GiB estimate."""
    data = run_json(capsys, WHAT_IF)
    assert data["width"] == 1
    assert data["ask_basis"] == "estimated"
    assert data["limit"] == "memory"
    assert data["measured"] is None
    assert (
        data["room_bytes"]
        == data["total_bytes"] - data["co_tenant_bytes"] - data["own_high_water_bytes"]
    )
    assert data["reserve_bytes"] == 0


def test_plan_measured_width_2(capsys: pytest.CaptureFixture[str]) -> None:
    """After children report 6.02 GiB (+1 GiB margin), the same card holds 2."""
    data = run_json(capsys, [*WHAT_IF, *MEASURED])
    assert data["width"] == 2
    assert data["ask_basis"] == "measured"
    assert data["ask_bytes"] == int(6.02 * GiB) + GiB
    estimated = data["estimated"]
    measured = data["measured"]
    assert isinstance(estimated, dict)
    assert isinstance(measured, dict)
    assert estimated["width"] == 1
    assert measured["width"] == 2


def test_plan_measured_on_80gib_is_max_workers(capsys: pytest.CaptureFixture[str]) -> None:
    """On an 80 GiB card the measured ask fits 7, capped at max_workers 4."""
    argv = [*WHAT_IF, *MEASURED]
    argv[argv.index("44.39GiB")] = "80GiB"
    data = run_json(capsys, argv)
    assert data["width"] == 4
    assert data["limit"] == "max_workers"


def test_plan_human_output_has_every_term(capsys: pytest.CaptureFixture[str]) -> None:
    """The human plan shows every term of the bound and both widths."""
    argv = [arg for arg in [*WHAT_IF, *MEASURED] if arg != "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for term in (
        "total",
        "44.39 GiB",
        "co-tenant",
        "9.54 GiB",
        "own high-water",
        "16.20 GiB",
        "reserve",
        "room",
        "18.65 GiB",
        "ceiling",
        "ask 9.90 GiB (estimated",
        "ask 7.02 GiB (measured",
        "max_workers=4",
        # As a pool: an explicit max_workers is not capped by the CPU count.
        "cpus=None",
    ):
        assert term in out, term
    assert out.rstrip().splitlines()[-1].split() == ["width", "2"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--total", "lots"),
        ("--task-peak", "0"),
        ("--margin", "-1GiB"),
        ("--max-workers", "0"),
        # More than a pool runs: an OverflowError's traceback, or a plan that never ended.
        ("--max-workers", "99999999999999999999"),
        ("--cpus", "4097"),
    ],
)
def test_plan_bad_values_name_the_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """A bad size or count is an argparse error (exit 2) naming the flag."""
    argv = list(WHAT_IF)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.usefixtures("real_host")
def test_plan_live_without_driver_is_host_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    """Live plan on a driverless host: no device, and the width is the ceiling."""
    if has_driver():
        pytest.skip("this host has an NVIDIA driver")
    data = run_json(capsys, ["plan", "--json", "--task-peak", "6GiB", "--max-workers", "64"])
    assert data["driver"] is False
    assert data["device_count"] == 0
    ceiling = data["ceiling"]
    assert isinstance(ceiling, dict)
    assert data["width"] == ceiling["value"]
    # As a pool: max_workers=64 given is not capped by the CPUs (host RAM may cap it).
    assert ceiling["cpus"] is None
    assert data["width"] <= 64
    assert any("no device" in str(note) for note in data["notes"])  # type: ignore[attr-defined]
    assert main(["plan"]) == 0
    assert "no device" in capsys.readouterr().out


# -- conventions every subcommand keeps ---------------------------------------------------


def _gpupool(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupool", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``gpupool --version`` prints the package's version and exits 0."""
    import gpupool

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpupool {gpupool.__version__}"


def test_exit_codes_are_distinct_and_documented() -> None:
    """Usage (2), a bad log (3) and an empty log (4) differ, and --help lists every status."""
    assert len({EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_BAD_LOG, EXIT_EMPTY_LOG}) == 5
    assert EXIT_USAGE == 2  # argparse's own
    text = build_parser().format_help()
    for status in ("0 done", "1 a failure", "2 usage", "3 not a readable", "4 an empty"):
        assert status in text


def test_a_broken_pipe_is_quiet(tmp_path: Path) -> None:
    """``gpupool postmortem LOG | head -1``: no BrokenPipeError traceback, exit 141."""
    log = tmp_path / "many.jsonl"
    record = {"schema": 2, "run_id": "r1", "event": "out_of_memory", "device": 0, "time_s": 0.0}
    log.write_text("\n".join(json.dumps({**record, "time_s": i / 10}) for i in range(200)) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpupool", "postmortem", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err, err.decode()
    assert b"BrokenPipeError" not in err
    assert proc.returncode == EXIT_BROKEN_PIPE


@pytest.fixture
def small_log(tmp_path: Path) -> Path:
    """A one-card log from a real (simulated) run."""
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    log = tmp_path / "small.jsonl"
    with SimulatedHost([SimulatedDevice("16GiB")], cpus=2, host_ram="8GiB"):
        with GpuPoolExecutor(max_workers=2, task_peak="4GiB", log_path=log) as pool:
            assert list(pool.map(abs, [-1, -2, -3])) == [1, 2, 3]
    return log


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")]
)
def test_plot_format_follows_the_suffix(small_log: Path, suffix: str, magic: bytes) -> None:
    """``plot -o out.svg`` writes SVG, ``.pdf`` PDF, ``.png`` PNG: the suffix sets the format."""
    pytest.importorskip("matplotlib")
    out = small_log.with_suffix(suffix)
    assert main(["plot", str(small_log), "-o", str(out)]) == 0
    assert out.read_bytes()[: len(magic)] == magic


def test_plot_to_standard_output(small_log: Path) -> None:
    """``plot -o -`` writes the image to stdout (PNG by default, --format svg), no file '-'."""
    pytest.importorskip("matplotlib")
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "plot", str(small_log), "-o", "-"],
        capture_output=True,
        timeout=120,
        cwd=small_log.parent,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout[:4] == b"\x89PNG"
    assert not (small_log.parent / "-").exists()
    svg = _gpupool("plot", str(small_log), "-o", "-", "--format", "svg")
    assert svg.returncode == 0, svg.stderr
    assert svg.stdout.startswith("<?xml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["-o", "out.jpeg"],
            r"cannot tell the format from its suffix; end it in \.png, \.svg, \.pdf",
        ),
        (["-o", "out.png", "--format", "svg"], r"--format svg does not match the output"),
    ],
)
def test_plot_format_errors_are_usage_errors(
    small_log: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """An unknown suffix or a contradicting --format: exit 2 with the fix, nothing written."""
    with pytest.raises(SystemExit) as info:
        main(["plot", str(small_log), *argv])
    assert info.value.code == EXIT_USAGE
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("total", "co_tenant", "peak", "max_workers", "cards"),
    [
        ("24GiB", "4GiB", "5.5GiB", 6, 1),
        ("40GiB", "0", "18GiB", 6, 1),
        ("12GiB", "1GiB", "2GiB", 3, 2),
        ("80GiB", "30GiB", "7GiB", 16, 1),
    ],
)
def test_plan_states_what_the_pool_constructs(
    capsys: pytest.CaptureFixture[str],
    total: str,
    co_tenant: str,
    peak: str,
    max_workers: int,
    cards: int,
) -> None:
    """``gpupool plan`` asks the planner: on the same host it states the width, and each
    card's width, that a pool constructed there records."""
    from gpupool import GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    devices = [SimulatedDevice(total, co_tenants={"other": co_tenant}) for _ in range(cards)]
    with SimulatedHost(devices, cpus=4, host_ram="64GiB"):
        argv = ["plan", "--json", "--task-peak", peak, "--max-workers", str(max_workers)]
        data = run_json(capsys, argv)
        with GpuPoolExecutor(max_workers=max_workers, task_peak=peak) as pool:
            constructed = [d for d in pool.decisions if d.event == "constructed"]
            assert data["width"] == pool.width
    assert [d.width_after for d in constructed] == [
        device["width"]  # type: ignore[index]
        for device in data["devices"]  # type: ignore[attr-defined]
    ]


def test_what_if_plans_do_not_read_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """A what-if plan without --cpus/--host-ram has no CPU or RAM term: 8 on any machine."""
    argv = ["plan", "--json", "--total", "80GiB", "--task-peak", "6GiB", "--max-workers", "8"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["width"] == 8
    assert data["ceiling"]["cpus"] is None
    assert data["ceiling"]["host_ram_bytes"] is None
    assert main(["plan", "--json", "--total", "80GiB", "--task-peak", "6GiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["width"] == 13  # (80 GiB - 256 MiB reserve) // 6 GiB: what the card holds
    assert any("max_workers not given" in note for note in data["notes"])


def test_a_plan_without_max_workers_names_the_card_as_its_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without max_workers the plan is planned at what the card holds: the card's room set
    the width, and the plan names the memory bound, never "max_workers"; a co-tenant typed
    with --co-tenant is labelled given, not worked out from a reading."""
    argv = ["plan", "--total", "24GiB", "--co-tenant", "3GiB", "--task-peak", "7GiB"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["width"], data["limit"]) == (2, "memory")
    assert data["devices"][0]["limit"] == "memory"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "-> width 2 (limit: memory)" in out
    assert "width 2, set by the memory bound" in out
    assert re.search(r"^  co-tenant +3\.00 GiB +given$", out, re.M), out
    assert "total - free - own" not in out
    # Given, max_workers that sets the width is still named.
    assert main([*argv, "--max-workers", "1"]) == 0
    assert "(limit: max_workers)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--total", "0", "--task-peak", "1GiB"], r"--total='0' is zero; --total must be positive"),
        (
            ["--total", "40GiB", "--reserve", "50GiB", "--task-peak", "1GiB"],
            r"--reserve 50\.00 GiB is not smaller than card 0's 40\.00 GiB; a pool refuses it",
        ),
        (
            ["--total", "40GiB", "--reserve", "40GiB", "--task-peak", "1GiB"],
            r"--reserve 40\.00 GiB is not smaller than card 0's 40\.00 GiB",
        ),
    ],
)
def test_plan_refuses_what_the_pool_refuses(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """A zero card and a reserve not smaller than the card: exit 2, as the pool raises."""
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == EXIT_USAGE
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--co-tenant", "1GiB"], r"--co-tenant is a what-if figure: give --total with it$"),
        (["--own", "1GiB"], r"--own is a what-if figure: give --total with it$"),
        (
            ["--total", "8GiB", "--task-peak", "1GiB", "--margin", "1GiB"],
            r"--margin applies to a measured peak: give --measured-peak with it$",
        ),
        (
            ["--total", "8GiB", "--measured-peak", "1GiB"],
            r"--measured-peak needs --task-peak \(the estimate it replaces\)$",
        ),
        (
            ["--total", "8GiB", "--co-tenant", "5GiB", "--own", "4GiB", "--task-peak", "1GiB"],
            r"--co-tenant plus --own \(9\.00 GiB\) exceed --total \(8\.00 GiB\)$",
        ),
    ],
)
def test_plan_refuses_flags_that_mean_nothing_alone(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """A flag that needs another, or what-if figures past the card: exit 2, with the fix."""
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == EXIT_USAGE
    assert re.search(message, capsys.readouterr().err.strip())


def test_a_live_plan_on_a_card_needs_a_task_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """A live plan with a card and no --task-peak is a usage error (exit 2) that says so."""
    from gpupool.testing import SimulatedDevice, SimulatedHost

    with SimulatedHost([SimulatedDevice("40GiB")], cpus=2, host_ram="8GiB"):
        with pytest.raises(SystemExit) as info:
            main(["plan"])
    assert info.value.code == EXIT_USAGE
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--task-peak is required to plan a pool on a device")
    )


def test_the_pool_refuses_the_same_reserve() -> None:
    """The refusal ``plan`` mirrors: a pool with reserve >= the card raises ConfigurationError."""
    from gpupool import ConfigurationError, GpuPoolExecutor
    from gpupool.testing import SimulatedDevice, SimulatedHost

    with SimulatedHost([SimulatedDevice("40GiB")], cpus=2, host_ram="8GiB"):
        with pytest.raises(ConfigurationError, match="is not smaller than card 0's"):
            GpuPoolExecutor(max_workers=2, task_peak="1GiB", reserve="40GiB")


@pytest.mark.slow
def test_ctrl_c_in_the_demo_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) mid-demo: one line, no traceback, 130."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpupool", "demo", "--simulate", "--no-progress"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("1. "):
            break
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err.strip() == "gpupool: interrupted"


@pytest.mark.slow
def test_the_demo_is_not_tuned_by_the_pool_settings_of_the_environment(tmp_path: Path) -> None:
    """The demo is a fixed scenario: GPUPOOL_* pool defaults and LOKY_MAX_CPU_COUNT in the
    shell, bad or good, neither fail it nor change its pools. It writes nothing where it
    runs (one run of the demo checks both)."""
    tree, temp = tmp_path / "tree", tmp_path / "tmp"
    tree.mkdir()
    temp.mkdir()
    env = {
        **os.environ,
        "GPUPOOL_RESERVE": "zz",
        "GPUPOOL_MAX_WORKERS": "1",
        "GPUPOOL_ROOM_WAIT_S": "soon",
        "LOKY_MAX_CPU_COUNT": "abc",
        "TMPDIR": str(temp),
    }
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "demo", "--simulate", "--no-progress"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "1. GpuPoolExecutor(max_workers=4, " in done.stdout
    assert "36 completed, 0 failed" in done.stdout
    # A tidy first run: nothing in the directory it ran in (a source tree); the log, in a
    # directory of the user's own under the temporary directory, is named.
    assert list(tree.iterdir()) == []
    log = temp / f"gpupool-demo-{os.getuid()}" / "gpupool-demo.jsonl"
    assert log.is_file()
    assert f"decision log: {log}" in done.stdout


def test_the_demo_directory_is_the_users_own(tmp_path: Path) -> None:
    """The demo's default directory is reused when it is this user's private directory; a
    link, a file or a directory others can write there is never used (a fresh private one
    is made instead)."""
    from gpupool._commands.demo import demo_directory

    first = demo_directory(tmp_path)
    assert first == tmp_path / f"gpupool-demo-{os.getuid()}"
    assert (first.stat().st_mode & 0o777) == 0o700
    assert demo_directory(tmp_path) == first
    for plant in ("link", "file", "open"):
        root = tmp_path / plant
        root.mkdir()
        planted = root / f"gpupool-demo-{os.getuid()}"
        if plant == "link":
            planted.symlink_to(tmp_path)
        elif plant == "file":
            planted.write_text("")
        else:
            planted.mkdir()
            planted.chmod(0o777)
        chosen = demo_directory(root)
        assert chosen != planted and chosen.parent == root, plant
        assert (chosen.stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize(
    "extra", [["--host-ram", "1GiB"], ["--child-rss", "1GiB"], ["--host-ram", "0", "--json"]]
)
def test_plan_without_task_peak_prices_as_a_pool_given_none(extra: list[str]) -> None:
    """A what-if plan with a host RAM or child RSS figure but no --task-peak prices the task
    as a pool given no task_peak does (the card's room), instead of failing on a missing
    estimate with a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "gpupool", "plan", "--total", "10GiB", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
