"""NvmlSensor against a fake ``pynvml``: every driver shape the census has to read."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    FakeCard,
    FakePynvml,
    GiB,
    h100,
)

from gpupool import DeviceUnreadableError, NoDriverError, SensorError
from gpupool._sensors.nvml import NvmlSensor

DATA = Path(__file__).parent.parent / "data" / "hosts"
GB10_MEMINFO = DATA / "gb10" / "proc" / "meminfo"
KIB = 1024


def install(monkeypatch: pytest.MonkeyPatch, fake: FakePynvml) -> FakePynvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_lists_every_card_by_index_with_uuid_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8-GPU host lists 8 devices in NVML order with their UUIDs and names."""
    install(monkeypatch, FakePynvml([h100(i) for i in range(8)]))
    devices = NvmlSensor().read_devices()
    assert [d.index for d in devices] == list(range(8))
    assert devices[3].uuid == h100(3).uuid
    assert devices[3].name == "NVIDIA H100 80GB HBM3"
    assert not any(d.mig for d in devices)


def test_nvml_is_initialised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlInit runs lazily, once per sensor, and close() shuts NVML down once."""
    fake = install(monkeypatch, FakePynvml([h100(0)]))
    sensor = NvmlSensor()
    assert fake.init_calls == 0
    device = sensor.read_devices()[0]
    sensor.read_memory(device)
    sensor.read_processes(device)
    assert fake.init_calls == 1
    sensor.close()
    sensor.close()
    assert fake.shutdown_calls == 1


def test_memory_v2_records_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    """A current driver answers memory info v2: reserved is its own term, source nvml-v2."""
    card = h100(0, total=80 * GiB, free=60 * GiB, reserved=GiB // 2)
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor()
    reading = sensor.read_memory(sensor.read_devices()[0])
    assert reading.source == "nvml-v2"
    assert reading.total_bytes == 80 * GiB
    assert reading.free_bytes == 60 * GiB
    assert reading.reserved_bytes == GiB // 2
    assert reading.used_bytes == 80 * GiB - 60 * GiB - GiB // 2
    assert not reading.unified


@pytest.mark.parametrize("mode", ["v1-only", "v2-not-supported", "old-binding"])
def test_memory_falls_back_to_v1(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Without v2 (old driver, v2 unsupported, old binding) v1 answers: reserved None."""
    card = h100(0, total=40 * GiB, free=30 * GiB, memory=mode)
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor()
    reading = sensor.read_memory(sensor.read_devices()[0])
    assert reading.source == "nvml-v1"
    assert reading.reserved_bytes is None
    assert (reading.total_bytes, reading.free_bytes, reading.used_bytes) == (
        40 * GiB,
        30 * GiB,
        10 * GiB,
    )


def test_unified_memory_alone_uses_memavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """GB10: memory info NOT_SUPPORTED, no other process -> MemTotal and MemAvailable."""
    card = FakeCard(uuid="GPU-gb10", name="NVIDIA GB10", memory="unified")
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor(meminfo_path=GB10_MEMINFO)
    reading = sensor.read_memory(sensor.read_devices()[0])
    assert reading.unified
    assert reading.source == "meminfo"
    assert reading.reserved_bytes is None
    assert reading.total_bytes == 128439952 * KIB
    assert reading.free_bytes == 112345678 * KIB


def test_unified_memory_with_co_tenant_uses_memfree(monkeypatch: pytest.MonkeyPatch) -> None:
    """GB10 with another process on the device -> free is MemFree (page cache counts as used)."""
    card = FakeCard(
        uuid="GPU-gb10",
        name="NVIDIA GB10",
        memory="unified",
        compute=[(os.getpid(), 0), (os.getpid() + 1, 20 * GiB)],
    )
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor(meminfo_path=GB10_MEMINFO)
    reading = sensor.read_memory(sensor.read_devices()[0])
    assert reading.free_bytes == 41234560 * KIB
    assert reading.used_bytes == (128439952 - 41234560) * KIB


def test_unified_memory_without_meminfo_is_unreadable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Unified memory whose meminfo cannot be read is unreadable, never empty."""
    card = FakeCard(uuid="GPU-gb10", memory="unified")
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor(meminfo_path=tmp_path / "missing")
    with pytest.raises(DeviceUnreadableError, match=r"could not be read"):
        sensor.read_memory(sensor.read_devices()[0])


def test_processes_union_compute_and_graphics_by_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PID in both lists appears once; graphics-only processes are kept."""
    card = h100(0, compute=[(100, 2 * GiB), (200, GiB)], graphics=[(100, 2 * GiB), (300, 64)])
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor()
    rows = sensor.read_processes(sensor.read_devices()[0])
    assert rows is not None
    assert sorted((r.pid, r.used_bytes) for r in rows) == [(100, 2 * GiB), (200, GiB), (300, 64)]


