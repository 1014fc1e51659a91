"""core.format.resources: the memory and CPUs this process may really use, read from fake /proc and
/sys trees (cgroup v1, v2, hybrid, nested limits, namespaces) and from real rlimits in a subprocess."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bestiary.core.format import resources
from bestiary.core.format.resources import (
    GiB,
    Limit,
    available_memory,
    bytes_asked,
    cgroup_dirs,
    memory_capacity,
    out_of_memory_message,
    usable_cpus,
)

MEMINFO = "MemTotal:       {total} kB\nMemFree:         1000 kB\nMemAvailable:   {avail} kB\n"
STATUS = "Name:\tpython\nVmPeak:\t 9999999 kB\nVmSize:\t {size} kB\nVmData:\t {data} kB\n"
V1_MOUNTS = ("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
             "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n")
V2_MOUNT = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
NO_LIMITS = {resource.RLIMIT_AS: (-1, -1), resource.RLIMIT_DATA: (-1, -1)}


def no_rlimits(which: int) -> tuple[int, int]:
    return NO_LIMITS[which]


def fake_root(tmp_path: Path, files: dict[str, str], total_gib: int = 64, avail_gib: int = 48) -> Path:
    """A folder holding proc/meminfo, proc/self/status and `files` (path under the root -> text)."""
    files = {"proc/meminfo": MEMINFO.format(total=total_gib * 2**20, avail=avail_gib * 2**20),
             "proc/self/status": STATUS.format(size=2 * 2**20, data=2**20), **files}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_no_cgroup_no_rlimit_is_meminfo(tmp_path):
    root = fake_root(tmp_path, {})
    assert available_memory(root, no_rlimits) == Limit(48 * GiB, "MemAvailable")
    assert memory_capacity(root, no_rlimits) == Limit(64 * GiB, "this host's RAM")
    assert cgroup_dirs(root, "memory") == [] and cgroup_dirs(root, None) == []


def test_cgroup_v2_limit_minus_use_counts_dropable_cache_as_free(tmp_path):
    group = "sys/fs/cgroup/user.slice/job"
    root = fake_root(tmp_path, {
        "proc/self/cgroup": "0::/user.slice/job\n",
        "proc/self/mountinfo": V2_MOUNT,
        f"{group}/memory.max": f"{8 * GiB}\n",
        f"{group}/memory.current": f"{3 * GiB}\n",
        f"{group}/memory.stat": f"anon {2 * GiB}\nfile {GiB}\ninactive_file {GiB}\n",
        "sys/fs/cgroup/user.slice/memory.max": "max\n",
    })
    assert cgroup_dirs(root, None) == [root / group, root / "sys/fs/cgroup/user.slice", root / "sys/fs/cgroup"]
    avail = available_memory(root, no_rlimits)
    assert avail.amount == 6 * GiB  # 8 - (3 - 1 GiB of inactive page cache)
    assert avail.source.startswith("cgroup memory.max of /sys/fs/cgroup/user.slice/job, 2.0 GiB of it in use")
    assert memory_capacity(root, no_rlimits) == Limit(8 * GiB, "cgroup memory.max of /sys/fs/cgroup/user.slice/job")


def test_a_parent_cgroup_with_less_room_wins(tmp_path):
    root = fake_root(tmp_path, {
        "proc/self/cgroup": "0::/a/b\n",
        "proc/self/mountinfo": V2_MOUNT,
        "sys/fs/cgroup/a/b/memory.max": f"{16 * GiB}\n",
        "sys/fs/cgroup/a/b/memory.current": f"{GiB}\n",
        "sys/fs/cgroup/a/memory.max": f"{4 * GiB}\n",
        "sys/fs/cgroup/a/memory.current": f"{3 * GiB}\n",  # siblings of b use most of a's limit
    })
    assert available_memory(root, no_rlimits).amount == GiB
    assert "/sys/fs/cgroup/a," in available_memory(root, no_rlimits).source
    assert memory_capacity(root, no_rlimits).amount == 4 * GiB


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    group = "sys/fs/cgroup/memory/docker/abc"
    files = {
        "proc/self/cgroup": "12:pids:/docker/abc\n4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n",
        "proc/self/mountinfo": V1_MOUNTS,
        f"{group}/memory.limit_in_bytes": f"{2 * GiB}\n",
        f"{group}/memory.usage_in_bytes": f"{GiB}\n",
        f"{group}/memory.stat": f"cache 100\ntotal_inactive_file {GiB // 2}\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
    }
    root = fake_root(tmp_path, files)
    assert available_memory(root, no_rlimits).amount == 2 * GiB - GiB // 2
    assert memory_capacity(root, no_rlimits) == Limit(2 * GiB, "cgroup memory.limit_in_bytes of /" + group)
    files[f"{group}/memory.limit_in_bytes"] = "9223372036854771712\n"
    root = fake_root(tmp_path, files)
    assert available_memory(root, no_rlimits).source == "MemAvailable"


def test_a_namespaced_cgroup_is_the_mount_itself(tmp_path):
    """In a container with its own cgroup namespace the mount's root is the process's cgroup."""
    root = fake_root(tmp_path, {
        "proc/self/cgroup": "4:memory:/docker/abc\n",
        "proc/self/mountinfo": "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GiB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": "0\n",
    })
    assert cgroup_dirs(root, "memory") == [root / "sys/fs/cgroup/memory"]
    assert available_memory(root, no_rlimits).amount == GiB


def test_rlimits_as_and_data_minus_what_the_process_uses(tmp_path):
    root = fake_root(tmp_path, {})  # VmSize 2 GiB, VmData 1 GiB
    limits = {resource.RLIMIT_AS: (5 * GiB, -1), resource.RLIMIT_DATA: (-1, -1)}
    assert available_memory(root, limits.__getitem__) == Limit(3 * GiB, "RLIMIT_AS (ulimit -v), 2.0 GiB of it in use")
    assert memory_capacity(root, limits.__getitem__) == Limit(5 * GiB, "RLIMIT_AS (ulimit -v)")
    limits[resource.RLIMIT_DATA] = (int(1.5 * GiB), -1)
    assert available_memory(root, limits.__getitem__).amount == GiB // 2
    assert available_memory(root, limits.__getitem__).source.startswith("RLIMIT_DATA (ulimit -d)")


def test_cpus_from_affinity_and_cgroup_quotas(tmp_path):
    assert usable_cpus(fake_root(tmp_path, {}), lambda: {0, 1, 2, 3}) == Limit(4, "CPU affinity")
    v2 = fake_root(tmp_path / "v2", {"proc/self/cgroup": "0::/job\n", "proc/self/mountinfo": V2_MOUNT,
                                     "sys/fs/cgroup/job/cpu.max": "150000 100000\n",
                                     "sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert usable_cpus(v2, lambda: set(range(16))) == Limit(2, "cgroup CPU quota of /sys/fs/cgroup/job")
    assert usable_cpus(v2, lambda: {0}) == Limit(1, "CPU affinity")
    v1 = fake_root(tmp_path / "v1", {"proc/self/cgroup": "2:cpu,cpuacct:/\n", "proc/self/mountinfo": V1_MOUNTS,
                                     "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
                                     "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert usable_cpus(v1, lambda: set(range(8))).amount == 3
    (v1 / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert usable_cpus(v1, lambda: set(range(8))).amount == 8


def test_unreadable_or_garbage_files_are_no_limit(tmp_path):
    root = fake_root(tmp_path, {"proc/self/cgroup": "garbage\n0::/x\n", "proc/self/mountinfo": "nonsense\n" + V2_MOUNT,
                                "sys/fs/cgroup/x/memory.max": "lots\n", "sys/fs/cgroup/x/cpu.max": "1 0\n"})
    assert available_memory(root, no_rlimits).source == "MemAvailable"
    assert usable_cpus(root, lambda: {0, 1}).amount == 2


def test_this_machine_reads_without_error():
    assert 0 < available_memory().amount <= memory_capacity().amount * 2
    assert usable_cpus().amount >= 1


def test_an_rlimit_set_in_a_process_is_honoured():
    """resource.setrlimit(RLIMIT_AS) in a subprocess: both limits drop to it (less what the process maps)."""
    code = textwrap.dedent(f"""
        import json, resource
        resource.setrlimit(resource.RLIMIT_AS, ({3 * GiB}, resource.RLIM_INFINITY))
        from bestiary.core.format.resources import available_memory, memory_capacity
        a, c = available_memory(), memory_capacity()
        print(json.dumps([a.amount, a.source, c.amount, c.source]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    avail, avail_source, cap, cap_source = json.loads(out.stdout)
    assert cap == 3 * GiB and cap_source == "RLIMIT_AS (ulimit -v)"
    assert 0 < avail < 3 * GiB and avail_source.startswith("RLIMIT_AS (ulimit -v), ")


def test_out_of_memory_messages_name_the_size_and_the_limit(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: Limit(2 * GiB, "cgroup memory.max of /x"))
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 256000000000 bytes. Error code 12 (Cannot allocate memory)")
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB")
    assert bytes_asked(cpu) == 256_000_000_000 and bytes_asked(cuda) == 20 * GiB
    assert bytes_asked(MemoryError()) is None
    line = out_of_memory_message(cpu)
    assert line.startswith("out of memory: allocating 256,000,000,000 bytes (238.4 GiB) failed; 2.0 GiB "
                           "(cgroup memory.max of /x) is available to this process")
    assert "\n" not in line and "--max_batch_size" in line
    assert out_of_memory_message(MemoryError()).startswith("out of memory: an allocation failed; 2.0 GiB")


@pytest.mark.parametrize("err,failed", [(MemoryError(), True), (RuntimeError("can't allocate memory"), True),
                                        (RuntimeError("CUDA out of memory."), True), (RuntimeError("a bug"), False),
                                        (ValueError("out of memory"), False)])
def test_allocation_failed_tells_allocators_from_bugs(err, failed):
    assert resources.allocation_failed(err) is failed
