"""What CPU a figure or a cache entry belongs to: read from the system, on x86 and on Arm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cpu import cpu_info

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to leave one")
def test_the_summary_counts_the_cores_this_process_may_use() -> None:
    """Under a cpuset or taskset the summary named the host's core count, and figures were labelled with it."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from specserve.bench.machine import cpu_summary; print(cpu_summary())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert f"1 of {os.cpu_count()} cores" in done.stdout