def test_used_gpu_memory_none_is_kept_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """usedGpuMemory None (WDDM, MIG) becomes used_bytes None, not 0."""
    install(monkeypatch, FakePynvml([h100(0, compute=[(100, None)])]))
    sensor = NvmlSensor()
    rows = sensor.read_processes(sensor.read_devices()[0])
    assert rows is not None
    assert rows[0].used_bytes is None


def test_processes_not_supported_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver without per-process rows answers None (unknown), not an empty list."""
    install(monkeypatch, FakePynvml([h100(0, processes_supported=False)]))
    sensor = NvmlSensor()
    assert sensor.read_processes(sensor.read_devices()[0]) is None


def test_mig_instances_are_devices_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MIG card lists its instances (empty slots skipped) in place of the parent card."""
    slots: list[FakeCard | None] = [
        FakeCard(uuid="MIG-aaaa", name="NVIDIA A100 MIG 3g.40gb", total=40 * GiB, free=39 * GiB),
        None,
        FakeCard(uuid="MIG-bbbb", name="NVIDIA A100 MIG 2g.20gb", total=20 * GiB, free=19 * GiB),
    ]
    install(monkeypatch, FakePynvml([h100(0), h100(1, mig_slots=slots)]))
    sensor = NvmlSensor()
    devices = sensor.read_devices()
    assert [(d.index, d.uuid, d.mig, d.mig_index) for d in devices] == [
        (0, h100(0).uuid, False, None),
        (1, "MIG-aaaa", True, 0),
        (1, "MIG-bbbb", True, 2),
    ]
    reading = sensor.read_memory(devices[2])
    assert (reading.total_bytes, reading.free_bytes) == (20 * GiB, 19 * GiB)


