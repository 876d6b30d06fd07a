"""Configuration from the environment: ``LOKY_MAX_CPU_COUNT`` and the ``GPUPOOL_*`` variables.

Precedence: an argument given to the constructor, then the variable, then
the default. A bad value is refused at construction, naming the variable.
"""

from __future__ import annotations

import json

import pytest

from gpupool import ConfigurationError, GpuPoolExecutor
from gpupool._core.units import GiB, MiB
from gpupool.testing import SimulatedDevice, SimulatedHost

VARIABLES = (
    "LOKY_MAX_CPU_COUNT",
    "GPUPOOL_MAX_WORKERS",
    "GPUPOOL_TASK_PEAK",
    "GPUPOOL_RESERVE",
    "GPUPOOL_LOG_PATH",
    "GPUPOOL_PROGRESS",
    "GPUPOOL_ON_INTERRUPT",
    "GPUPOOL_MAX_RETRIES",
    "GPUPOOL_ROOM_WAIT_S",
)


@pytest.fixture(scope="module")
def host():
    with SimulatedHost(devices=[SimulatedDevice(total="40GiB")], cpus=8, host_ram="64GiB") as h:
        yield h


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _constructed(ex: GpuPoolExecutor) -> dict[str, object]:
    record = ex.decisions[0].to_dict()
    assert record["event"] == "constructed"
    return record


def test_loky_max_cpu_count_caps_the_cpus_term(host, monkeypatch):
    """LOKY_MAX_CPU_COUNT=2 on an 8-CPU host: the CPU term and default max_workers are 2."""
    monkeypatch.setenv("LOKY_MAX_CPU_COUNT", "2")
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        record = _constructed(ex)
        assert ex.census.host.cpus == 2
        assert "LOKY_MAX_CPU_COUNT=2" in ex.census.host.cpu_source
        assert record["cpus"] == 2
        assert record["ceiling"] == 2
        assert ex.width == 2


def test_loky_max_cpu_count_above_the_host_changes_nothing(host, monkeypatch):
    """A cap above the usable CPUs leaves the host's count (a cap, never a raise)."""
    monkeypatch.setenv("LOKY_MAX_CPU_COUNT", "64")
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        assert ex.census.host.cpus == 8
        assert ex.census.host.cpu_source == "simulator"


@pytest.mark.parametrize("value", ["two", "1.5", "0", "-1", ""])
def test_bad_loky_max_cpu_count_is_refused(host, monkeypatch, value):
    """A LOKY_MAX_CPU_COUNT that is not a whole number of at least 1 is refused, naming it."""
    monkeypatch.setenv("LOKY_MAX_CPU_COUNT", value)
    with pytest.raises(
        ConfigurationError,
        match=r"^LOKY_MAX_CPU_COUNT='.*': .*whole number.*unset LOKY_MAX_CPU_COUNT",
    ):
        GpuPoolExecutor(task_peak="1GiB")


def test_task_peak_from_the_environment(host, monkeypatch):
    """GPUPOOL_TASK_PEAK prices tasks when task_peak is not given."""
    monkeypatch.setenv("GPUPOOL_TASK_PEAK", "3GiB")
    with GpuPoolExecutor() as ex:
        assert _constructed(ex)["ask_bytes"] == 3 * GiB


def test_an_argument_beats_the_environment(host, monkeypatch):
    """task_peak= and max_workers= given explicitly win over their variables."""
    monkeypatch.setenv("GPUPOOL_TASK_PEAK", "3GiB")
    monkeypatch.setenv("GPUPOOL_MAX_WORKERS", "3")
    with GpuPoolExecutor(5, task_peak="2GiB") as ex:
        record = _constructed(ex)
        assert record["ask_bytes"] == 2 * GiB
        assert record["max_workers"] == 5


def test_max_workers_and_reserve_from_the_environment(host, monkeypatch):
    """GPUPOOL_MAX_WORKERS and GPUPOOL_RESERVE stand for the arguments left out."""
    monkeypatch.setenv("GPUPOOL_MAX_WORKERS", "3")
    monkeypatch.setenv("GPUPOOL_RESERVE", "512MiB")
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        record = _constructed(ex)
        assert record["max_workers"] == 3
        assert record["reserve_bytes"] == 512 * MiB
        assert ex.width == 3


