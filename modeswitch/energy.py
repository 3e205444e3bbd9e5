"""Energy per request: a meter (measured or estimated), a roofline cost model, and step attribution.

* :class:`NvmlEnergyMeter` reads NVML's cumulative counter (``nvmlDeviceGetTotalEnergyConsumption``):
  the energy between two readings, exactly, without sampling power.
* :class:`EstimatingMeter` stands in where there is no NVML (CPUs, laptops): a configured power figure
  integrated over wall-clock time. Everything it produces is labelled ``estimated``, never ``measured``.
* :class:`StepCost` is a roofline model of one forward step of a model: for each request in the step,
  FLOPs (its new tokens through the weights, plus attention over its KV) and bytes (its share of the
  weights, which a step reads once for the whole batch, plus its KV), turned into seconds as
  ``max(flops / peak_flops, bytes / bandwidth)``.
* :class:`EnergyAccountant` brackets every engine step with meter readings. Between two consecutive
  readings (any engine's step starting or ending) the energy is split over every open step's requests in
  proportion to their roofline seconds, so the shares add up to the meter's delta; energy while no step
  is open is counted as idle. Engines of different modes run concurrently, so attribution is per reading
  interval rather than per step.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

log = logging.getLogger(__name__)

MEASURED = "measured"
ESTIMATED = "estimated"
#: Power assumed by the estimating meter when none is configured (``--power-watts``), in watts.
DEFAULT_POWER_W = {"cpu": 65.0, "cuda": 350.0}


class Meter(Protocol):
    source: str  # MEASURED or ESTIMATED

    def joules(self) -> float:
        """A monotonically increasing energy reading in joules."""


class NvmlEnergyMeter:
    source = MEASURED

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


class EstimatingMeter:
    """``power_w`` integrated over time: an estimate for machines without an energy counter."""

    source = ESTIMATED

    def __init__(self, power_w: float, clock: Callable[[], float] = time.monotonic) -> None:
        if power_w <= 0:
            raise ValueError(f"power must be positive, got {power_w} W")
        self.power_w = power_w
        self.name = f"estimate at {power_w:g} W"
        self._clock = clock

    def joules(self) -> float:
        return self.power_w * self._clock()


def open_meter(index: int = 0) -> NvmlEnergyMeter | None:
    """An NVML meter for GPU ``index``, or None where NVML or its energy counter is missing."""
    try:
        return NvmlEnergyMeter(index)
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NotSupported, ...
        log.info("no NVML energy counter: %s", exc)
        return None


def meter_for(device_type: str, power_w: float | None = None) -> Meter:
    """NVML on a GPU that has the counter; otherwise an estimate at ``power_w`` (or the device's default)."""
    if device_type == "cuda" and (meter := open_meter()) is not None:
        return meter
    return EstimatingMeter(power_w or DEFAULT_POWER_W.get(device_type, DEFAULT_POWER_W["cpu"]))


# ---------------------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class Hardware:
    """Peak compute and memory bandwidth; only their ratio (the ridge point) changes how steps are split."""

    peak_flops: float
    bandwidth: float  # bytes per second


#: Rough figures: a few-core AVX2/AVX-512 CPU with dual-channel memory, and an H100/H200-class GPU (bf16 dense).
HARDWARE = {"cpu": Hardware(peak_flops=5e11, bandwidth=4e10), "cuda": Hardware(peak_flops=9.9e14, bandwidth=4.8e12)}


@dataclass(frozen=True)
class StepCost:
    """Roofline cost of one request's part of a forward step on one model."""

    matmul_params: int       # weights every token is multiplied through (decoder linears + lm_head)
    attn_width: int          # layers x heads x head_dim: per (query, key) pair, 4 x this FLOPs
    weight_bytes: int        # resident bytes of the weights a step reads
    kv_bytes_per_token: int
    hardware: Hardware

    def seconds(self, new_tokens: int, kv_tokens: int, batch_size: int = 1) -> float:
        """Roofline time of ``new_tokens`` processed with ``kv_tokens`` in the cache afterwards, in a step
        that serves ``batch_size`` requests (the weights are read once per step and shared)."""
        past = max(kv_tokens - new_tokens, 0)
        pairs = new_tokens * (past + (new_tokens + 1) / 2)  # causal attention inside the new tokens
        flops = 2 * self.matmul_params * new_tokens + 4 * self.attn_width * pairs
        moved = self.weight_bytes / max(batch_size, 1) + self.kv_bytes_per_token * kv_tokens
        return max(flops / self.hardware.peak_flops, moved / self.hardware.bandwidth)


# ---------------------------------------------------------------------------------------------- attribution
class EnergySink(Protocol):
    energy_j: float


@dataclass(frozen=True)
class Share:
    sink: EnergySink
    weight: float  # roofline seconds


class EnergyAccountant:
    """Splits the meter's energy over the requests of the steps open at the time (see the module doc)."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.source = meter.source
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Share, ...]] = {}
        self._next = 0
        self._last = meter.joules()
        self.attributed_j = 0.0
        self.idle_j = 0.0

    def _advance(self) -> None:
        now = self.meter.joules()
        delta, self._last = now - self._last, now
        shares = [s for step in self._open.values() for s in step]
        total = sum(s.weight for s in shares)
        if not shares or total <= 0:
            self.idle_j += delta
            return
        for s in shares:
            s.sink.energy_j += delta * s.weight / total
        self.attributed_j += delta

    def begin(self, shares: Iterable[Share]) -> int:
        with self._lock:
            self._advance()
            self._next += 1
            self._open[self._next] = tuple(shares)
            return self._next

    def end(self, token: int) -> None:
        with self._lock:
            self._advance()
            self._open.pop(token, None)

    def begin_work(self, cost: StepCost, work: Iterable[tuple[EnergySink, int, int]]) -> int:
        """A step starts; ``work`` is (request, new tokens, KV tokens after the step) for each request in it,
        weighted by ``cost`` with the batch size the step really has."""
        work = list(work)
        return self.begin([Share(sink, cost.seconds(new, kv, len(work))) for sink, new, kv in work])

    @contextmanager
    def step(self, shares: Iterable[Share]) -> Iterator[None]:
        token = self.begin(shares)
        try:
            yield
        finally:
            self.end(token)

    def totals(self) -> dict[str, float]:
        """Energy attributed to requests and idle energy so far (brought up to date first)."""
        with self._lock:
            self._advance()
            return {"attributed_j": self.attributed_j, "idle_j": self.idle_j}
