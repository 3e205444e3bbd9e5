"""What a vLLM engine's linear layers run, read where they live: in its worker process.

vLLM picks a linear's kernel in the worker when it loads the weights (a quantization method, its scheme, a kernel
class chosen for the platform, and on a CPU a matmul dispatched per layer), so only the worker knows. This class
is a vLLM *worker extension* (``EngineArgs.worker_extension_cls``): vLLM mixes it into its worker class, and the
driver calls its method by name with ``collective_rpc``, no pickled code crossing the process boundary.
"""

from __future__ import annotations

from typing import Any

#: the engine argument that mixes :class:`LinearKernelProbe` into vLLM's workers
WORKER_EXTENSION = f"{__name__}.LinearKernelProbe"

#: ops a CPU linear's dispatched matmul calls (vLLM keeps it as a closure in ``layer.cpu_linear``), by kernel family
_CPU_MATMULS = {"onednn_mm": "oneDNN matmul", "weight_packed_linear_cpu": "sgl-kernel packed matmul (AMX)",
                "zentorch_linear_unary": "zentorch matmul", "linear": "torch.nn.functional.linear"}


class LinearKernelProbe:
    """Mixed into vLLM's worker: ``self.model_runner`` is the worker's."""

    def modeswitch_linear_kernels(self) -> dict[str, str]:
        """The :class:`~modeswitch.weights.precision.LinearKernels` card of the first decoder layer's QKV projection."""
        model, config = self.model_runner.model, self.model_runner.model_config
        layer = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn.qkv_proj"))
        return describe(layer, str(config.dtype).removeprefix("torch."))


def describe(layer, compute: str) -> dict[str, str]:
    """A vLLM linear layer's card: W8A8 int8 (compressed-tensors), weight-only quantized (GPTQ and the like: the
    method's ``quant_type``), or unquantized (the stored weight's dtype, and on a CPU the matmul it was dispatched
    to: oneDNN, or torch's own linear where oneDNN has no kernel for the dtype)."""
    method, scheme = layer.quant_method, getattr(layer, "scheme", None)
    kernel = getattr(method, "kernel", None) or getattr(scheme, "kernel", None)
    # vLLM names its GPTQ method after AutoGPTQ ("auto_gptq"); the checkpoint format is GPTQ's
    quant = layer.quant_config.get_name().removeprefix("auto_") if layer.quant_config is not None else None
    card: dict[str, Any] = {"compute": compute, "activations": compute}
    if type(scheme).__name__.endswith("W8A8Int8"):
        static = getattr(scheme, "is_static_input_scheme", False)
        card.update(weights="int8", weight_format=f"{quant} (w8a8, int8 per output channel)",
                    activations="int8 (static)" if static else "int8 (dynamic, per token)")
    elif (quant_type := getattr(method, "quant_type", None)) is not None:
        card.update(weights=f"int{quant_type.size_bits}", weight_format=f"{quant} {quant_type.size_bits}-bit")
    else:
        weight = getattr(layer, "weight", None)
        card.update(weights=str(weight.dtype).removeprefix("torch.") if weight is not None else "unknown",
                    weight_format=quant or "dense")
    if kernel is not None:
        applied = getattr(getattr(kernel, "linear_method", None), "__name__", "")
        card["kernel"] = type(kernel).__name__ + (f" ({applied.removeprefix('_apply_weights_')})" if applied else "")
    elif (cpu_linear := getattr(layer, "cpu_linear", None)) is not None:
        calls = cpu_linear.__code__.co_names
        card["kernel"] = next((family for op, family in _CPU_MATMULS.items() if op in calls), "unknown CPU matmul")
    else:
        card["kernel"] = type(method).__name__
    return card
