"""Configuration: bad values are refused at construction with a message naming them."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat

import numpy as np
import pytest
import tasks

from gpupool import ConfigurationError, DeviceOutOfMemoryError, GpuPoolExecutor
from gpupool.testing import SimulatedDevice, SimulatedHost


@pytest.fixture(scope="module")
def host():
    with SimulatedHost(
        devices=[SimulatedDevice(total="44.39GiB", co_tenants={"serve": "9.54GiB"})],
        cpus=8,
        host_ram="64GiB",
    ) as h:
        yield h


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ("abc", r"^task_peak='abc' is not a byte size"),
        (-1, r"^task_peak=-1 is negative"),
        (0, r"^task_peak=0 is zero"),
        ("NaN", r"^task_peak='NaN'"),
        ("inf", r"^task_peak='inf'"),
        (True, r"^task_peak=True is not a byte size"),
    ],
    ids=["abc", "minus-one", "zero", "nan", "inf", "bool"],
)
def test_bad_task_peak_is_refused(host, value, pattern):
    """task_peak must be a positive, finite size."""
    with pytest.raises(ConfigurationError, match=pattern):
        GpuPoolExecutor(task_peak=value)


@pytest.mark.parametrize("value", [0, -3])
def test_bad_max_workers_is_refused(host, value):
    """max_workers of 0 or below raises CPython's ValueError."""
    with pytest.raises(ValueError, match=r"^max_workers must be greater than 0$"):
        GpuPoolExecutor(max_workers=value, task_peak="1GiB")


@pytest.mark.parametrize("value", [7, "GPU-does-not-exist"])
def test_unknown_device_is_refused(host, value):
    """A device index or UUID that does not exist is refused, naming it."""
    with pytest.raises(ConfigurationError, match=str(value)):
        GpuPoolExecutor(task_peak="1GiB", devices=[value])


