"""Read the host's usable CPUs and available RAM from ``/proc`` and the cgroup files (I/O edge).

Thin readers over :mod:`gpupool._core.host`: each file is read here and
parsed there. ``root`` lets tests point every path at a fake tree built in
``tmp_path``::

    root/proc/meminfo
    root/proc/self/cgroup
    root/sys/fs/cgroup/<v2 path>/{memory.max, memory.current, memory.stat, cpu.max}
    root/sys/fs/cgroup/memory/<v1 path>/{memory.limit_in_bytes, memory.usage_in_bytes, memory.stat}
    root/sys/fs/cgroup/cpu/<v1 path>/{cpu.cfs_quota_us, cpu.cfs_period_us}

psutil is not used: inside a container it reports the host's memory, not
the container's limit (psutil #2100).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from gpupool._core.census import HostCensus
from gpupool._core.host import (
    CgroupCpu,
    CgroupMembership,
    CgroupMemory,
    CgroupVersion,
    MemInfo,
    cap_usable_cpus,
    derive_available_ram,
    derive_usable_cpus,
    parse_cfs_quota,
    parse_cgroup_int,
    parse_cpu_max,
    parse_meminfo,
    parse_memory_limit_in_bytes,
    parse_memory_max,
    parse_memory_stat,
    parse_proc_self_cgroup,
)
from gpupool._errors import ConfigurationError
from gpupool._sensors.ancestry import is_descendant, read_ancestors, read_parent_pid

__all__ = [
    "CPU_CAP_ENV",
    "cap_host_cpus",
    "is_descendant",
    "read_affinity_count",
    "read_ancestors",
    "read_cpu_cap",
    "read_host_census",
    "read_meminfo",
    "read_parent_pid",
]

#: Where a v1 controller may be mounted under ``/sys/fs/cgroup``: its own
#: name, or a joint mount (``cpu,cpuacct``) that distributions name either way.
_V1_MOUNTS = {
    "memory": ("memory",),
    "cpu": ("cpu", "cpu,cpuacct", "cpuacct,cpu"),
}


def read_meminfo(path: Path = Path("/proc/meminfo")) -> MemInfo:
    """Read and parse ``/proc/meminfo``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it lacks ``MemTotal`` or ``MemFree``.
    """
    return parse_meminfo(path.read_text())


def read_affinity_count() -> int | None:
    """How many CPUs this process may run on (``os.sched_getaffinity(0)``), or ``None``."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    try:
        return len(getaffinity(0))
    except OSError:
        return None


#: loky's (and so joblib's) cap on the CPUs it counts; gpupool caps its CPU count with it.
CPU_CAP_ENV = "LOKY_MAX_CPU_COUNT"


def read_cpu_cap(environ: Mapping[str, str]) -> int | None:
    """``LOKY_MAX_CPU_COUNT`` as loky reads it (a cap on the CPUs counted), or ``None`` unset.

    Raises:
        ConfigurationError: the value is not a whole number of at least 1 (loky
            reads ``0`` as 1 and fails on text with a bare ``ValueError``).
    """
    value = environ.get(CPU_CAP_ENV)
    if value is None:
        return None
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ConfigurationError(
            f"{CPU_CAP_ENV}={value!r}: set it to a whole number of at least 1, such as 4; "
            f"or unset {CPU_CAP_ENV} for the default."
        )
    return cap


def cap_host_cpus(host: HostCensus, environ: Mapping[str, str]) -> HostCensus:
    """``host`` with its CPUs capped by ``LOKY_MAX_CPU_COUNT`` from ``environ``, where set.

    The one place the host's CPU ceiling is finished: the pool's census and
    ``gpupool census``/``plan`` both take it through
    :func:`gpupool._sensors.census.read_census`.
    """
    cap = read_cpu_cap(environ)
    if cap is None:
        return host
    return cap_usable_cpus(host, cap, source=f"{CPU_CAP_ENV}={cap}")


