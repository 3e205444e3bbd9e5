"""Process memory: trimming the heap hands back what the allocator keeps after frees."""

from __future__ import annotations

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
