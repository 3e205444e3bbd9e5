"""Process memory: trimming the heap hands back what the allocator keeps after frees; the AVX2 imitation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import ctypes, psutil
from modeswitch.device import trim_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(4096) for _ in range(50_000)]  # 200 MB of small chunks: the heap, not mmap
for b in blocks:
    ctypes.memset(b, 1, 4096)
pin = libc.malloc(4096)  # above them: the heap's top stays in use, so free() alone gives nothing back
for b in blocks:
    libc.free(b)
before = psutil.Process().memory_info().rss
assert trim_heap()
print(before - psutil.Process().memory_info().rss)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_gives_freed_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 150 * 2**20  # of the 200 MB freed


def test_the_avx2_imitation_takes_away_bf16_and_the_avx512_only_vllm_kernel(monkeypatch):
    """``MODESWITCH_CPU=avx2`` makes the project's own choices those of an AVX2 CPU on any CPU: no native 16-bit
    type (the reference runs fp32) and no vLLM GPTQ matmul; a misspelt class is refused, not ignored."""
    import torch

    from modeswitch.device import cpu_has_avx512, cpu_has_bf16, native_16bit, resolve_device_dtype
    from modeswitch.engines.vllm.args import has_cpu_kernel

    monkeypatch.setenv("MODESWITCH_CPU", "avx2")
    assert not cpu_has_bf16() and not cpu_has_avx512() and native_16bit(torch.device("cpu")) is None
    assert resolve_device_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
    has_cpu_kernel.cache_clear()
    try:
        assert not has_cpu_kernel("cpu_gemm_wna16")  # answered without loading vLLM's kernels
    finally:
        has_cpu_kernel.cache_clear()
    monkeypatch.setenv("MODESWITCH_CPU", "avx-2")
    with pytest.raises(ValueError, match="MODESWITCH_CPU='avx-2'"):
        cpu_has_bf16()
    monkeypatch.delenv("MODESWITCH_CPU")
    assert cpu_has_bf16() == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


CAPPED = r"""
from modeswitch.device import cap_kernels, machine
cap_kernels()
import torch
a = torch.randn(64, 64)
a @ a  # the first dispatch reads the cap
print(torch.backends.cpu.get_cpu_capability(), machine())
"""


def test_the_avx2_imitation_holds_run_time_kernel_dispatch_to_avx2(monkeypatch):
    """Under ``MODESWITCH_CPU=avx2`` a process that caps its kernels (the server does first thing, and its engines
    inherit the environment) dispatches PyTorch's vectorized kernels at AVX2 on any CPU, and names its machine by
    the AVX2 flag alone, so the costs it measures are kept apart from the real CPU's; a cap the user set wins."""
    from modeswitch.device import kernel_caps, machine

    monkeypatch.delenv("MODESWITCH_CPU", raising=False)
    assert kernel_caps() == {}
    monkeypatch.setenv("MODESWITCH_CPU", "avx2")
    assert kernel_caps()["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    named = machine()
    assert named.partition("[")[2].partition("]")[0] in ("avx2", "")  # no AVX-512 or AMX flag named
    env = {k: v for k, v in os.environ.items() if k not in kernel_caps()}
    out = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "AVX2" and out.stdout.strip().endswith(named)
    env["ATEN_CPU_CAPABILITY"] = "default"  # the user's own cap is kept
    out = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "DEFAULT"


def test_the_memory_reading_is_the_kernels_available_ram():
    """The request path's lean reading of /proc/meminfo says what psutil's full parse says (memory moves between
    the two readings: within 1 % of the total); a file without MemAvailable is not read as zero free."""
    import psutil

    from modeswitch.device import memory_headroom, meminfo_kb

    free, fraction = memory_headroom()
    vm = psutil.virtual_memory()
    assert abs(fraction - vm.available / vm.total) < 0.01 and abs(free - vm.available) < 0.01 * vm.total
    head = b"MemTotal:       24683784 kB\nMemFree:        21105256 kB\nMemAvailable:   24080268 kB\nBuffers:"
    assert meminfo_kb(head) == (24683784, 24080268)
    assert meminfo_kb(b"MemTotal:       24683784 kB\nMemFree:        21105256 kB\nBuffers:   1 kB\n") is None
    assert meminfo_kb(b"MemTotal:       0 kB\nMemAvailable:   0 kB\n") is None
