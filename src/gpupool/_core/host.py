"""Host CPUs and RAM from the kernel's own text: ``/proc`` and cgroup files (pure core).

Every function here takes the text of one file (or values already parsed)
and returns a value; :mod:`gpupool._sensors.host` does the reading. Tests
feed saved samples from ``tests/data/``.

Why not ``psutil.virtual_memory()`` and ``os.cpu_count()``: inside a
container both report the *host* (psutil #2100), not the cgroup's memory
limit or CPU quota, and a pool sized from them starts more children than the
container holds. So the usable figures are the least of the host's and every
limit up this process's cgroup hierarchy::

    available RAM = min(MemAvailable, min over levels(limit - (usage - inactive_file)))
    usable CPUs   = min(affinity, min over levels(ceil(quota / period)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from gpupool._core.census import HostCensus
from gpupool._core.units import KiB, format_size

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "CPU_QUOTA_PERIOD_DEFAULT_US",
    "V1_NO_LIMIT_THRESHOLD_BYTES",
    "CgroupCpu",
    "CgroupMembership",
    "CgroupMemory",
    "MemInfo",
    "cap_usable_cpus",
    "derive_available_ram",
    "derive_usable_cpus",
    "parse_cfs_quota",
    "parse_cgroup_int",
    "parse_cpu_max",
    "parse_memory_limit_in_bytes",
    "parse_memory_max",
    "parse_memory_stat",
    "parse_meminfo",
    "parse_proc_self_cgroup",
]

CgroupVersion = Literal["v1", "v2"]

#: cgroup v1 has no "max": an unlimited ``memory.limit_in_bytes`` reads
#: ``PAGE_COUNTER_MAX`` rounded to the page size, 9223372036854771712 with
#: 4 KiB pages (seen on the project's CI host), other values with other page
#: sizes. No machine has 4 EiB of RAM, so anything at or above 2**62 is "no limit".
V1_NO_LIMIT_THRESHOLD_BYTES = 2**62

#: The kernel's default ``cpu.max`` period, for a ``cpu.max`` that gives a quota alone.
CPU_QUOTA_PERIOD_DEFAULT_US = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class MemInfo:
    """The three ``/proc/meminfo`` figures gpupool uses, in bytes.

    Attributes:
        total_bytes: ``MemTotal``.
        free_bytes: ``MemFree`` (page cache counts as used).
        available_bytes: ``MemAvailable`` (free plus what the kernel can
            reclaim), or ``None`` on kernels older than 3.14 that lack it.
    """

    total_bytes: int
    free_bytes: int
    available_bytes: int | None


def parse_meminfo(text: str) -> MemInfo:
    """Parse ``/proc/meminfo``.

    Args:
        text: the file's contents (``"MemTotal:  24684096 kB"`` lines).

    Returns:
        ``MemTotal``, ``MemFree`` and ``MemAvailable`` in bytes.

    Raises:
        ValueError: ``MemTotal`` or ``MemFree`` is missing or malformed.
    """
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        scale = KiB if len(parts) > 1 and parts[1].lower() == "kb" else 1
        fields[key.strip()] = int(parts[0]) * scale
    missing = [name for name in ("MemTotal", "MemFree") if name not in fields]
    if missing:
        raise ValueError(f"/proc/meminfo text lacks {', '.join(missing)}")
    return MemInfo(
        total_bytes=fields["MemTotal"],
        free_bytes=fields["MemFree"],
        available_bytes=fields.get("MemAvailable"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupMembership:
    """Which cgroups this process is in, from ``/proc/self/cgroup``.

    Attributes:
        v2_path: the path of the ``0::<path>`` line (the unified hierarchy),
            or ``None`` when there is none.
        v1_paths: controller name -> path, for each v1 hierarchy
            (``"memory"`` -> ``"/process_api/8ed3..."``). A line naming
            several controllers (``cpu,cpuacct``) gives each of them.
    """

    v2_path: str | None = None
    v1_paths: Mapping[str, str] = field(default_factory=dict)


def parse_proc_self_cgroup(text: str) -> CgroupMembership:
    """Parse ``/proc/self/cgroup`` (v1 ``id:controllers:path`` and v2 ``0::path`` lines).

    Args:
        text: the file's contents.

    Returns:
        The v2 path and every v1 controller's path. Named v1 hierarchies
        (``name=systemd``) are kept under their full name.
    """
    v2_path: str | None = None
    v1_paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
            continue
        for controller in controllers.split(","):
            if controller:
                v1_paths[controller] = path
    return CgroupMembership(v2_path=v2_path, v1_paths=v1_paths)


def parse_cgroup_int(text: str) -> int:
    """Parse a cgroup file holding one integer (``memory.current``, ``memory.usage_in_bytes``).

    Raises:
        ValueError: the text is not one integer.
    """
    return int(text.strip())


def parse_cpu_max(text: str) -> int | None:
    """Parse a cgroup v2 ``cpu.max`` (``"$MAX $PERIOD"``) into whole CPUs.

    ``"max 100000"`` is no limit; ``"150000 100000"`` is 1.5 CPUs, rounded
    up to 2: a pool may run one child per started CPU, and the quota shares
    the rest.

    Returns:
        The quota in CPUs (at least 1), or ``None`` for no limit.

    Raises:
        ValueError: the text is malformed.
    """
    parts = text.split()
    if not parts or len(parts) > 2:
        raise ValueError(f"cpu.max text {text!r} is not '$MAX $PERIOD'")
    if parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) == 2 else CPU_QUOTA_PERIOD_DEFAULT_US
    return _quota_cpus(int(parts[0]), period)


def parse_cfs_quota(quota_text: str, period_text: str) -> int | None:
    """Parse cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` into whole CPUs.

    A quota of ``-1`` (any negative) is no limit.

    Returns:
        ``ceil(quota / period)`` (at least 1), or ``None`` for no limit.

    Raises:
        ValueError: either text is not an integer.
    """
    quota = int(quota_text.strip())
    if quota < 0:
        return None
    return _quota_cpus(quota, int(period_text.strip()))


def _quota_cpus(quota_us: int, period_us: int) -> int | None:
    if quota_us < 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))


def parse_memory_max(text: str) -> int | None:
    """Parse a cgroup v2 ``memory.max`` (``"max"`` is no limit).

    Returns:
        The limit in bytes, or ``None`` for no limit.

    Raises:
        ValueError: the text is neither ``max`` nor an integer.
    """
    value = text.strip()
    if value == "max":
        return None
    return int(value)


def parse_memory_limit_in_bytes(text: str) -> int | None:
    """Parse a cgroup v1 ``memory.limit_in_bytes``.

    v1 writes "no limit" as a huge number (9223372036854771712 with 4 KiB
    pages); anything at or above :data:`V1_NO_LIMIT_THRESHOLD_BYTES` is no limit.

    Returns:
        The limit in bytes, or ``None`` for no limit.

    Raises:
        ValueError: the text is not an integer.
    """
    value = int(text.strip())
    if value < 0 or value >= V1_NO_LIMIT_THRESHOLD_BYTES:
        return None
    return value


def parse_memory_stat(text: str) -> dict[str, int]:
    """Parse a cgroup ``memory.stat`` (``"inactive_file 65536"`` lines) into a dict.

    Lines that are not ``name integer`` are skipped.
    """
    stats: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            stats[parts[0]] = int(parts[1])
    return stats


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupMemory:
    """One level of this process's cgroup hierarchy, memory side.

    Attributes:
        version: ``"v1"`` or ``"v2"``.
        path: the cgroup's path (``"/"`` at the root), for the source string.
        limit_bytes: ``memory.max`` / ``memory.limit_in_bytes``; ``None`` for no limit.
        usage_bytes: ``memory.current`` / ``memory.usage_in_bytes`` (page
            cache included), or ``None`` when unread.
        inactive_file_bytes: reclaimable page cache (``inactive_file`` in v2,
            ``total_inactive_file`` in v1), or ``None`` when unread.
    """

    version: CgroupVersion
    path: str
    limit_bytes: int | None
    usage_bytes: int | None = None
    inactive_file_bytes: int | None = None

    @property
    def headroom_bytes(self) -> int | None:
        """``limit - (usage - inactive_file)``, at least 0; ``None`` without a limit.

        A limit with an unknown usage leaves the whole limit as headroom:
        the least this level can say.
        """
        if self.limit_bytes is None:
            return None
        usage = self.usage_bytes or 0
        if self.inactive_file_bytes is not None:
            usage = max(0, usage - self.inactive_file_bytes)
        return max(0, self.limit_bytes - usage)


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupCpu:
    """One level of this process's cgroup hierarchy, CPU side.

    Attributes:
        version: ``"v1"`` or ``"v2"``.
        path: the cgroup's path, for the source string.
        quota_cpus: ``ceil(quota / period)``, or ``None`` for no quota.
    """

    version: CgroupVersion
    path: str
    quota_cpus: int | None


def derive_available_ram(
    meminfo: MemInfo | None, cgroups: Sequence[CgroupMemory] = ()
) -> tuple[int | None, str]:
    """The RAM this process's children may still use, and where the figure came from.

    The least of the host's ``MemAvailable`` (``MemFree`` on kernels without
    it) and every cgroup level's ``limit - (usage - inactive_file)``: a
    parent cgroup's limit binds its children even when theirs is larger.

    Args:
        meminfo: the parsed ``/proc/meminfo``, or ``None`` when unread.
        cgroups: every level of the hierarchy that was read, any order.

    Returns:
        ``(bytes, source)``; ``(None, reason)`` when nothing could be read.
    """
    candidates: list[tuple[int, str]] = []
    if meminfo is not None:
        if meminfo.available_bytes is not None:
            candidates.append((meminfo.available_bytes, "/proc/meminfo MemAvailable"))
        else:
            candidates.append(
                (meminfo.free_bytes, "/proc/meminfo MemFree (this kernel has no MemAvailable)")
            )
    for level in cgroups:
        headroom = level.headroom_bytes
        if headroom is None:
            continue
        limit_file = "memory.max" if level.version == "v2" else "memory.limit_in_bytes"
        candidates.append(
            (
                headroom,
                f"cgroup {level.version} {limit_file} at {level.path} "
                f"({format_size(level.limit_bytes)} limit - "
                f"{format_size(level.usage_bytes)} used"
                + (
                    f" + {format_size(level.inactive_file_bytes)} inactive file)"
                    if level.inactive_file_bytes is not None
                    else ")"
                ),
            )
        )
    if not candidates:
        return None, "unknown: neither /proc/meminfo nor a cgroup memory limit could be read"
    return min(candidates, key=lambda candidate: candidate[0])


def derive_usable_cpus(
    affinity_count: int | None,
    quotas: Sequence[CgroupCpu] = (),
    *,
    system_count: int | None = None,
) -> tuple[int, str]:
    """The CPUs this process's children may use, and where the figure came from.

    The least of the CPU affinity (``sched_getaffinity``) and every cgroup
    level's quota, rounded up. ``os.cpu_count()`` is the system's count and
    ignores both, so it is only the fallback when affinity is unknown.

    Args:
        affinity_count: how many CPUs this process may be scheduled on, or ``None``.
        quotas: every level of the hierarchy that was read, any order.
        system_count: the system's CPU count, used only without an affinity.

    Returns:
        ``(cpus, source)``, ``cpus`` at least 1.
    """
    candidates: list[tuple[int, str]] = []
    if affinity_count is not None and affinity_count > 0:
        candidates.append((affinity_count, "sched_getaffinity"))
    elif system_count is not None and system_count > 0:
        candidates.append((system_count, "os.cpu_count (affinity unknown)"))
    for level in quotas:
        if level.quota_cpus is None:
            continue
        quota_file = "cpu.max" if level.version == "v2" else "cpu.cfs_quota_us/cpu.cfs_period_us"
        candidates.append(
            (level.quota_cpus, f"cgroup {level.version} {quota_file} at {level.path}")
        )
    if not candidates:
        return 1, "unknown: no affinity, CPU count or quota could be read; assuming 1"
    cpus, source = min(candidates, key=lambda candidate: candidate[0])
    return max(1, cpus), source


def cap_usable_cpus(host: HostCensus, cap: int | None, *, source: str) -> HostCensus:
    """``host`` with its CPUs capped at ``cap``, as loky caps its count by ``LOKY_MAX_CPU_COUNT``.

    A cap at or above the counted CPUs changes nothing; a lower one becomes the
    count, and ``source`` (the variable and its value) its source.
    """
    if cap is None or cap >= host.cpus:
        return host
    return replace(
        host, cpus=max(1, cap), cpu_source=f"{source} (below {host.cpus} from {host.cpu_source})"
    )