def test_log_path_in_a_missing_directory_is_refused(host, tmp_path):
    """log_path in a directory that does not exist is refused."""
    path = tmp_path / "missing" / "run.jsonl"
    with pytest.raises(ConfigurationError, match=r"does not exist"):
        GpuPoolExecutor(task_peak="1GiB", log_path=path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to a read-only directory")
def test_log_path_in_a_read_only_directory_is_refused(host, tmp_path):
    """log_path in a directory that cannot be written is refused."""
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(ConfigurationError, match=r"cannot be written"):
            GpuPoolExecutor(task_peak="1GiB", log_path=tmp_path / "run.jsonl")
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_log_path_that_is_a_directory_is_refused(host, tmp_path):
    """log_path naming a directory is refused."""
    with pytest.raises(ConfigurationError, match=r"is a directory"):
        GpuPoolExecutor(task_peak="1GiB", log_path=tmp_path)


def test_reserve_larger_than_the_card_is_refused(host):
    """A reserve as large as the card is refused, naming both figures."""
    with pytest.raises(ConfigurationError, match=r"^reserve=100\.00 GiB is not smaller than"):
        GpuPoolExecutor(task_peak="1GiB", reserve="100GiB")


def test_fork_context_is_refused(host):
    """A fork mp_context is refused: CUDA does not survive fork."""
    with pytest.raises(ConfigurationError, match=r"fork"):
        GpuPoolExecutor(task_peak="1GiB", mp_context=multiprocessing.get_context("fork"))


@pytest.mark.parametrize(
    ("context", "pattern"),
    [
        (
            "spawn",
            r"^mp_context='spawn': pass a multiprocessing context, such as "
            r"multiprocessing\.get_context\('spawn'\)",
        ),
        (object(), r"^mp_context=<object object at .*>: pass a multiprocessing context"),
        (
            multiprocessing.get_context("forkserver"),
            r"^mp_context uses 'forkserver', .* only "
            r"spawn is supported\. Pass mp_context=None or multiprocessing\.get_context\('spawn'\)",
        ),
    ],
    ids=["string", "object", "forkserver"],
)
def test_what_is_not_a_spawn_context_is_refused(host, context, pattern):
    """A string, any other object, or a forkserver context is refused with a message that
    says what is supported (was: AttributeError, or forkserver taken and ignored)."""
    with pytest.raises(ConfigurationError, match=pattern):
        GpuPoolExecutor(task_peak="1GiB", mp_context=context)


def test_spawn_contexts_are_taken(host):
    """A spawn context is taken, and its pool runs tasks."""
    with GpuPoolExecutor(
        task_peak="1GiB", max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as ex:
        assert ex.submit(abs, -3).result() == 3


@pytest.mark.parametrize("devices", [[0, 0], ["GPU-a", 1, "GPU-a"]], ids=["index", "uuid"])
def test_duplicate_devices_are_refused(host, devices):
    """A device named twice is refused (was: taken silently)."""
    with pytest.raises(ConfigurationError, match=r"names .* twice: name each device once\.$"):
        GpuPoolExecutor(task_peak="1GiB", devices=devices)


def test_strict_needs_max_workers(host):
    """strict=True without max_workers is refused."""
    with pytest.raises(ConfigurationError, match=r"^strict=True needs max_workers"):
        GpuPoolExecutor(task_peak="1GiB", strict=True)


def test_bad_width_is_refused(host):
    """A fixed width must be a positive int."""
    with pytest.raises(ConfigurationError, match=r"^width=0"):
        GpuPoolExecutor(task_peak="1GiB", width=0)


def test_bad_option_peak_is_refused(host):
    """options(task_peak=...) validates the size at once."""
    with GpuPoolExecutor(task_peak="1GiB") as ex:
        with pytest.raises(ConfigurationError, match=r"^task_peak='lots'"):
            ex.options(task_peak="lots")


def test_initializer_must_be_callable(host):
    """A non-callable initializer raises CPython's TypeError."""
    with pytest.raises(TypeError, match=r"^initializer must be a callable$"):
        GpuPoolExecutor(task_peak="1GiB", initializer=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("initargs", [5, None])
def test_initargs_that_are_not_a_sequence_are_refused_saying_how(host, initargs):
    """initargs that cannot be unpacked into the initializer's call (every worker would die
    at boot) raise TypeError at construction, showing the tuple to pass."""
    with pytest.raises(
        TypeError, match=rf"^initargs={initargs!r}: pass the initializer's arguments as a tuple"
    ):
        GpuPoolExecutor(task_peak="1GiB", initializer=tasks.init_with, initargs=initargs)


def test_no_task_peak_runs_the_first_task_alone(host):
    """Without task_peak the first task of a key is priced at the whole room: width 1."""
    with GpuPoolExecutor(max_workers=4) as ex:
        assert ex.width == 1
        assert ex.decisions[0].bound is not None
        assert ex.decisions[0].bound.tasks_fit == 1
        assert ex.submit(tasks.sized, 1, "1GiB", 0.0).result(timeout=60) == 1


def test_env_and_jax_preallocation_reach_the_workers(host):
    """env= reaches every worker, and JAX preallocation is off by default."""
    with GpuPoolExecutor(1, task_peak="1GiB", env={"GPUPOOL_TEST_VAR": "yes"}) as ex:
        seen = ex.submit(tasks.environ).result(timeout=60)
    assert seen["GPUPOOL_TEST_VAR"] == "yes"
    assert seen["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert seen["CUDA_VISIBLE_DEVICES"] == host.device_uuid(0)


def test_retry_oom_off_sends_the_error_to_the_future(host):
    """With retry_oom=False a device OOM reaches its future at once."""
    with GpuPoolExecutor(2, task_peak="1GiB", retry_oom=False) as ex:
        future = ex.submit(tasks.sized, 0, "40GiB", 0.0)
        with pytest.raises(DeviceOutOfMemoryError) as info:
            future.result(timeout=60)
    assert info.value.device == 0
    assert "out of memory" in str(info.value.__cause__)


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"X": None}, r"env\['X'\]=None: values must be str"),
        ({"X": 3}, r"env\['X'\]=3: values must be str"),
        ({"A=B": "c"}, r"the key 'A=B' holds ="),
        ({"X": "a\0b"}, r"env\['X'\]='a\\x00b' holds a NUL byte"),
        ({"A\0": "b"}, r"the key 'A\\x00' holds a NUL byte"),
        ({"": "b"}, r"the key '' is not a non-empty str"),
        ({1: "b"}, r"the key 1 is not a non-empty str"),
        ([("X", "1")], r"pass a mapping"),
    ],
    ids=["none", "int", "equals-in-key", "nul-in-value", "nul-in-key", "empty", "int-key", "list"],
)
def test_bad_env_is_refused_at_construction(host, env, pattern):
    """env= entries that could not reach a worker as given are refused, naming them."""
    with pytest.raises(ConfigurationError, match=pattern):
        GpuPoolExecutor(task_peak="1GiB", env=env)