def test_log_path_from_the_environment(host, monkeypatch, tmp_path):
    """GPUPOOL_LOG_PATH writes the decision log there."""
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("GPUPOOL_LOG_PATH", str(path))
    with GpuPoolExecutor(task_peak="1GiB"):
        pass
    events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
    assert "constructed" in events


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        (
            "GPUPOOL_TASK_PEAK",
            "abc",
            r"^GPUPOOL_TASK_PEAK='abc' is not a byte size.*6GiB.*unset GPUPOOL_TASK_PEAK",
        ),
        ("GPUPOOL_TASK_PEAK", "0", r"^GPUPOOL_TASK_PEAK='0' is zero"),
        ("GPUPOOL_RESERVE", "lots", r"^GPUPOOL_RESERVE='lots' is not a byte size"),
        ("GPUPOOL_MAX_WORKERS", "0", r"^GPUPOOL_MAX_WORKERS='0': .*whole number"),
        ("GPUPOOL_MAX_WORKERS", "four", r"^GPUPOOL_MAX_WORKERS='four': .*whole number"),
        ("GPUPOOL_PROGRESS", "maybe", r"^GPUPOOL_PROGRESS='maybe': .*'auto'"),
        ("GPUPOOL_ON_INTERRUPT", "later", r"^GPUPOOL_ON_INTERRUPT='later': .*'terminate'"),
        ("GPUPOOL_LOG_PATH", "", r"^GPUPOOL_LOG_PATH='': "),
        ("GPUPOOL_MAX_RETRIES", "-1", r"^GPUPOOL_MAX_RETRIES='-1': .*0 or more"),
        ("GPUPOOL_MAX_RETRIES", "two", r"^GPUPOOL_MAX_RETRIES='two': .*whole number"),
        ("GPUPOOL_MAX_RETRIES", "1.5", r"^GPUPOOL_MAX_RETRIES='1.5': .*whole number"),
        ("GPUPOOL_ROOM_WAIT_S", "-1", r"^GPUPOOL_ROOM_WAIT_S='-1': .*seconds, 0 or more"),
        ("GPUPOOL_ROOM_WAIT_S", "soon", r"^GPUPOOL_ROOM_WAIT_S='soon': .*seconds"),
        ("GPUPOOL_ROOM_WAIT_S", "nan", r"^GPUPOOL_ROOM_WAIT_S='nan': .*seconds"),
        ("GPUPOOL_ROOM_WAIT_S", "inf", r"^GPUPOOL_ROOM_WAIT_S='inf': .*unset GPUPOOL_ROOM_WAIT_S"),
    ],
)
def test_bad_values_are_refused_naming_the_variable(host, monkeypatch, name, value, pattern):
    """A bad value is refused at construction; the message names the variable and the fix."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=pattern):
        GpuPoolExecutor()


def test_a_log_path_in_a_missing_directory_is_refused_in_one_sentence(host, monkeypatch, tmp_path):
    """GPUPOOL_LOG_PATH in a directory that does not exist: the message names the variable,
    the directory and the fix, without the argument's own punctuation doubled."""
    path = tmp_path / "missing" / "run.jsonl"
    monkeypatch.setenv("GPUPOOL_LOG_PATH", str(path))
    with pytest.raises(ConfigurationError) as raised:
        GpuPoolExecutor()
    message = str(raised.value)
    assert message.startswith(f"GPUPOOL_LOG_PATH={str(path)!r}: ")
    assert "does not exist" in message
    assert message.endswith("; or unset GPUPOOL_LOG_PATH for the default.")
    assert ".;" not in message


def test_a_bad_variable_is_not_read_when_its_argument_is_given(host, monkeypatch):
    """An explicit argument wins, so its variable is never parsed."""
    monkeypatch.setenv("GPUPOOL_TASK_PEAK", "abc")
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        assert _constructed(ex)["ask_bytes"] == GiB


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("off", False), ("auto", None)])
def test_progress_from_the_environment(host, monkeypatch, value, expected):
    """GPUPOOL_PROGRESS reads on/off words and 'auto'."""
    monkeypatch.setenv("GPUPOOL_PROGRESS", value)
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        assert ex._progress is expected


def _settings(path) -> dict[str, object]:
    """The settings the pool ran with, from its decision log's ``run_started`` record."""
    first = json.loads(path.read_text().splitlines()[0])
    assert first["event"] == "run_started"
    return first


def test_retries_and_room_wait_from_the_environment(host, monkeypatch, tmp_path):
    """GPUPOOL_MAX_RETRIES and GPUPOOL_ROOM_WAIT_S stand for the arguments left out."""
    monkeypatch.setenv("GPUPOOL_MAX_RETRIES", "2")
    monkeypatch.setenv("GPUPOOL_ROOM_WAIT_S", "30.5")
    path = tmp_path / "run.jsonl"
    with GpuPoolExecutor(task_peak="1GiB", log_path=path):
        pass
    settings = _settings(path)
    assert settings["setting_max_retries"] == 2
    assert settings["setting_room_wait_s"] == 30.5


def test_retries_and_room_wait_default_without_the_environment(host, tmp_path):
    """Unset, the built-in defaults hold (5 retries, 120 s)."""
    path = tmp_path / "run.jsonl"
    with GpuPoolExecutor(task_peak="1GiB", log_path=path):
        pass
    settings = _settings(path)
    assert settings["setting_max_retries"] == 5
    assert settings["setting_room_wait_s"] == 120.0


def test_zero_retries_and_wait_given_beat_the_environment(host, monkeypatch, tmp_path):
    """max_retries=0 and room_wait_s=0 given explicitly win over their variables (a zero is
    an argument, not one left out); the variables are not read, so bad ones do not fail."""
    monkeypatch.setenv("GPUPOOL_MAX_RETRIES", "not a number")
    monkeypatch.setenv("GPUPOOL_ROOM_WAIT_S", "never")
    path = tmp_path / "run.jsonl"
    with GpuPoolExecutor(task_peak="1GiB", log_path=path, max_retries=0, room_wait_s=0):
        pass
    settings = _settings(path)
    assert settings["setting_max_retries"] == 0
    assert settings["setting_room_wait_s"] == 0.0
