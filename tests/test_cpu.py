"""What CPU a figure or a cache entry belongs to: read from the system, on x86 and on Arm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cpu import cpu_info, huge_pages, thp_mode
from specserve.host_memory import cgroup_free_bytes

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2 fma

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2 fma
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics {extra}
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x{variant}
CPU part\t: 0x{part}
CPU revision\t: 1
"""


def test_x86_model_name_and_flags(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text(X86)
    model, flags = cpu_info(tmp_path / "cpuinfo")
    assert model == "AMD EPYC 7B13" and flags == {"fpu", "sse2", "avx2", "fma"}


def test_arm_cores_are_told_apart_by_their_part_ids_and_features(tmp_path: Path) -> None:
    """Arm kernels print no model name and call the flags Features: every aarch64 CPU read as one, with no flags,
    so a Neoverse N1's verify profile was a V1's (SVE, bf16)."""
    n1 = tmp_path / "n1"
    n1.write_text(ARM.format(extra="", variant="3", part="d0c"))
    v1 = tmp_path / "v1"
    v1.write_text(ARM.format(extra="sve bf16", variant="1", part="d40"))
    (n1_model, n1_flags), (v1_model, v1_flags) = cpu_info(n1), cpu_info(v1)
    assert n1_model != v1_model and "part 0xd0c" in n1_model and "implementer 0x41" in n1_model
    assert "asimd" in n1_flags and {"sve", "bf16"} <= v1_flags and "sve" not in n1_flags


def test_the_summary_names_the_flags_the_kernels_choose_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 kernels need AVX2 with FMA, AVX512-VNNI with BW and VL, AMX-INT8: a CPU with avx512f and no
    avx512bw (which runs the AVX2 kernel) read as 'avx2 avx512f', and an Arm CPU as 'no AVX2/AVX-512 flags'."""
    import specserve.bench.machine as machine

    x86 = "avx2 fma avx512f avx512_vnni amx_tile amx_int8 sse2"  # (no bw/vl: no VNNI or AMX kernel)
    monkeypatch.setattr(machine, "cpu_info", lambda: ("x", frozenset(x86.split())))
    assert ", avx2 fma avx512f avx512_vnni amx_tile amx_int8, " in machine.cpu_summary()
    monkeypatch.setattr(machine, "cpu_info", lambda: ("arm", frozenset(["fp", "asimd", "asimddp", "i8mm", "sve"])))
    assert ", asimd asimddp i8mm sve, " in machine.cpu_summary()
    monkeypatch.setattr(machine, "cpu_info", lambda: ("old", frozenset({"sse2"})))
    assert ", no vector extension flags seen, " in machine.cpu_summary()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to leave one")
def test_the_summary_counts_the_cores_this_process_may_use() -> None:
    """Under a cpuset or taskset the summary named the host's core count, and figures were labelled with it."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from specserve.bench.machine import cpu_summary; print(cpu_summary())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert f"1 of {os.cpu_count()} logical CPUs" in done.stdout  # (not "cores": with SMT two share one)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_free_bytes_reads_the_tightest_limit_up_the_hierarchy(tmp_path: Path) -> None:
    """A container's memory limit, on its own cgroup or an ancestor's, v2 or v1; none set (v2's "max", v1's
    2**63 - 1 rounded to a page) is no limit, and no cgroup file at all is unknown."""
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    _write(proc, "0::/pod/ctr\n")
    _write(v2 / "pod/ctr/memory.max", "max\n")
    _write(v2 / "pod/ctr/memory.current", "100\n")
    assert cgroup_free_bytes(v2, proc) is None
    _write(v2 / "pod/memory.max", "5000\n")  # the pod's limit binds its containers
    _write(v2 / "pod/memory.current", "1200\n")
    assert cgroup_free_bytes(v2, proc) == 3800
    _write(v2 / "pod/ctr/memory.max", "1000\n")
    assert cgroup_free_bytes(v2, proc) == 900  # the container's own is tighter
    _write(v2 / "pod/ctr/memory.current", "1500\n")
    assert cgroup_free_bytes(v2, proc) == 0  # over its limit: nothing left, never negative
    v1 = tmp_path / "v1"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(v1 / "memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n")
    _write(v1 / "memory/docker/abc/memory.usage_in_bytes", "10\n")
    assert cgroup_free_bytes(v1, proc) is None
    _write(v1 / "memory/docker/memory.limit_in_bytes", "2048\n")
    _write(v1 / "memory/docker/memory.usage_in_bytes", "48\n")
    assert cgroup_free_bytes(v1, proc) == 2000
    assert cgroup_free_bytes(v1, tmp_path / "absent") is None


def test_cgroup_usage_leaves_out_the_page_cache_the_kernel_reclaims(tmp_path: Path) -> None:
    """A checkpoint just read sits in the cgroup's page cache and counts in its usage: a KV cache that fits was
    refused. Usage less the inactive file pages (v2 ``inactive_file``, v1 ``total_inactive_file``), as Docker does."""
    proc, v2, v1 = tmp_path / "cgroup", tmp_path / "v2", tmp_path / "v1"
    _write(proc, "0::/ctr\n")
    _write(v2 / "ctr/memory.max", "1000\n")
    _write(v2 / "ctr/memory.current", "900\n")
    assert cgroup_free_bytes(v2, proc) == 100
    _write(v2 / "ctr/memory.stat", "anon 150\nfile 750\nactive_file 100\ninactive_file 650\n")
    assert cgroup_free_bytes(v2, proc) == 750
    _write(v2 / "ctr/memory.stat", "inactive_file 5000\n")  # more than usage (counters read apart): all free
    assert cgroup_free_bytes(v2, proc) == 1000
    _write(v2 / "ctr/memory.stat", "inactive_file lots\n")  # unreadable: usage as it stands
    assert cgroup_free_bytes(v2, proc) == 100
    _write(proc, "4:memory:/docker/abc\n")
    _write(v1 / "memory/docker/abc/memory.limit_in_bytes", "2048\n")
    _write(v1 / "memory/docker/abc/memory.usage_in_bytes", "2000\n")
    _write(v1 / "memory/docker/abc/memory.stat", "cache 1900\ninactive_file 7\ntotal_inactive_file 1500\n")
    assert cgroup_free_bytes(v1, proc) == 1548


HUGE_PAGES_GROWTH = (
    "import torch\n"
    "def huge():\n"
    "    rows = [r for r in open('/proc/self/smaps_rollup') if r.startswith('AnonHugePages')]\n"
    "    return int(rows[0].split()[1])\n"
    "before = huge(); x = torch.ones(48 << 20); print(huge() - before)\n"  # 192 MiB, every page touched
)


def _huge_kib(code: str, **env: str) -> tuple[str, int]:
    """(the label the code printed first, the KiB of huge pages its allocation got)"""
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return lines[0], int(lines[-1])


@pytest.mark.skipif(
    thp_mode() != "madvise" or not Path("/proc/self/smaps_rollup").exists(),
    reason="needs the kernel's THP in madvise mode (huge pages only where asked) and /proc/self/smaps_rollup",
)
def test_the_summarys_huge_pages_are_what_torchs_allocations_get() -> None:
    """The figures' label says huge pages on exactly where a large torch allocation gets them (THP_MEM_ALLOC_ENABLE
    set before torch's first allocation; importing specserve leaves it as the environment has it)."""
    label = "from specserve.cpu import huge_pages; print(huge_pages())\n"
    on = _huge_kib(label + HUGE_PAGES_GROWTH, THP_MEM_ALLOC_ENABLE="1")
    off = _huge_kib(label + HUGE_PAGES_GROWTH)
    assert on[0] == "huge pages on (THP madvise)" and on[1] >= 64 << 10  # most of the 192 MiB
    assert off[0] == "huge pages off (THP madvise)" and off[1] == 0


def test_huge_pages_reads_the_kernels_mode_and_the_request(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert thp_mode(setting) == "madvise"
    assert huge_pages({"THP_MEM_ALLOC_ENABLE": "1"}, setting) == "huge pages on (THP madvise)"
    assert huge_pages({"THP_MEM_ALLOC_ENABLE": "0"}, setting) == "huge pages off (THP madvise)"
    for ignored in ("true", " 1", "2"):  # torch warns and asks for none (they read as on)
        assert huge_pages({"THP_MEM_ALLOC_ENABLE": ignored}, setting) == "huge pages off (THP madvise)", ignored
    assert huge_pages({}, setting) == "huge pages off (THP madvise)"
    setting.write_text("[always] madvise never\n")
    assert huge_pages({}, setting) == "huge pages on (THP always)"
    setting.write_text("always madvise [never]\n")
    assert huge_pages({"THP_MEM_ALLOC_ENABLE": "1"}, setting) == "huge pages off (THP never)"
    assert thp_mode(tmp_path / "absent") is None
    assert huge_pages({}, tmp_path / "absent") == "huge pages off (THP unknown)"
