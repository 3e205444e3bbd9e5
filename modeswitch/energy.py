"""GPU energy from NVML's cumulative counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules).

Reading the counter around a piece of work gives its energy exactly, without sampling power. On machines
without NVML (CPUs, laptops) :func:`open_meter` returns None and callers report energy as unmeasured.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class NvmlEnergyMeter:
    def __init__(self, index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.name = pynvml.nvmlDeviceGetName(self._handle)
        self.joules()  # fails here, not later, on GPUs without the counter

    def joules(self) -> float:
        """Energy the GPU has used since the driver loaded, in joules."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0

    def memory_used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)


def open_meter(index: int = 0) -> NvmlEnergyMeter | None:
    """An NVML meter for GPU ``index``, or None where NVML or its energy counter is missing."""
    try:
        return NvmlEnergyMeter(index)
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NotSupported, ...
        log.info("no NVML energy counter: %s", exc)
        return None
