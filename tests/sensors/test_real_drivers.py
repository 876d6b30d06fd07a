"""What real drivers do that the first fakes did not: lost cards, MIG, CUDA's order, accounting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_pynvml import NVML_ERROR_GPU_IS_LOST, FakeCard, FakePynvml, GiB, h100

from gpupool import ConfigurationError, DeviceUnreadableError
from gpupool._sensors.census import read_census
from gpupool._sensors.host import is_descendant
from gpupool._sensors.nvml import NvmlSensor

DATA = Path(__file__).parent.parent / "data" / "hosts"
GB10_MEMINFO = DATA / "gb10" / "proc" / "meminfo"
KIB = 1024


def sensor_for(monkeypatch: pytest.MonkeyPatch, fake: FakePynvml) -> NvmlSensor:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("NVML_MPS_DEVICE_ENUMERATION", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return NvmlSensor(host_root=DATA / "v2_container", meminfo_path=GB10_MEMINFO)


# -- item 5: one bad card ----------------------------------------------------------------


def test_a_lost_card_does_not_fail_the_census(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU_IS_LOST on card 1's UUID leaves card 1 out with its reason; card 0 is read."""
    cards = [h100(0), h100(1, errors={"nvmlDeviceGetUUID": NVML_ERROR_GPU_IS_LOST})]
    census, infos = read_census(sensor_for(monkeypatch, FakePynvml(cards)), pid=os.getpid())
    assert [info.uuid for info in infos] == [h100(0).uuid]
    assert census.cards[0].readable
    assert census.reason is not None
    assert "device 1 is left out: nvmlDeviceGetUUID failed" in census.reason
    assert "GPU is lost" in census.reason


def test_a_lost_card_hidden_by_cuda_visible_devices_is_not_mentioned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CUDA_VISIBLE_DEVICES=0, a lost card 1 is simply not visible."""
    cards = [h100(0), h100(1, errors={"nvmlDeviceGetHandleByIndex": NVML_ERROR_GPU_IS_LOST})]
    census, infos = read_census(
        sensor_for(monkeypatch, FakePynvml(cards)), visible_devices="0", pid=os.getpid()
    )
    assert [info.uuid for info in infos] == [h100(0).uuid]
    assert census.reason is None


def test_a_card_whose_mig_mode_fails_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A card that answers its UUID but not its MIG mode is unreadable (width 1), not dropped."""
    cards = [h100(0), h100(1, errors={"nvmlDeviceGetMigMode": NVML_ERROR_GPU_IS_LOST})]
    sensor = sensor_for(monkeypatch, FakePynvml(cards))
    census, infos = read_census(sensor, pid=os.getpid())
    assert len(infos) == 2
    assert census.cards[0].readable
    assert not census.cards[1].readable
    assert "nvmlDeviceGetMigMode failed" in (census.cards[1].reason or "")
    with pytest.raises(DeviceUnreadableError, match=r"GPU is lost"):
        sensor.read_memory(infos[1])


def test_asking_for_a_card_that_cannot_be_identified_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """devices=[1] on a card without a readable UUID is a ConfigurationError naming the cause."""
    cards = [h100(0), h100(1, errors={"nvmlDeviceGetUUID": NVML_ERROR_GPU_IS_LOST})]
    with pytest.raises(ConfigurationError, match=r"could not identify: nvmlDeviceGetUUID failed"):
        read_census(sensor_for(monkeypatch, FakePynvml(cards)), devices=[1], pid=os.getpid())


# -- item 6: the pool's own children on unified memory ----------------------------------


def test_unified_memory_counts_our_children_as_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real child process of ours on a GB10 leaves free at MemAvailable, not MemFree."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        card = h100(0, memory="unified", compute=[(os.getpid(), GiB), (child.pid, 2 * GiB)])
        sensor = sensor_for(monkeypatch, FakePynvml([card]))
        reading = sensor.read_memory(sensor.read_devices()[0])
    finally:
        child.communicate(b"", timeout=30)
    assert reading.unified
    assert reading.free_bytes == 112_345_678 * KIB  # MemAvailable in the GB10 sample


