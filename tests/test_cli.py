"""The command line: ``gpupool census`` (driverless and fake hosts) and ``gpupool plan``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool._core.units import GiB
from gpupool.cli import main

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
        "cpus=16",
    ):
        assert term in out, term
    assert out.rstrip().splitlines()[-1].split() == ["width", "2"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--total", "lots"), ("--task-peak", "0"), ("--margin", "-1GiB"), ("--max-workers", "0")],
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
    assert data["width"] == min(64, ceiling["cpus"])
    assert any("no device" in str(note) for note in data["notes"])  # type: ignore[attr-defined]
    assert main(["plan"]) == 0
    assert "no device" in capsys.readouterr().out
