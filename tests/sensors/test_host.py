"""Host CPUs and RAM: the pure parsers on saved samples, and read_host_census on fake roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpupool._core.host import (
    CgroupCpu,
    CgroupMemory,
    MemInfo,
    derive_available_ram,
    derive_usable_cpus,
    parse_cfs_quota,
    parse_cpu_max,
    parse_meminfo,
    parse_memory_limit_in_bytes,
    parse_memory_max,
    parse_memory_stat,
    parse_proc_self_cgroup,
)
from gpupool._sensors.host import read_host_census

DATA = Path(__file__).parent.parent / "data" / "hosts"
KIB = 1024
GIB = 1024**3


def sample(*parts: str) -> str:
    return DATA.joinpath(*parts).read_text()


# -- parsers -------------------------------------------------------------------


def test_parse_meminfo_bare_metal() -> None:
    """Bare-metal meminfo: MemTotal, MemFree, MemAvailable in bytes (kB lines * 1024)."""
    info = parse_meminfo(sample("baremetal_v2", "proc", "meminfo"))
    assert info == MemInfo(
        total_bytes=2113481728 * KIB,
        free_bytes=1650212344 * KIB,
        available_bytes=1987654320 * KIB,
    )


def test_parse_meminfo_old_kernel_without_memavailable() -> None:
    """A kernel without MemAvailable (before 3.14) gives available_bytes None."""
    info = parse_meminfo(sample("old_kernel", "proc", "meminfo"))
    assert info.available_bytes is None
    assert info.total_bytes == 8061220 * KIB
    assert info.free_bytes == 5123456 * KIB


def test_parse_meminfo_rejects_text_without_totals() -> None:
    """Text lacking MemTotal/MemFree is an error, never zeros."""
    with pytest.raises(ValueError, match=r"lacks MemTotal, MemFree"):
        parse_meminfo("HugePages_Total:       0\n")


def test_parse_proc_self_cgroup_v1_host() -> None:
    """A v1 host's /proc/self/cgroup gives each controller's path and the empty v2 line."""
    membership = parse_proc_self_cgroup(sample("v1_host", "proc", "self", "cgroup"))
    assert membership.v2_path == "/"
    assert membership.v1_paths["memory"] == "/process_api/8ed35a241a95f8f49ffbd99ef12c7986"
    assert membership.v1_paths["cpu"] == "/"
    assert membership.v1_paths["name=systemd"] == "/"


def test_parse_proc_self_cgroup_joint_controllers_and_v2() -> None:
    """A joint 'cpu,cpuacct' line gives both controllers; a '0::' line the v2 path."""
    membership = parse_proc_self_cgroup(
        "12:cpu,cpuacct:/kubepods/pod1\n0::/system.slice/job.service\n"
    )
    assert membership.v1_paths == {"cpu": "/kubepods/pod1", "cpuacct": "/kubepods/pod1"}
    assert membership.v2_path == "/system.slice/job.service"


def test_parse_proc_self_cgroup_pure_v2_container() -> None:
    """A v2 container in its own cgroup namespace is at '/' with no v1 controllers."""
    membership = parse_proc_self_cgroup(sample("v2_container", "proc", "self", "cgroup"))
    assert membership.v2_path == "/"
    assert dict(membership.v1_paths) == {}


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("200000 100000\n", 2), ("250000 100000", 3), ("50000 100000", 1)],
)
def test_parse_cpu_max(text: str, cpus: int | None) -> None:
    """cpu.max: 'max' is no limit; a quota is rounded up to whole CPUs, at least 1."""
    assert parse_cpu_max(text) == cpus


def test_parse_cpu_max_rejects_garbage() -> None:
    """A malformed cpu.max raises instead of reading as no limit."""
    with pytest.raises(ValueError, match=r"cpu\.max"):
        parse_cpu_max("")


@pytest.mark.parametrize(
    ("quota", "period", "cpus"),
    [("-1", "100000", None), ("400000", "100000", 4), ("150000", "100000", 2)],
)
def test_parse_cfs_quota(quota: str, period: str, cpus: int | None) -> None:
    """cgroup v1 cfs quota/period: -1 is no limit, else ceil(quota/period)."""
    assert parse_cfs_quota(quota, period) == cpus


def test_parse_memory_max() -> None:
    """memory.max: 'max' is no limit, a number is the limit in bytes."""
    assert parse_memory_max("max\n") is None
    assert parse_memory_max(sample("v2_container", "sys", "fs", "cgroup", "memory.max")) == 16 * GIB


def test_parse_memory_limit_in_bytes_no_limit_values() -> None:
    """v1's 'no limit' 9223372036854771712 (and anything >= 2**62) is None; real limits stay."""
    text = sample("v1_host", "sys", "fs", "cgroup", "memory", "memory.limit_in_bytes")
    assert text.strip() == "9223372036854771712"
    assert parse_memory_limit_in_bytes(text) is None
    assert parse_memory_limit_in_bytes(str(2**62)) is None
    assert parse_memory_limit_in_bytes("9223372036854775807") is None
    assert parse_memory_limit_in_bytes("8589934592") == 8 * GIB


