"""CPU slices for benchmark replicas: each replica's processes in a cgroup of their own with a fixed
CPU quota, so replicas that share one host behave as separate machines of that many cores.

Why: three one-thread replicas on a 2-core host share the cores, so a replica's speed depends on
what the others do, and a router's choice of "the idle replica" buys nothing while two others
compute (issue 37's first real runs). With a quota each replica gets at most its slice whether or
not the others are busy, as on separate machines; what is left over runs Envoy, the picker and the
load generator.

    with CpuSlices(cores=0.6) as slices:
        slices.add("replica-0", server.pid)   # the server's whole process group (Python stubs too)

cgroup v1 (`cpu.cfs_quota_us` under /sys/fs/cgroup/cpu) and v2 (`cpu.max` where the root's
subtree_control has cpu) are both handled; without a writable cpu controller `CpuSlices()` raises
CpuSlicesUnavailable saying so (run as root, or leave the option off).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefillonly.serving.host.process import process_group

PERIOD_US = 100_000
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class CpuSlicesUnavailable(RuntimeError):
    pass


def _controller_root() -> tuple[Path, str]:
    if (V1_ROOT / "cpu.cfs_quota_us").exists():
        return V1_ROOT, "v1"
    control = V2_ROOT / "cgroup.subtree_control"
    if control.exists() and "cpu" in control.read_text().split():
        return V2_ROOT, "v2"
    raise CpuSlicesUnavailable("no cgroup cpu controller found (neither /sys/fs/cgroup/cpu nor cpu in "
                               "/sys/fs/cgroup/cgroup.subtree_control)")


class CpuSlices:
    def __init__(self, cores: float):
        if not cores > 0:
            raise ValueError(f"a CPU slice needs cores > 0, not {cores}")
        self.cores = cores
        self.root, self.version = _controller_root()
        self.groups: dict[str, Path] = {}

    def add(self, name: str, pgid: int) -> list[int]:
        """A slice named `name` (created with the quota) holding process group `pgid`; returns the
        pids moved."""
        group = self.groups.get(name)
        if group is None:
            group = self.root / f"prefillonly-bench-{os.getpid()}-{name}"
            try:
                group.mkdir(exist_ok=True)
                quota = round(self.cores * PERIOD_US)
                if self.version == "v1":
                    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                    (group / "cpu.cfs_quota_us").write_text(str(quota))
                else:
                    (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            except OSError as e:
                raise CpuSlicesUnavailable(f"cannot make the CPU slice {group}: {e} (run as root, or leave the option off)") from e
            self.groups[name] = group
        moved = process_group(pgid)
        for pid in moved:
            try:
                (group / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass  # exited meanwhile
        return moved

    def throttled_s(self) -> dict[str, float]:
        """Seconds each slice was held back by its quota so far (cpu.stat)."""
        out = {}
        for name, group in self.groups.items():
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines() if line.strip())
            out[name] = int(stat.get("throttled_time", 0)) / 1e9 if "throttled_time" in stat else int(stat.get("throttled_usec", 0)) / 1e6
        return out

    def close(self) -> None:
        """Processes go back to the parent group, the slices are removed."""
        for group in self.groups.values():
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    try:
                        (group.parent / "cgroup.procs").write_text(pid)
                    except ProcessLookupError:
                        pass
                group.rmdir()
            except OSError:
                pass  # already gone
        self.groups.clear()

    def __enter__(self) -> "CpuSlices":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