def test_no_library_raises_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlInit raising NVMLError_LibraryNotFound maps to NoDriverError."""
    install(monkeypatch, FakePynvml([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NoDriverError, match=r"NVML Shared Library Not Found"):
        NvmlSensor().read_devices()


def test_driver_not_loaded_raises_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlInit raising NVMLError_DriverNotLoaded maps to NoDriverError, and stays so."""
    fake = install(monkeypatch, FakePynvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    sensor = NvmlSensor()
    for _ in range(2):
        with pytest.raises(NoDriverError, match=r"Driver Not Loaded"):
            sensor.read_devices()
    assert fake.calls.count("nvmlInit") == 1


def test_real_binding_without_driver_raises_no_driver() -> None:
    """The installed nvidia-ml-py on a host without libnvidia-ml reports no driver."""
    if "pynvml" in sys.modules and isinstance(sys.modules["pynvml"], FakePynvml):
        pytest.skip("a fake pynvml is installed")
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this host has an NVIDIA driver")
    with pytest.raises(NoDriverError):
        NvmlSensor().read_devices()


def test_memory_error_mid_read_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML failing on one card's memory raises DeviceUnreadableError naming the card."""
    card = h100(2, errors={"nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_GPU_IS_LOST})
    install(monkeypatch, FakePynvml([h100(0), h100(1), card]))
    sensor = NvmlSensor()
    devices = sensor.read_devices()
    assert sensor.read_memory(devices[0]).source == "nvml-v2"
    with pytest.raises(DeviceUnreadableError, match=r"^device 2 \(GPU-.*GPU is lost"):
        sensor.read_memory(devices[2])


def test_process_error_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process-list error other than NOT_SUPPORTED raises DeviceUnreadableError."""
    errors = {"nvmlDeviceGetComputeRunningProcesses": NVML_ERROR_NO_PERMISSION}
    install(monkeypatch, FakePynvml([h100(0, errors=errors)]))
    sensor = NvmlSensor()
    with pytest.raises(DeviceUnreadableError, match=r"Insufficient Permissions"):
        sensor.read_processes(sensor.read_devices()[0])


def test_listing_error_is_a_sensor_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error reading the device count is a SensorError naming that call, not 'no driver'."""
    install(monkeypatch, FakePynvml([h100(0)], count_error=999))
    with pytest.raises(SensorError, match=r"listing devices") as info:
        NvmlSensor().read_devices()
    assert not isinstance(info.value, NoDriverError)


def test_read_host_reads_the_given_root() -> None:
    """read_host delegates to read_host_census under the sensor's host root."""
    host = NvmlSensor(host_root=DATA / "v2_container").read_host()
    assert host.available_ram_bytes == 16 * GiB - (6 * GiB - 2 * GiB)


def test_import_gpupool_does_not_import_pynvml() -> None:
    """Importing gpupool and its NVML sensor module leaves pynvml unloaded."""
    import subprocess

    code = (
        "import sys, gpupool, gpupool._sensors.nvml, gpupool._sensors.census\n"
        "import gpupool._commands.cli\n"
        "assert 'pynvml' not in sys.modules, 'pynvml imported'\n"
        "assert 'psutil' not in sys.modules, 'psutil imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_accounting_max_is_read_only_when_accounting_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """maxMemoryUsage comes back with accounting on; None with it off or for an unknown PID."""
    card = h100(0, accounting={100: 7 * GiB})
    install(monkeypatch, FakePynvml([card, h100(1)]))
    sensor = NvmlSensor()
    on, off = sensor.read_devices()
    assert sensor.read_process_max_bytes(on, 100) == 7 * GiB
    assert sensor.read_process_max_bytes(on, 999) is None
    assert sensor.read_process_max_bytes(off, 100) is None


def test_probe_prefers_accounting_when_it_rose_during_the_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe reports NVML accounting's maximum when it rose during the task, else sampling."""
    from gpupool._child.probe import Probe

    pid = os.getpid()
    # 9.5 GiB in use on the card: the rows below are within it.
    card = h100(0, free=70 * GiB, compute=[(pid, 1 * GiB)], accounting={pid: 2 * GiB})
    install(monkeypatch, FakePynvml([card]))
    sensor = NvmlSensor()
    device = sensor.read_devices()[0]

    probe = Probe(sensor, device, 0, pid)
    probe.start()
    card.accounting = {pid: 5 * GiB}  # a spike between samples, seen by the driver
    rose = probe.stop()
    assert (rose.device_peak_bytes, rose.device_source) == (5 * GiB, "nvml-accounting")

    probe.start()
    card.compute = [(pid, 3 * GiB)]  # below the lifetime maximum: accounting cannot tell
    stayed = probe.stop()
    assert (stayed.device_peak_bytes, stayed.device_source) == (3 * GiB, "nvml-sampled")


def test_a_spike_only_the_sampler_read_is_the_tasks_sampled_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row that rose and fell while the task ran, read only by the tree's sampler between
    the window's two ends, is the task's peak; the next window starts without it."""
    from gpupool._child.probe import Probe

    pid = os.getpid()
    card = h100(0, free=70 * GiB, compute=[(pid, 1 * GiB)])
    fake = install(monkeypatch, FakePynvml([card]))
    spike_read = threading.Event()
    read_rows = fake._processes

    def watched(handle: Any, function: str, rows: list[tuple[int, int | None]]) -> list[Any]:
        out = read_rows(handle, function, rows)
        if (pid, 6 * GiB) in rows:
            spike_read.set()
        return out

    monkeypatch.setattr(fake, "_processes", watched)
    sensor = NvmlSensor()
    probe = Probe(sensor, sensor.read_devices()[0], 0, pid)
    probe.start()
    card.compute = [(pid, 6 * GiB)]
    assert spike_read.wait(120), "the sampler never read the device while the task ran"
    card.compute = [(pid, 1 * GiB)]
    spiked = probe.stop()
    assert (spiked.device_peak_bytes, spiked.device_source) == (6 * GiB, "nvml-sampled")
    probe.start()
    calm = probe.stop()
    assert (calm.device_peak_bytes, calm.device_source) == (1 * GiB, "nvml-sampled")


def test_a_mig_instance_without_memory_info_is_unreadable_not_unified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MIG instance answering NOT_SUPPORTED is unreadable; the host's MemTotal is never used."""
    slots: list[FakeCard | None] = [FakeCard(uuid="MIG-cccc", memory="unified")]
    install(monkeypatch, FakePynvml([h100(0, mig_slots=slots)]))
    sensor = NvmlSensor(meminfo_path=GB10_MEMINFO)
    [device] = sensor.read_devices()
    with pytest.raises(DeviceUnreadableError, match=r"NOT_SUPPORTED on this MIG instance"):
        sensor.read_memory(device)
