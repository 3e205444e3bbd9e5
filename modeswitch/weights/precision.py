"""What a mode's linear layers really run, read from the loaded model rather than from the mode's name.

Every backend describes the linears of the weights it loaded as a :class:`LinearKernels` card (the transformers
backend from the modules in this process, vLLM engines from inside their worker process, see
:mod:`modeswitch.engines.vllm.probe`). ``/v1/modes`` shows the card per mode, the quality gate records the card
each report row was scored on, and :func:`mismatch` keeps a mode whose kernels are not what its weights' name
says from being served under that name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..weight_kinds import KINDS



@dataclass(frozen=True)
class LinearKernels:
    """The linears of one weights variant as they run: stored weights, their format, the activations they
    multiply, the dtype everything else computes in, and the kernel doing the matmul."""

    #: the stored weight type: "bfloat16", "float16", "float32", "int8", "int4"
    weights: str
    #: how they are stored: "dense", "compressed-tensors (w8a8)", "gptq 4-bit, group 64", "bitsandbytes LLM.int8", ...
    weight_format: str
    #: what the matmul multiplies them with: the compute dtype, or "int8 (dynamic, per token)" for W8A8
    activations: str
    #: the dtype of everything around the linears (norms, attention, residuals)
    compute: str
    #: the kernel family that runs the matmul
    kernel: str

    def card(self) -> dict[str, str]:
        return asdict(self)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def mismatch(variant: str, card: dict[str, str] | None) -> str | None:
    """Why a mode on ``variant`` must not be served under its name (its linears run other weights than the name
    says: ``WeightKind.promises``), or None. A backend that could not describe its linears (``card`` None) is taken
    at its word."""
    kind = KINDS.get(variant)
    promised = kind.promises if kind is not None else None
    if promised is None or card is None or card["weights"] == promised:
        return None
    return (f"its linears run {card['weights']} weights ({card['weight_format']}, {card['kernel']}) on this machine, "
            f"not the {promised} its name says")


def describe_torch_linear(module, compute) -> LinearKernels:
    """The card of a linear layer in this process: plain ``nn.Linear``, bitsandbytes' LLM.int8, GPTQModel's
    quantized linears, or the compiled loop's int8 weight-only and int4 layers (:mod:`modeswitch.weights.kernels`)."""
    from .kernels import Int4Linear, Int8WeightOnlyLinear

    compute = dtype_name(compute)
    kind = type(module).__name__
    if isinstance(module, Int8WeightOnlyLinear):
        return LinearKernels("int8", "int8 weight-only, per output channel", compute, compute,
                             "int8 weight-only matmul (dequantized in the matmul, fused by Inductor when compiled)")
    if isinstance(module, Int4Linear):  # it hands the kernel bf16 activations, whatever the compute dtype
        return LinearKernels("int4", f"gptq 4-bit, group {module.group_size}, repacked for tinygemm", "bfloat16",
                             compute, "aten._weight_int4pack_mm (tinygemm)")
    if kind == "Linear8bitLt":
        return LinearKernels("int8", "bitsandbytes LLM.int8", f"int8 per row, outlier columns in {compute}", compute,
                             "bitsandbytes int8 matmul")
    if hasattr(module, "qweight") and hasattr(module, "bits"):  # GPTQModel's quantized linears
        group = getattr(module, "group_size", None)
        return LinearKernels(f"int{module.bits}", f"gptq {module.bits}-bit" + (f", group {group}" if group else ""),
                             compute, compute, f"{kind} (GPTQModel)")
    return LinearKernels(dtype_name(module.weight.dtype), "dense", compute, compute, "torch.nn.functional.linear")


def first_linear(model):
    """The first decoder layer's query projection: every linear of a variant is quantized alike, so one stands
    for all (``lm_head`` stays in the reference precision in every variant)."""
    for name, module in model.named_modules():
        if name.endswith("layers.0.self_attn.q_proj"):
            return module
    raise LookupError("no layers.0.self_attn.q_proj in this model")
