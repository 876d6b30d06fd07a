"""A vendor that is not CUDA's runs a pool end to end through ``sensor=`` alone.

The sensor (``rocm_like.py``) lives in the test suite, and nothing in ``src/``
names it: its visible-devices variable narrows the parent's cards, its pinning
reaches the spawned workers, and the workers measure with the sensor its
factory makes there.
"""

from __future__ import annotations

import pickle

import pytest
import rocm_like
from rocm_like import RocmLikeSensor, card_name

from gpupool import GpuPoolExecutor
from gpupool._core.units import GiB, MiB
from gpupool._errors import ConfigurationError
from gpupool._sensors.base import DeviceInfo
from gpupool.testing import SimulatedDevice, SimulatedHost


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """Two simulated cards; the parent sees card 1 through HIP_VISIBLE_DEVICES only."""
    for name in ("CUDA_DEVICE_ORDER", "LOKY_MAX_CPU_COUNT", "GPUPOOL_MAX_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", card_name(1))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # hides every card from CUDA: not ours
    devices = [SimulatedDevice(total="40GiB"), SimulatedDevice(total="40GiB")]
    with SimulatedHost(devices, cpus=4, host_ram="64GiB", context="300MiB") as h:
        yield h


def test_a_second_vendor_runs_a_pool_through_sensor_alone(host: SimulatedHost) -> None:
    """HIP_VISIBLE_DEVICES picks the card, workers are pinned by it, and peaks are measured."""
    sensor = RocmLikeSensor(host.ledger_path)
    with GpuPoolExecutor(max_workers=2, task_peak="2GiB", sensor=sensor) as ex:
        futures = [ex.submit(rocm_like.pinned_task, i, "1GiB", host.ledger_path) for i in range(4)]
        results = [f.result(timeout=60) for f in futures]
        ask = ex.statistics().asks["rocm_like.pinned_task"]
        measured = [d.to_dict() for d in ex.decisions if d.event == "measured"]
        census = ex.census
    assert census.sensor == "rocm-like"
    assert [card.uuid for card in census.cards] == [card_name(1)]
    assert [i for i, _ in results] == [0, 1, 2, 3]
    for _, seen in results:
        # The vendor's pinning, and none of CUDA's: the parent's own CUDA value is inherited.
        assert seen == {
            "HIP_VISIBLE_DEVICES": card_name(1),
            "CUDA_VISIBLE_DEVICES": "-1",
            "CUDA_DEVICE_ORDER": None,
        }
    assert host.device_peak(0) == 0
    assert host.device_peak(1) >= 1 * GiB + 300 * MiB
    assert ask.basis == "measured"
    assert ask.measured_peak_bytes == 1 * GiB + 300 * MiB
    assert measured and measured[0]["peak_source"] == "rocm-like-exact"
    assert host.out_of_memory_events == []


def test_a_second_vendor_s_variable_hides_what_it_does_not_list(
    host: SimulatedHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry the vendor's grammar does not know hides the rest, with the vendor's note."""
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "7")
    with GpuPoolExecutor(
        max_workers=1, task_peak="1GiB", sensor=RocmLikeSensor(host.ledger_path)
    ) as ex:
        census = ex.census
    assert census.cards == ()
    assert census.reason is not None
    assert "HIP_VISIBLE_DEVICES entry '7' matches no device" in census.reason


def test_the_sensors_factories_are_picklable_and_make_their_own_kind(host: SimulatedHost) -> None:
    """Each sensor's worker factory survives pickling and makes a sensor of its vendor."""
    card = DeviceInfo(index=0, uuid=card_name(0), name="Radeon-like")
    for sensor in (RocmLikeSensor(host.ledger_path), host.sensor()):
        made = pickle.loads(pickle.dumps(sensor.worker_factory()))()
        assert made.name == sensor.name
        assert made.read_memory(card).total_bytes == 40 * GiB
    assert host.sensor().worker_env(card) == {
        "CUDA_VISIBLE_DEVICES": card_name(0),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUPOOL_SIMULATOR": host.ledger_path,
    }


class _PinsWithANumber(RocmLikeSensor):
    def worker_env(self, device: DeviceInfo | None) -> dict[str, str]:
        return {"HIP_VISIBLE_DEVICES": 0}  # type: ignore[dict-item]  # a number, not a str


class _FactoryHoldsALock(RocmLikeSensor):
    def worker_factory(self):  # type: ignore[no-untyped-def]
        import threading

        lock = threading.Lock()
        return lambda: (lock, RocmLikeSensor(self._ledger_path))[1]


@pytest.mark.parametrize(
    ("sensor_class", "message"),
    [
        (
            _PinsWithANumber,
            r"^_PinsWithANumber\.worker_env\('HIP-0001'\) cannot pin a worker: "
            r"env\['HIP_VISIBLE_DEVICES'\]=0: values must be str",
        ),
        (_FactoryHoldsALock, r"^_FactoryHoldsALock\.worker_factory\(\) cannot reach a worker: "),
    ],
)
def test_a_sensor_whose_vendor_facts_cannot_reach_a_worker_is_refused_at_construction(
    host: SimulatedHost, sensor_class: type[RocmLikeSensor], message: str
) -> None:
    """A sensor's pinning and worker factory are checked once, as ``env=`` is: the error names
    the sensor and the method, before a worker is started (not five failed starts later)."""
    sensor = sensor_class(host.ledger_path)
    with pytest.raises(ConfigurationError, match=message):
        GpuPoolExecutor(max_workers=2, task_peak="2GiB", sensor=sensor)