def read_host_census(root: Path = Path("/"), *, affinity_count: int | None = None) -> HostCensus:
    """The host's usable CPUs and available RAM, honouring cgroup limits (v1, v2, hybrid).

    Walks up this process's cgroup from its own level to the mount root,
    reading each level's limit, so a limit on a parent (a systemd slice, a
    Kubernetes pod) binds too. When the path from ``/proc/self/cgroup`` does
    not exist under the mount (a container without a cgroup namespace sees
    its own cgroup at the root), the mount root alone is read.

    Args:
        root: the filesystem root to read under (a fake tree in tests).
        affinity_count: the CPU affinity to use; ``None`` reads
            ``os.sched_getaffinity(0)`` of this process.

    Returns:
        The host census; ``available_ram_bytes`` is ``None`` only when
        neither ``/proc/meminfo`` nor any cgroup limit could be read.
    """
    meminfo: MemInfo | None
    try:
        meminfo = read_meminfo(root / "proc" / "meminfo")
    except (OSError, ValueError):
        meminfo = None
    membership = _read_membership(root)
    cgroup_root = root / "sys" / "fs" / "cgroup"
    memory_levels: list[CgroupMemory] = []
    cpu_levels: list[CgroupCpu] = []
    v2_mount = _v2_mount(cgroup_root)
    if v2_mount is not None and membership.v2_path is not None:
        for directory, path in _levels(v2_mount, membership.v2_path):
            memory = _read_memory("v2", directory, path)
            if memory is not None:
                memory_levels.append(memory)
            cpu = _read_v2_cpu(directory, path)
            if cpu is not None:
                cpu_levels.append(cpu)
    for directory, path in _v1_levels(cgroup_root, membership, "memory"):
        v1_memory = _read_memory("v1", directory, path)
        if v1_memory is not None:
            memory_levels.append(v1_memory)
    for directory, path in _v1_levels(cgroup_root, membership, "cpu"):
        v1_cpu = _read_v1_cpu(directory, path)
        if v1_cpu is not None:
            cpu_levels.append(v1_cpu)
    if affinity_count is None:
        affinity_count = read_affinity_count()
    cpus, cpu_source = derive_usable_cpus(affinity_count, cpu_levels, system_count=os.cpu_count())
    ram_bytes, ram_source = derive_available_ram(meminfo, memory_levels)
    return HostCensus(
        cpus=cpus, available_ram_bytes=ram_bytes, cpu_source=cpu_source, ram_source=ram_source
    )


def _read_membership(root: Path) -> CgroupMembership:
    try:
        return parse_proc_self_cgroup((root / "proc" / "self" / "cgroup").read_text())
    except OSError:
        return CgroupMembership()


def _v2_mount(cgroup_root: Path) -> Path | None:
    """The unified hierarchy's mount: ``/sys/fs/cgroup`` (v2), or ``.../unified`` (hybrid)."""
    for candidate in (cgroup_root, cgroup_root / "unified"):
        if (candidate / "cgroup.controllers").is_file():
            return candidate
    return None


def _v1_levels(
    cgroup_root: Path, membership: CgroupMembership, controller: str
) -> list[tuple[Path, str]]:
    """The v1 ``controller`` hierarchy's levels for this process (none without it)."""
    v1_path = membership.v1_paths.get(controller)
    if v1_path is None:
        return []
    for mount_name in _V1_MOUNTS[controller]:
        mount = cgroup_root / mount_name
        if mount.is_dir():
            return _levels(mount, v1_path)
    return []


def _levels(mount: Path, cgroup_path: str) -> list[tuple[Path, str]]:
    """This cgroup's directory and each ancestor's up to the mount, leaf first.

    A path that does not exist under the mount (no cgroup namespace in a
    container, so the container's cgroup is the mount root) gives the root alone.
    """
    parts = [part for part in PurePosixPath(cgroup_path).parts if part not in ("/", "", "..")]
    leaf = mount.joinpath(*parts)
    if not leaf.is_dir():
        return [(mount, "/")]
    levels: list[tuple[Path, str]] = []
    for depth in range(len(parts), -1, -1):
        levels.append((mount.joinpath(*parts[:depth]), "/" + "/".join(parts[:depth])))
    return levels


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


#: Per cgroup version: the limit file and its parser, the usage file, and the
#: ``memory.stat`` key of the page cache that the kernel can reclaim.
_MEMORY_FILES: dict[CgroupVersion, tuple[str, Callable[[str], int | None], str, str]] = {
    "v2": ("memory.max", parse_memory_max, "memory.current", "inactive_file"),
    "v1": (
        "memory.limit_in_bytes",
        parse_memory_limit_in_bytes,
        "memory.usage_in_bytes",
        "total_inactive_file",
    ),
}


def _read_memory(version: CgroupVersion, directory: Path, path: str) -> CgroupMemory | None:
    limit_file, parse_limit, usage_file, inactive_key = _MEMORY_FILES[version]
    text = _read_text(directory / limit_file)
    if text is None:
        return None
    try:
        limit = parse_limit(text)
    except ValueError:
        return None
    usage = _read_int(directory / usage_file)
    stat_text = _read_text(directory / "memory.stat")
    inactive = parse_memory_stat(stat_text).get(inactive_key) if stat_text else None
    return CgroupMemory(
        version=version,
        path=path,
        limit_bytes=limit,
        usage_bytes=usage,
        inactive_file_bytes=inactive,
    )


def _read_v2_cpu(directory: Path, path: str) -> CgroupCpu | None:
    text = _read_text(directory / "cpu.max")
    if text is None:
        return None
    try:
        return CgroupCpu(version="v2", path=path, quota_cpus=parse_cpu_max(text))
    except ValueError:
        return None


def _read_v1_cpu(directory: Path, path: str) -> CgroupCpu | None:
    quota = _read_text(directory / "cpu.cfs_quota_us")
    period = _read_text(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        return CgroupCpu(version="v1", path=path, quota_cpus=parse_cfs_quota(quota, period))
    except ValueError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return parse_cgroup_int(text)
    except ValueError:
        return None
