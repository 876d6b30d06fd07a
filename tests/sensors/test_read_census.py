"""read_census over NvmlSensor and a fake ``pynvml``: co-tenants, containers, visibility."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_UNKNOWN,
    FakeCard,
    FakePynvml,
    GiB,
    h100,
)

from gpupool import ConfigurationError, SensorError
from gpupool._sensors.census import (
    OWN_ROW_MISSING_REASON,
    OWN_ROWS_UNAVAILABLE_REASON,
    read_census,
)
from gpupool._sensors.nvml import NvmlSensor

DATA = Path(__file__).parent.parent / "data" / "hosts"
ME = 4242
OTHER = 777


def sensor_for(monkeypatch: pytest.MonkeyPatch, fake: FakePynvml) -> NvmlSensor:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("NVML_MPS_DEVICE_ENUMERATION", raising=False)
    return NvmlSensor(host_root=DATA / "v2_container", meminfo_path=DATA / "gb10/proc/meminfo")


def eight_gpus() -> list[FakeCard]:
    cards = [h100(i) for i in range(8)]
    # Card 5: a serving parent (another team's job) holds 30 GiB; we hold 2 GiB.
    cards[5] = h100(
        5,
        total=80 * GiB,
        free=48 * GiB - GiB // 2,
        reserved=GiB // 2,
        compute=[(OTHER, 30 * GiB), (ME, 2 * GiB)],
    )
    return cards


def test_eight_gpus_with_a_co_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8-GPU host: every card is counted; the co-tenant comes from device totals."""
    census, infos = read_census(sensor_for(monkeypatch, FakePynvml(eight_gpus())), pid=ME)
    assert census.driver
    assert census.sensor == "nvml"
    assert [c.device for c in census.cards] == list(range(8))
    assert [i.uuid for i in infos] == [c.uuid for c in census.cards]
    busy = census.cards[5]
    assert busy.own_bytes == 2 * GiB
    assert busy.own_source == "process-row"
    assert busy.reserved_bytes == GiB // 2
    # total - free - own: the 30 GiB co-tenant plus the reserved memory.
    assert busy.co_tenant_bytes == 80 * GiB - (48 * GiB - GiB // 2) - 2 * GiB
    idle = census.cards[0]
    assert idle.own_bytes == 0
    assert idle.own_source == "process-row"
    assert idle.reason is None
    assert census.host.available_ram_bytes == 12 * GiB


def test_co_tenant_never_sums_process_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that read 0 in a container do not shrink the co-tenant figure."""
    card = h100(0, total=80 * GiB, free=40 * GiB, reserved=0, compute=[(OTHER, 0), (ME, 0)])
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml([card])), pid=ME)
    assert census.cards[0].co_tenant_bytes == 40 * GiB


def test_container_without_our_row_uses_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows listed but ours absent (namespaced PIDs): own 0 from the baseline, with the reason."""
    card = h100(0, total=80 * GiB, free=50 * GiB, reserved=0, compute=[(OTHER, 30 * GiB)])
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml([card])), pid=ME)
    only = census.cards[0]
    assert only.own_bytes == 0
    assert only.own_source == "baseline"
    assert only.reason == OWN_ROW_MISSING_REASON
    assert only.co_tenant_bytes == 30 * GiB


def test_rows_unavailable_uses_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-process rows at all (MIG, some drivers): baseline with its own reason."""
    card = h100(0, processes_supported=False)
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml([card])), pid=ME)
    assert census.cards[0].own_source == "baseline"
    assert census.cards[0].reason == OWN_ROWS_UNAVAILABLE_REASON


def test_our_row_without_bytes_uses_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our row with usedGpuMemory None gives the baseline, never a guessed figure."""
    card = h100(0, compute=[(ME, None)])
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml([card])), pid=ME)
    assert census.cards[0].own_bytes == 0
    assert census.cards[0].own_source == "baseline"
    assert census.cards[0].reason is not None
    assert "no byte count" in census.cards[0].reason


