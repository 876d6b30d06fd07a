"""The real NVML sensor on a real card (run with ``--run-gpu`` on a GPU host)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from gpupool._sensors.census import read_census
from gpupool._sensors.nvml import NvmlSensor

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.gpu


@pytest.fixture
def sensor() -> Iterator[NvmlSensor]:
    """A real NVML sensor, closed after the test."""
    nvml = NvmlSensor()
    yield nvml
    nvml.close()


@pytest.mark.gpu
def test_every_card_has_a_uuid_and_consistent_memory(sensor: NvmlSensor) -> None:
    """Each device has a GPU-/MIG- UUID and 0 <= free <= total, used + free <= total."""
    devices = sensor.read_devices()
    assert devices, "a GPU host lists at least one device"
    for device in devices:
        assert device.uuid.startswith(("GPU-", "MIG-"))
        reading = sensor.read_memory(device)
        assert reading.total_bytes > 0
        assert 0 <= reading.free_bytes <= reading.total_bytes
        assert reading.used_bytes + reading.free_bytes <= reading.total_bytes
        if reading.source == "nvml-v2":
            assert reading.reserved_bytes is not None
            assert reading.used_bytes + reading.free_bytes + reading.reserved_bytes == (
                reading.total_bytes
            )


@pytest.mark.gpu
def test_census_on_real_cards(sensor: NvmlSensor) -> None:
    """The census reads every visible card; this parent holds no context, so own is 0."""
    census, infos = read_census(sensor, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert census.driver
    assert len(census.cards) == len(infos) >= 1
    for position, card in enumerate(census.cards):
        assert card.device == position
        assert card.uuid == infos[position].uuid
        assert card.readable, card.reason
        assert card.total_bytes is not None
        assert card.free_bytes is not None
        assert card.own_bytes == 0
        assert card.co_tenant_bytes is not None
        assert 0 <= card.co_tenant_bytes <= card.total_bytes
        assert card.used_bytes == card.total_bytes - card.free_bytes


@pytest.mark.gpu
def test_process_rows_are_readable(sensor: NvmlSensor) -> None:
    """Per-process rows are a tuple (possibly empty) or None, never an error, on a healthy card."""
    for device in sensor.read_devices():
        rows = sensor.read_processes(device)
        if rows is not None:
            assert len({row.pid for row in rows}) == len(rows)