def test_unified_memory_with_a_foreign_process_uses_memfree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that is not ours (PID 1 here) is a competitor: free is MemFree."""
    card = h100(0, memory="unified", compute=[(os.getpid(), GiB), (1, 2 * GiB)])
    sensor = sensor_for(monkeypatch, FakePynvml([card]))
    reading = sensor.read_memory(sensor.read_devices()[0])
    assert reading.free_bytes == 41_234_560 * KIB  # MemFree in the GB10 sample


def test_is_descendant_follows_parents() -> None:
    """A child is a descendant of its parent and of its parent's parent; PID 1 is not ours."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert is_descendant(child.pid, os.getpid())
        assert is_descendant(child.pid, os.getppid())
        assert is_descendant(os.getpid(), os.getpid())
        assert not is_descendant(1, os.getpid())
        assert not is_descendant(os.getpid(), child.pid)
    finally:
        child.communicate(b"", timeout=30)


# -- item 7: accounting's NOT_AVAILABLE ---------------------------------------------------


def test_accounting_not_available_is_none_not_a_type_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The binding raises TypeError for maxMemoryUsage NOT_AVAILABLE; the sensor answers None."""
    card = h100(0, accounting={os.getpid(): None})
    sensor = sensor_for(monkeypatch, FakePynvml([card]))
    assert sensor.read_process_max_bytes(sensor.read_devices()[0], os.getpid()) is None


# -- item 8: CUDA's order is not NVML's --------------------------------------------------


def _mixed() -> list[FakeCard]:
    return [h100(0, name="NVIDIA A100-SXM4-80GB"), h100(1, name="Tesla T4", total=16 * GiB)]


def test_index_entries_on_mixed_cards_without_pci_order_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA_VISIBLE_DEVICES=1, CUDA_DEVICE_ORDER unset, mixed cards: refused, naming the fix."""
    sensor = sensor_for(monkeypatch, FakePynvml(_mixed()))
    with pytest.raises(ConfigurationError, match=r"Set CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        read_census(sensor, visible_devices="1", pid=os.getpid())


def test_index_entries_are_read_with_pci_order_or_uuids(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA_DEVICE_ORDER=PCI_BUS_ID, or by UUID, mixed cards resolve to the right card."""
    sensor = sensor_for(monkeypatch, FakePynvml(_mixed()))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    _, infos = read_census(sensor, visible_devices="1", pid=os.getpid())
    assert [info.name for info in infos] == ["Tesla T4"]
    _, infos = read_census(sensor, visible_devices=h100(1).uuid, pid=os.getpid())
    assert [info.name for info in infos] == ["Tesla T4"]


def test_index_entries_on_identical_cards_need_no_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """On one model of card, fastest first is PCI order: index entries are read as such."""
    sensor = sensor_for(monkeypatch, FakePynvml([h100(0), h100(1)]))
    _, infos = read_census(sensor, visible_devices="1", pid=os.getpid())
    assert [info.uuid for info in infos] == [h100(1).uuid]


# -- item 9: a MIG-enabled card's GPU- UUID --------------------------------------------------


def test_a_mig_cards_gpu_uuid_selects_its_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=GPU-<MIG-enabled card> selects its MIG instances, by their UUIDs."""
    slots: list[FakeCard | None] = [
        FakeCard(uuid="MIG-aaaa", name="MIG 3g.40gb", total=40 * GiB, free=39 * GiB),
        None,
        FakeCard(uuid="MIG-bbbb", name="MIG 3g.40gb", total=40 * GiB, free=39 * GiB),
    ]
    cards = [h100(0), h100(1, mig_slots=slots)]
    sensor = sensor_for(monkeypatch, FakePynvml(cards))
    census, infos = read_census(sensor, visible_devices=h100(1).uuid, pid=os.getpid())
    assert [info.uuid for info in infos] == ["MIG-aaaa", "MIG-bbbb"]
    assert all(info.parent_uuid == h100(1).uuid for info in infos)
    assert census.reason is None
    _, infos = read_census(sensor, devices=[h100(1).uuid[:12]], pid=os.getpid())
    assert [info.uuid for info in infos] == ["MIG-aaaa", "MIG-bbbb"]


def test_a_non_mig_card_answers_mig_mode_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100 with MIG off answers [0, 0], as a real one does, and is read as one card."""
    fake = FakePynvml([h100(0)])
    sensor = sensor_for(monkeypatch, fake)
    (info,) = sensor.read_devices()
    assert fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(0)) == [0, 0]
    assert not info.mig


def test_a_driver_without_v3_process_calls_uses_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the unversioned call raises NVMLLibraryMismatchError, the _v2 rows are read."""
    card = h100(0, process_api="v2", compute=[(4242, 3 * GiB)])
    sensor = sensor_for(monkeypatch, FakePynvml([card]))
    rows = sensor.read_processes(sensor.read_devices()[0])
    assert rows is not None
    assert [(r.pid, r.used_bytes) for r in rows] == [(4242, 3 * GiB)]
