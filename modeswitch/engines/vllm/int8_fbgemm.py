"""W8A8 int8 linears on FBGEMM where oneDNN has no int8 kernel of its own for the CPU.

vLLM multiplies a W8A8 int8 linear on a CPU with oneDNN's matmul. oneDNN's int8 kernels that keep a packed copy of
the weights need an int8 dot-product instruction (AVX512-VNNI, AVX-VNNI) or AVX-512; on an AVX2-only CPU it runs
its older ``gemm:jit`` instead, which packs the whole weight matrix again on every call. A decode step then costs
as much as repacking every weight of the model (the demo: about 140 ms a step at any batch, 3.5x float32's 40 ms
at one request), while the same kernel is faster than float32 on long prompts. FBGEMM (PyTorch's x86 quantized
backend) packs the weights once, for AVX2 too (``benchmarks/int8_kernels.py`` times both at the demo's shapes).

The arithmetic is the checkpoint's, as vLLM computes it: int8 weights per output channel as stored, each token's
activations scaled by its own absolute maximum onto 127 levels either side of zero. FBGEMM's dynamic linear would
quantize a whole input with one scale and zero point chosen from the input's minimum and maximum, so a token's
rounding would depend on the tokens beside it (a drafting engine's verify step would round a token otherwise than
the plain engine's decode step, and a near-tie can flip). So each token's row is divided by its absolute maximum
(a linear map commutes with that scaling: its output row is multiplied by it again) and FBGEMM is given the scale
1/127 and the zero point 128: a token's 8 bits are vLLM's symmetric per-token ones plus 128, whatever the batch,
and the outputs are those of vLLM's own kernel on the same CPU to float rounding. (An affine map of each token onto
its own range would use the 8 bits more finely, but moves most activations of a skewed row towards 0 or 255, where
the 16-bit pair sums below saturate.)

Without VNNI both libraries multiply unsigned 8-bit activations by int8 weights into 16-bit sums of pairs, which
saturate where neighbouring weights are both large, alike: the quality gate scores the two the same on the demo
(perplexity +8.8 %, copy -1 pp). FBGEMM's 7-bit activations (``reduce_range``) cannot saturate, but cost the demo
4 pp on the gate's copy task, so it runs 8 bits. Only for checkpoints with dynamic, symmetric per-token activations
(the W8A8 preset); any other goes to oneDNN as vLLM sends it.

The linear is a torch custom op taking the layer's index into this process's packed weights (a plain int), so
that vLLM's compiled graphs call it as one opaque op (dynamo cannot trace FBGEMM's packed-weights object). It is
registered with the dispatcher directly, as vLLM registers its own (``direct_register_custom_op``), not through
``torch.library.custom_op``, whose checks on every call (the output aliases no input; dynamo disabled around it)
cost about 8 us a call on the AVX2 EPYC: with four linears a layer, 3 % of the demo's decode step.

torch 2.13 marks its quantized tensors deprecated (the packing takes one, for the moment it packs); where a torch
has no FBGEMM engine, the int8 linears stay on oneDNN.
"""

from __future__ import annotations

import warnings

import torch
from vllm.utils.torch_utils import direct_register_custom_op

from . import compat

#: this process's packed weights and their output widths, by the index the custom op is called with
_PACKED: list = []
_WIDTH: list[int] = []
#: the activations' quantization once each token is divided by its absolute maximum: vLLM's 127 levels either side of
#: zero, in the unsigned bytes FBGEMM multiplies
_SCALE, _ZERO_POINT = 1 / 127, 128


def onednn_lacks_int8_kernel() -> bool:
    """Whether oneDNN would run int8 matmuls here with ``gemm:jit`` (an x86 CPU without AVX-512 or an int8 dot
    product, or one held to AVX2 by ``MODESWITCH_CPU``) and FBGEMM is in this torch build."""
    from ...device import cpu_has_avx512, cpu_flags

    return ("fbgemm" in torch.backends.quantized.supported_engines and not cpu_has_avx512()
            and "avx_vnni" not in cpu_flags())


def _fbgemm_int8_linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """``x`` (float32, 2-D, each row scaled to an absolute maximum of 1) times packed weights ``index``."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, _SCALE, _ZERO_POINT, _PACKED[index])


def _shape(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _WIDTH[index]))


_LIBRARY = torch.library.Library("modeswitch", "FRAGMENT")
direct_register_custom_op("fbgemm_int8_linear", _fbgemm_int8_linear, fake_impl=_shape, target_lib=_LIBRARY,
                          dispatch_key="CPU")
fbgemm_int8_linear = torch.ops.modeswitch.fbgemm_int8_linear.default


def pack(weight: torch.Tensor, scales: torch.Tensor) -> int:
    """Pack int8 ``weight`` ([N, K], per output channel ``scales``) for FBGEMM; the index to call it by."""
    n = weight.shape[0]
    with warnings.catch_warnings():  # quantized tensors are deprecated: see the module's docstring
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(weight.contiguous(), scales.reshape(n).double(),
                                                             torch.zeros(n, dtype=torch.long), 0)
    _PACKED.append(torch.ops.quantized.linear_prepack(quantized, None))
    _WIDTH.append(n)
    return len(_PACKED) - 1


def linear(x: torch.Tensor, index: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear of ``x`` (any leading shape) by packed weights ``index``, activations quantized per token."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float()
    peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    # a row that is not finite (vLLM's dummy runs pass unset memory) stays so, and only that row
    out = fbgemm_int8_linear(rows / peak, index) * peak
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


def use_fbgemm_for_int8() -> None:
    """In an engine process on a CPU where oneDNN lacks an int8 kernel: vLLM's CPU W8A8 int8 linears that quantize
    activations per token, dynamically and symmetrically, packed for FBGEMM instead of handed to oneDNN. Idempotent."""
    process = compat.original("cpu_int8_onednn_weights")
    if getattr(process, "fbgemm", False) or not onednn_lacks_int8_kernel():
        return

    def process_weights_for_onednn(self, layer: torch.nn.Module) -> None:
        config = self.config
        if not (config.input_symmetric and not config.is_static_input_scheme):
            return process(self, layer)
        w_q_name, w_s_name, _, _, _ = self.layer_param_names
        weight, scales = getattr(layer, w_q_name), getattr(layer, w_s_name)
        if len(layer.logical_widths) > 1 and not config.is_channelwise:  # a fused layer's per-tensor scales
            from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

            scales = convert_to_channelwise(scales, layer.logical_widths)
        index = pack(weight.data, scales.data)
        setattr(layer, w_q_name, None)  # FBGEMM's packed copy is the one kept

        def _apply_weights_fbgemm(layer: torch.nn.Module, x: torch.Tensor,
                                  bias: torch.Tensor | None = None) -> torch.Tensor:
            return linear(x, index, bias)

        self.linear_method = _apply_weights_fbgemm

    process_weights_for_onednn.fbgemm = True  # type: ignore[attr-defined]
    compat.replace("cpu_int8_onednn_weights", process_weights_for_onednn)
