"""perf/cpu_slices.py, the fleet benchmark's per-replica CPU quota: it finds a server's whole process
group, and a slice really holds its processes to their quota (where this host lets a process make
cgroups: as root with a cpu controller; elsewhere that test is skipped, saying why)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from perf.cpu_slices import CpuSlices, CpuSlicesUnavailable
from prefillonly.serving.host.process import process_group, stat_fields

BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"
# a leader that starts a busy child in its own process group, then is busy itself
LEADER = ("import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', {busy!r}])\n"
          "exec({busy!r})\nchild.wait()\n")


def start_group(seconds: float) -> subprocess.Popen:
    busy = BUSY.format(s=seconds)
    return subprocess.Popen([sys.executable, "-c", LEADER.format(busy=busy)], start_new_session=True)


def stop_group(leader: subprocess.Popen) -> None:
    try:
        os.killpg(leader.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    leader.wait()


def cpu_seconds(pid: int) -> float:
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_for_members(pgid: int, n: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(members := process_group(pgid)) < n:
        assert time.monotonic() < deadline, f"process group {pgid} has {members}, expected {n} processes"
        time.sleep(0.02)
    return members


def test_process_group_is_the_leader_and_its_children_only():
    leader = start_group(2.0)
    try:
        members = wait_for_members(leader.pid, 2)
        assert leader.pid in members and len(members) == 2
        assert os.getpid() not in members  # this process is in another group
    finally:
        stop_group(leader)


def test_a_slice_holds_its_process_group_to_the_quota():
    try:
        slices = CpuSlices(cores=0.2)
        probe = start_group(0.1)
        try:
            slices.add("probe", probe.pid)
        finally:
            stop_group(probe)
    except CpuSlicesUnavailable as e:
        pytest.skip(f"no writable cgroup cpu controller here: {e}")
    with slices:
        leader = start_group(3.0)  # two busy processes: 2 cores' worth of demand, unthrottled
        try:
            members = wait_for_members(leader.pid, 2)
            assert sorted(slices.add("replica", leader.pid)) == members
            before = sum(cpu_seconds(p) for p in members)
            time.sleep(1.5)
            used = sum(cpu_seconds(p) for p in members) - before
        finally:
            stop_group(leader)
        # 0.2 cores for 1.5 s is 0.3 s of CPU; one quota period (0.1 s x 0.2) and the tick's
        # resolution of slack. Unthrottled, two busy processes would use up to 3 s (1.5 on one core).
        assert used <= 0.3 + 0.15, f"the slice's processes used {used:.2f} s of CPU in 1.5 s at 0.2 cores"
        assert slices.throttled_s()["replica"] > 0
