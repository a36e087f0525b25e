"""What this machine can give a parameter server's tables: the default of ``ServerConfig.max_total_bytes``.

A CREATE takes zeroed arrays, which cost nothing until written, so a bound above the machine's memory admits
tables that the first pushes then cannot back: the kernel kills the server (or its colocated workers) long
after the CREATE was accepted. The default is therefore half of the memory available when the server's
config is made, shared by the servers started together on the machine; the other half stays with the workers
that are colocated with it (Parallax §4.3) and with the server's own buffers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
TABLE_FRACTION = 0.5  # of the available memory, for every table of the servers on this machine together
FALLBACK_BYTES = 32 * 2**30  # where neither /proc/meminfo nor os.sysconf says (the old fixed default)

# (limit file, usage file, memory.stat key of reclaimable page cache) for cgroup v2, then v1
_CGROUP_FILES = (
    ("memory.max", "memory.current", "inactive_file"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)


def available_memory(*, meminfo: Path = MEMINFO, cgroups: Sequence[Path] | None = None) -> int:
    """Bytes this machine can give now without swapping: ``MemAvailable`` of ``meminfo`` (else the free physical
    pages from ``os.sysconf``), or less where a memory cgroup (a container) leaves less: its limit minus what
    its processes use, page cache that can be reclaimed not counted as used. ``cgroups``: the directories of
    this process's memory cgroup and its ancestors, by default found from ``/proc/self/cgroup``."""
    machine = _meminfo_available(meminfo)
    if machine is None:
        machine = _sysconf_available()
    rooms = [r for d in (_own_cgroups() if cgroups is None else cgroups) if (r := _cgroup_room(d)) is not None]
    return min([machine, *rooms])


def default_max_total_bytes(servers: int = 1) -> int:
    """``TABLE_FRACTION`` of ``available_memory()``, shared by ``servers`` servers on this machine."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    return int(available_memory() * TABLE_FRACTION) // servers


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "MemAvailable":  # kB, whatever the line says: the kernel always writes kB
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_available() -> int:
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):  # free pages where known, else all of them
        try:
            return int(os.sysconf(pages)) * int(os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            continue
    return FALLBACK_BYTES


def _own_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup")) -> list[Path]:
    """This process's memory cgroup directories (v2 and v1 mounts) and their ancestors up to the mount: a limit
    set on a parent holds for us too."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2: "0::/path"
            mount = CGROUP_ROOT
        elif "memory" in controllers.split(","):  # v1: "4:memory:/path"
            mount = CGROUP_ROOT / "memory"
        else:
            continue
        d = mount / rel.lstrip("/")
        while True:
            out.append(d)
            if d == mount:
                break
            d = d.parent
    return out


def _cgroup_room(d: Path) -> int | None:
    """What the cgroup in ``d`` still admits, or None where it sets no limit (or is not there)."""
    for limit_name, usage_name, cache_key in _CGROUP_FILES:
        try:
            raw = (d / limit_name).read_text().strip()
        except OSError:
            continue
        try:
            if raw == "max":
                return None
            limit, used = int(raw), int((d / usage_name).read_text())
        except (OSError, ValueError):
            return None
        return max(0, limit - max(0, used - _stat(d / "memory.stat").get(cache_key, 0)))
    return None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out