def test_env_reaches_the_worker_as_given(host):
    """A valid env= value reaches the worker exactly."""
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB", env={"GPUPOOL_TEST_X": "a b=c"}) as ex:
        assert ex.submit(tasks.environ).result(timeout=60)["GPUPOOL_TEST_X"] == "a b=c"


@pytest.mark.parametrize(
    ("devices", "pattern"),
    [
        (0, r"^devices=0: pass a list of device indexes or UUIDs, such as devices=\[0\]"),
        ("GPU-51a1a7ed", r"^devices='GPU-51a1a7ed': pass a list"),
        ([True], r"^devices entry True: each entry is a device index"),
        ([0.0], r"^devices entry 0.0: each entry is a device index"),
        ([-1], r"^devices entry -1: an index is 0 or more"),
        ([], r"^devices=\[\]: name at least one device"),
        ({0}, r"^devices=\{0\}: pass a list"),
    ],
    ids=["int", "str", "bool", "float", "negative", "empty", "set"],
)
def test_bad_devices_are_refused(host, devices, pattern):
    """devices= must be a list of indexes or UUIDs; a bare one is not read char by char."""
    with pytest.raises(ConfigurationError, match=pattern):
        GpuPoolExecutor(task_peak="1GiB", devices=devices)


@pytest.mark.parametrize("name", ["strict", "retry_oom"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_flags_must_be_bool(host, name, value):
    """strict and retry_oom take True or False only (a non-empty str is not True)."""
    with pytest.raises(ConfigurationError, match=rf"^{name}={value!r}: pass True or False"):
        GpuPoolExecutor(max_workers=2, task_peak="1GiB", **{name: value})


@pytest.mark.parametrize("name", ["task_peak", "reserve", "margin"])
def test_sizes_above_a_pebibyte_are_refused(host, name):
    """A size above 2**50 bytes is refused, at construction and in options()."""
    with pytest.raises(ConfigurationError, match=rf"^{name}={10**30!r} is .*more than the 2\*\*50"):
        GpuPoolExecutor(**{"task_peak": "1GiB", name: 10**30})
    with pytest.raises(ConfigurationError, match=r"^task_peak='2PiB' is"):
        GpuPoolExecutor(task_peak="1GiB").options(task_peak="2PiB")


def test_an_options_task_peak_is_parsed_once_not_at_each_submit(host, monkeypatch):
    """options(task_peak=...) parses the size once; each submit of the view reuses its bytes."""
    import gpupool._pool.executor as executor_module

    parsed = []
    parse = executor_module.parse_pool_size

    def counted(value, **kwargs):
        parsed.append(value)
        return parse(value, **kwargs)

    monkeypatch.setattr(executor_module, "parse_pool_size", counted)
    with GpuPoolExecutor(max_workers=2, task_peak="1GiB") as ex:
        big = ex.options(key="big", task_peak="2GiB")
        futures = [big.submit(tasks.sleep_return, i, 0.0) for i in range(3)]
        assert [f.result(timeout=60) for f in futures] == [0, 1, 2]
        assert ex.statistics().asks["big"].estimate_bytes == 2 * 1024**3
    assert parsed == ["2GiB"]


@pytest.mark.parametrize("name", ["task_peak", "reserve", "margin"])
def test_a_fraction_of_a_byte_is_refused_for_every_size(host, name):
    """task_peak=1.5 (1.5 GiB with its unit left out) is refused, naming the unit, never
    read as 1 byte: for every size the constructor takes."""
    with pytest.raises(
        ConfigurationError,
        match=rf"^{name}=1\.5 is a fraction of a byte: .*such as {name}='1\.5GiB'\.$",
    ):
        GpuPoolExecutor(**{"task_peak": "1GiB", name: 1.5})


@pytest.mark.parametrize("variable", ["GPUPOOL_TASK_PEAK", "GPUPOOL_RESERVE"])
def test_a_fraction_of_a_byte_in_a_variable_is_refused(host, monkeypatch, variable):
    """A GPUPOOL_* size variable of "1.5" is refused as the argument would be, naming it."""
    monkeypatch.setenv(variable, "1.5")
    with pytest.raises(
        ConfigurationError,
        match=rf"^{variable}='1\.5' is a fraction of a byte: .*\(read from the environment: "
        rf"fix or unset {variable}\)$",
    ):
        GpuPoolExecutor(max_workers=1)


def test_a_fraction_of_a_byte_in_options_is_refused_and_loses_nothing(host):
    """options(task_peak=1.5) is refused at once; the pool and its work go on."""
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        before = ex.submit(tasks.sleep_return, 1, 0.0)
        with pytest.raises(ConfigurationError, match=r"^task_peak=1\.5 is a fraction of a byte"):
            ex.options(key="k", task_peak=1.5)
        assert before.result(timeout=60) == 1
        assert ex.submit(tasks.sleep_return, 2, 0.0).result(timeout=60) == 2


def test_numpy_integers_are_taken_where_an_int_is(host, tmp_path):
    """max_workers, width, max_retries and a device index may be numpy integers (the standard
    pool takes such a max_workers); the log states them as plain numbers."""
    log = tmp_path / "run.jsonl"
    two = np.int64(2)
    with GpuPoolExecutor(
        max_workers=two,
        width=two,
        max_retries=np.int32(1),
        devices=[np.int64(0)],
        task_peak="1GiB",
        log_path=log,
    ) as ex:
        assert ex.submit(tasks.sleep_return, 7, 0.0).result(timeout=60) == 7
        assert ex.width == 2
    started = json.loads(log.read_text().splitlines()[0])
    assert (started["setting_max_workers"], started["setting_width"]) == (2, 2)
    assert (started["setting_max_retries"], started["setting_devices"]) == (1, "0")


def test_env_that_the_cards_pinning_would_override_is_refused(host):
    """env= naming the variable that pins each worker to its card, with another value, is
    refused (it would never reach a worker), pointing at devices=; the pinned value itself
    is taken."""
    with pytest.raises(
        ConfigurationError,
        match=r"^env\['CUDA_VISIBLE_DEVICES'\]='0': the pool sets CUDA_VISIBLE_DEVICES in "
        r"each worker to pin it to its card \('GPU-.*' on card 0\), .*devices=\[\.\.\.\]",
    ):
        GpuPoolExecutor(task_peak="1GiB", env={"CUDA_VISIBLE_DEVICES": "0"})
    with GpuPoolExecutor(task_peak="1GiB", env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) as ex:
        assert ex.submit(tasks.environ).result(timeout=60)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_task_key_longer_than_a_name_is_refused(host):
    """options(key=...) of more than 1000 characters (a str() of a whole object, say) is
    refused, naming its length: every record about its tasks carries it, and past 1 MiB a
    line of the log is more than gpupool postmortem reads."""
    with GpuPoolExecutor(max_workers=1, task_peak="1GiB") as ex:
        with pytest.raises(
            ConfigurationError,
            match=r"^key='k{40}\.\.\. \[cut: .*\]' has 1001 characters: a task key is a name of "
            r"at most 1000 \(it is on every record about its tasks\); pass a short name",
        ):
            ex.options(key="k" * 1001)
        assert ex.options(key="k" * 1000).submit(tasks.sleep_return, 3, 0.0).result(timeout=60) == 3


def test_more_workers_than_a_pool_runs_are_refused(host, monkeypatch):
    """max_workers, width and GPUPOOL_MAX_WORKERS above 4096 (a process each) are refused,
    naming the most, as CPython's pool refuses more than 61 on Windows; 4096 is taken."""
    with pytest.raises(
        ValueError, match=r"^max_workers must be <= 4096, got 100000000000000000000"
    ):
        GpuPoolExecutor(task_peak="1GiB", max_workers=10**20)
    with pytest.raises(ConfigurationError, match=r"^width=4097: .*of at most 4096"):
        GpuPoolExecutor(task_peak="1GiB", width=4097)
    GpuPoolExecutor(task_peak="1GiB", max_workers=4096).shutdown()
    monkeypatch.setenv("GPUPOOL_MAX_WORKERS", "4097")
    with pytest.raises(ConfigurationError, match=r"^GPUPOOL_MAX_WORKERS='4097': .* 1 to 4096"):
        GpuPoolExecutor(task_peak="1GiB")


def test_a_sensor_class_instead_of_a_sensor_is_refused(host):
    """sensor= given the class rather than an object is refused at once, naming the fix
    (its methods are callable, so it failed later with a missing 'self')."""
    kind = type(host.sensor())
    with pytest.raises(
        ConfigurationError, match=rf"^sensor=<class '.*\.{kind.__name__}'> is a class: pass a"
    ):
        GpuPoolExecutor(task_peak="1GiB", sensor=kind)