def test_parse_memory_stat_v1_and_v2() -> None:
    """memory.stat gives inactive_file (v2) and total_inactive_file (v1)."""
    v2 = parse_memory_stat(sample("v2_container", "sys", "fs", "cgroup", "memory.stat"))
    assert v2["inactive_file"] == 2 * GIB
    v1_path = ("v1_host", "sys", "fs", "cgroup", "memory", "process_api")
    v1 = parse_memory_stat(sample(*v1_path, "8ed35a241a95f8f49ffbd99ef12c7986", "memory.stat"))
    assert v1["total_inactive_file"] == 2293760
    assert v1["hierarchical_memory_limit"] == 9223372036854771712


# -- derivations ---------------------------------------------------------------


def test_available_ram_is_the_least_over_the_hierarchy() -> None:
    """A parent's tighter limit binds a child cgroup with a looser one."""
    meminfo = MemInfo(total_bytes=512 * GIB, free_bytes=400 * GIB, available_bytes=480 * GIB)
    levels = [
        CgroupMemory(version="v2", path="/a/b", limit_bytes=64 * GIB, usage_bytes=GIB),
        CgroupMemory(
            version="v2",
            path="/a",
            limit_bytes=32 * GIB,
            usage_bytes=12 * GIB,
            inactive_file_bytes=2 * GIB,
        ),
        CgroupMemory(version="v2", path="/", limit_bytes=None, usage_bytes=100 * GIB),
    ]
    ram, source = derive_available_ram(meminfo, levels)
    assert ram == 32 * GIB - 10 * GIB
    assert source.startswith("cgroup v2 memory.max at /a ")


def test_available_ram_memavailable_when_no_limit() -> None:
    """Without any limit, MemAvailable is the figure."""
    meminfo = MemInfo(total_bytes=8 * GIB, free_bytes=GIB, available_bytes=6 * GIB)
    assert derive_available_ram(meminfo, []) == (6 * GIB, "/proc/meminfo MemAvailable")


def test_available_ram_old_kernel_falls_back_to_memfree() -> None:
    """Without MemAvailable, MemFree is used and the source says why."""
    meminfo = parse_meminfo(sample("old_kernel", "proc", "meminfo"))
    ram, source = derive_available_ram(meminfo)
    assert ram == 5123456 * KIB
    assert "no MemAvailable" in source


def test_available_ram_unknown_is_none() -> None:
    """Nothing read: None with a reason, never 0."""
    ram, source = derive_available_ram(None, [])
    assert ram is None
    assert source.startswith("unknown")


def test_usable_cpus_least_of_affinity_and_quotas() -> None:
    """Usable CPUs are the least of affinity and every level's quota."""
    quotas = [
        CgroupCpu(version="v2", path="/a/b", quota_cpus=None),
        CgroupCpu(version="v2", path="/a", quota_cpus=3),
    ]
    assert derive_usable_cpus(16, quotas) == (3, "cgroup v2 cpu.max at /a")
    assert derive_usable_cpus(2, quotas) == (2, "sched_getaffinity")
    assert derive_usable_cpus(None, [], system_count=8) == (8, "os.cpu_count (affinity unknown)")
    assert derive_usable_cpus(None, [])[0] == 1


# -- read_host_census on fake roots -----------------------------------------------


