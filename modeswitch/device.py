"""Where the models live: the device and dtype a user's ``auto`` resolves to, and how much memory is free there.

Shared by the backends (placing weights), the registry (the default memory budget) and the request path
(the memory features), so none of them reaches into another for it. torch is imported on first use.
"""

from __future__ import annotations

import psutil


def resolve_device_dtype(device: str, dtype: str):
    """``auto`` picks CUDA when present; the reference ("fp16") weights run in bf16 on a GPU that supports
    it (fp16 otherwise) and in fp32 on a CPU, where half precision decodes slower (the demo model: bf16
    65 ms/token, fp32 41 ms/token on an AVX-512 CPU). Returns ``(torch.device, torch.dtype)``."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        if dev.type == "cuda":
            return dev, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return dev, torch.float32
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


def memory_headroom() -> tuple[int, float]:
    """Free bytes and free fraction of the memory the models live in (GPU if one is in use, else RAM)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        return free, free / total
    vm = psutil.virtual_memory()
    return vm.available, vm.available / vm.total