def test_v1_only_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A v1-only driver: reserved unknown, co-tenant still total - free - own."""
    card = h100(0, memory="v1-only", total=16 * GiB, free=10 * GiB, compute=[(ME, GiB)])
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml([card])), pid=ME)
    only = census.cards[0]
    assert only.source == "nvml-v1"
    assert only.reserved_bytes is None
    assert only.co_tenant_bytes == 5 * GiB


def test_gb10_unified_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GB10 card: unified, from meminfo, total MemTotal."""
    card = FakeCard(uuid="GPU-gb10", name="NVIDIA GB10", memory="unified")
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml([card])), pid=ME)
    only = census.cards[0]
    assert only.unified
    assert only.source == "meminfo"
    assert only.total_bytes == 128439952 * 1024


def test_mig_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG instances get pool indices of their own and are marked mig."""
    slots: list[FakeCard | None] = [
        FakeCard(uuid="MIG-aaaa", total=40 * GiB, free=39 * GiB, processes_supported=False),
        FakeCard(uuid="MIG-bbbb", total=40 * GiB, free=40 * GiB, processes_supported=False),
    ]
    census, infos = read_census(
        sensor_for(monkeypatch, FakePynvml([h100(0, mig_slots=slots)])), pid=ME
    )
    assert [(c.device, c.uuid, c.mig) for c in census.cards] == [
        (0, "MIG-aaaa", True),
        (1, "MIG-bbbb", True),
    ]
    assert [i.mig_index for i in infos] == [0, 1]
    assert census.cards[0].co_tenant_bytes == GiB


def test_unreadable_card_is_none_not_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML raising mid-read on one card leaves that card None with a reason; others read."""
    cards = [h100(0), h100(1, errors={"nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_GPU_IS_LOST})]
    census, _ = read_census(sensor_for(monkeypatch, FakePynvml(cards)), pid=ME)
    bad = census.cards[1]
    assert (bad.total_bytes, bad.free_bytes, bad.co_tenant_bytes) == (None, None, None)
    assert not bad.readable
    assert bad.reason is not None
    assert bad.reason.startswith("unreadable: device 1")
    assert census.cards[0].readable


def test_listing_error_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver that answers but cannot list devices raises SensorError, not 'no device'."""
    fake = FakePynvml([h100(0)], count_error=NVML_ERROR_UNKNOWN)
    with pytest.raises(SensorError, match=r"listing devices \(nvmlDeviceGetCount\)"):
        read_census(sensor_for(monkeypatch, fake), pid=ME)


@pytest.mark.parametrize("code", [NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_driver_is_no_device(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """nvmlInit failing for lack of library or driver gives driver=False, no cards, no error."""
    census, infos = read_census(sensor_for(monkeypatch, FakePynvml([], init_error=code)))
    assert not census.driver
    assert census.cards == ()
    assert infos == ()
    assert census.reason is not None
    assert census.reason.startswith("no NVIDIA driver or library: ")
    assert census.host.cpus >= 1


def test_visible_devices_as_indexes(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES='3,1' narrows to those cards, pool indices 0..n-1 in that order."""
    census, infos = read_census(
        sensor_for(monkeypatch, FakePynvml(eight_gpus())), visible_devices="3,1", pid=ME
    )
    assert [i.index for i in infos] == [3, 1]
    assert [c.device for c in census.cards] == [0, 1]
    assert [c.uuid for c in census.cards] == [h100(3).uuid, h100(1).uuid]


def test_visible_devices_as_uuids_and_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU- UUIDs, full or as a unique prefix, select their cards."""
    value = f"{h100(6).uuid},GPU-00000002"
    _, infos = read_census(
        sensor_for(monkeypatch, FakePynvml(eight_gpus())), visible_devices=value, pid=ME
    )
    assert [i.index for i in infos] == [6, 2]


def test_visible_devices_as_mig_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MIG- UUID selects that instance alone."""
    slots: list[FakeCard | None] = [FakeCard(uuid="MIG-aaaa-1"), FakeCard(uuid="MIG-bbbb-2")]
    _, infos = read_census(
        sensor_for(monkeypatch, FakePynvml([h100(0), h100(1, mig_slots=slots)])),
        visible_devices="MIG-bbbb-2",
        pid=ME,
    )
    assert [(i.index, i.uuid) for i in infos] == [(1, "MIG-bbbb-2")]


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_visible_devices_hiding_everything(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """An empty, '-1' or 'NoDevFiles' CUDA_VISIBLE_DEVICES leaves no device, and says so."""
    census, infos = read_census(
        sensor_for(monkeypatch, FakePynvml(eight_gpus())), visible_devices=value
    )
    assert census.driver
    assert census.cards == ()
    assert infos == ()
    assert census.reason is not None
    assert "hides every device" in census.reason


def test_visible_devices_invalid_entry_hides_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in CUDA, an entry matching nothing hides itself and every entry after it."""
    census, infos = read_census(
        sensor_for(monkeypatch, FakePynvml(eight_gpus())), visible_devices="0,2,-1,1", pid=ME
    )
    assert [i.index for i in infos] == [0, 2]
    assert census.reason is not None
    assert "'-1' matches no device" in census.reason


def test_devices_option_selects_by_index_and_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    """devices=[7, uuid of 4] selects those cards in that order."""
    _, infos = read_census(
        sensor_for(monkeypatch, FakePynvml(eight_gpus())), devices=[7, h100(4).uuid], pid=ME
    )
    assert [i.index for i in infos] == [7, 4]


@pytest.mark.parametrize(
    ("wanted", "pattern"),
    [
        ([9], r"^devices entry 9 does not exist on this host; visible devices: 0 GPU-"),
        (["GPU-deadbeef"], r"^devices entry 'GPU-deadbeef' does not exist on this host"),
        (["GPU-0000000"], r"^devices entry 'GPU-0000000' matches 8 devices"),
        (["cuda:0"], r"^devices entry 'cuda:0' is neither an index nor a GPU-/MIG- UUID"),
    ],
)
def test_devices_option_bad_value(
    monkeypatch: pytest.MonkeyPatch, wanted: list[int | str], pattern: str
) -> None:
    """A devices= entry that is missing, ambiguous or malformed raises ConfigurationError."""
    with pytest.raises(ConfigurationError, match=pattern) as info:
        read_census(sensor_for(monkeypatch, FakePynvml(eight_gpus())), devices=wanted)
    assert isinstance(info.value, ValueError)
    assert "NVIDIA H100 80GB HBM3" in str(info.value)


def test_devices_option_hidden_by_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A devices= entry hidden by CUDA_VISIBLE_DEVICES says so, listing the visible ones."""
    with pytest.raises(
        ConfigurationError,
        match=r"^devices entry 0 is hidden by CUDA_VISIBLE_DEVICES; visible devices: 2 GPU-",
    ):
        read_census(
            sensor_for(monkeypatch, FakePynvml(eight_gpus())), devices=[0], visible_devices="2"
        )


def test_mps_enumeration_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML_MPS_DEVICE_ENUMERATION set is recorded in the census reason."""
    sensor = sensor_for(monkeypatch, FakePynvml([h100(0)]))
    monkeypatch.setenv("NVML_MPS_DEVICE_ENUMERATION", "1")
    census, _ = read_census(sensor, pid=ME)
    assert census.reason is not None
    assert "NVML_MPS_DEVICE_ENUMERATION=1" in census.reason


def test_a_unicode_digit_in_cuda_visible_devices_is_an_invalid_entry() -> None:
    """'²' looks like a digit to str.isdigit but is no index: it hides what follows, no crash."""
    from gpupool._sensors.base import DeviceInfo
    from gpupool._sensors.cuda import parse_visible_devices

    listed = (DeviceInfo(index=0, uuid="GPU-aaaa", name="a"),)
    visible, note = parse_visible_devices("\u00b2", listed)
    assert visible == ()
    assert note is not None