def test_read_host_census_v2_container_with_limit() -> None:
    """A v2 container: RAM is memory.max - (current - inactive_file), CPUs the 2.5 quota -> 3."""
    host = read_host_census(DATA / "v2_container", affinity_count=64)
    assert host.available_ram_bytes == 16 * GIB - (6 * GIB - 2 * GIB)
    assert host.ram_source.startswith("cgroup v2 memory.max at /")
    assert host.cpus == 3
    assert host.cpu_source == "cgroup v2 cpu.max at /"


def test_read_host_census_v1_host_without_limit() -> None:
    """The v1 CI host: no memory limit and no quota, so MemAvailable and the affinity."""
    host = read_host_census(DATA / "v1_host", affinity_count=2)
    meminfo = parse_meminfo(sample("v1_host", "proc", "meminfo"))
    assert host.available_ram_bytes == meminfo.available_bytes
    assert host.ram_source == "/proc/meminfo MemAvailable"
    assert (host.cpus, host.cpu_source) == (2, "sched_getaffinity")


def test_read_host_census_bare_metal_slices_without_limits() -> None:
    """A bare-metal systemd session: every level 'max', so MemAvailable and the affinity."""
    host = read_host_census(DATA / "baremetal_v2", affinity_count=128)
    assert host.available_ram_bytes == 1987654320 * KIB
    assert host.cpus == 128


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_read_host_census_parent_slice_limit_binds(tmp_path: Path) -> None:
    """A limit on a parent slice binds though our own cgroup has none (walks up the hierarchy)."""
    root = tmp_path
    write(root / "proc/meminfo", sample("baremetal_v2", "proc", "meminfo"))
    write(root / "proc/self/cgroup", "0::/batch.slice/job-7.scope\n")
    cg = root / "sys/fs/cgroup"
    write(cg / "cgroup.controllers", "cpu memory\n")
    write(cg / "batch.slice/memory.max", f"{40 * GIB}\n")
    write(cg / "batch.slice/memory.current", f"{10 * GIB}\n")
    write(cg / "batch.slice/cpu.max", "800000 100000\n")
    write(cg / "batch.slice/job-7.scope/memory.max", "max\n")
    write(cg / "batch.slice/job-7.scope/memory.current", f"{GIB}\n")
    write(cg / "batch.slice/job-7.scope/cpu.max", "max 100000\n")
    host = read_host_census(root, affinity_count=96)
    assert host.available_ram_bytes == 30 * GIB
    assert host.ram_source.startswith("cgroup v2 memory.max at /batch.slice ")
    assert (host.cpus, host.cpu_source) == (8, "cgroup v2 cpu.max at /batch.slice")


def test_read_host_census_v1_container_limit_at_mount_root(tmp_path: Path) -> None:
    """A v1 container without a cgroup namespace: its path is absent, so the mount root is read."""
    root = tmp_path
    write(root / "proc/meminfo", sample("baremetal_v2", "proc", "meminfo"))
    write(root / "proc/self/cgroup", "5:memory:/docker/abc123\n3:cpu,cpuacct:/docker/abc123\n")
    write(root / "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{4 * GIB}\n")
    write(root / "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GIB}\n")
    write(root / "sys/fs/cgroup/memory/memory.stat", "total_inactive_file 536870912\n")
    write(root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "150000\n")
    write(root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    host = read_host_census(root, affinity_count=32)
    assert host.available_ram_bytes == 4 * GIB - (GIB - GIB // 2)
    assert host.ram_source.startswith("cgroup v1 memory.limit_in_bytes at / ")
    assert host.cpus == 2


def test_read_host_census_empty_root(tmp_path: Path) -> None:
    """Nothing readable: RAM unknown (None), CPUs from the affinity."""
    host = read_host_census(tmp_path, affinity_count=4)
    assert host.available_ram_bytes is None
    assert host.cpus == 4


def test_read_host_census_this_machine() -> None:
    """On this machine the CPUs never exceed the affinity, and the RAM is positive."""
    host = read_host_census()
    assert 1 <= host.cpus <= len(os.sched_getaffinity(0))
    assert host.available_ram_bytes is not None
    assert host.available_ram_bytes > 0
