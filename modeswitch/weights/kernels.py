"""Quantized linear layers that compile: the INT8 and GPTQ weights of the owned decode loop.

* :class:`Int8WeightOnlyLinear` is gpt-fast's int8 weight-only recipe: int8 weights with one scale per output
  row, ``linear(x, w.to(x.dtype)) * scale``. Eagerly that is a dequantize then a matmul; under ``torch.compile``
  Inductor fuses the conversion into the matmul's weight read, so a batch-1 decode step, bound by reading the
  weights, reads half the bytes of fp16 (as gpt-fast and torchao report). Plain PyTorch: nothing to install on
  the GPU machine, unlike torchao's tensor subclasses (a wheel to carry) or bitsandbytes' LLM.int8 (a package
  too, and its outlier decomposition runs eagerly, many times slower than fp16).
* :class:`Int4Linear` holds 4-bit weights in PyTorch's own int4 "tinygemm" layout and multiplies with
  ``aten._weight_int4pack_mm`` (``_for_cpu`` on a CPU), the kernel torchao's int4 weight-only also uses.
  :func:`repack_gptq` builds it from a GPTQModel layer's packed codes, scales and zero points, so the quantized
  values are GPTQ's (GPTQModel stays the quantizer and the checkpoint format, and its quality verdict holds);
  :func:`rtn_qparams` makes round-to-nearest codes for benchmarks without a GPTQ checkpoint.

tinygemm dequantizes ``w = (q - 8) * scale + zero``; GPTQ's ``w = (q - z) * scale`` is the same with
``zero = (8 - z) * scale``.
"""

from __future__ import annotations

import torch
from torch import nn

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8WeightOnlyLinear":
        """Symmetric per-output-row int8 of ``linear``'s weight (scales in the weight's dtype)."""
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale.to(linear.weight.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias


def _inner_k_tiles(k: int) -> int:
    """tinygemm's packing needs K divisible by 16 x inner_k_tiles: the largest of 8, 4, 2 that divides (the
    demo's 576 takes 4)."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"int4 tinygemm needs an input width divisible by 32, got {k}")


class Int4Linear(nn.Module):
    """``y = x @ dequant(q).T (+ bias)`` through PyTorch's int4 tinygemm kernel. Activations go in as bf16 (the
    only dtype the CUDA kernel takes) and come back in the caller's dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        """``codes``: [out, in] integers 0..15; ``scales``/``zeros``: [groups, out], GPTQ's (integer zero points)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide the input width {self.in_features}")
        self.group_size = group_size
        device = codes.device
        codes = codes.to(torch.int32)
        tiles = _inner_k_tiles(self.in_features)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), tiles)
        else:  # the CUDA packer takes two codes per byte
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
        scales = scales.to(torch.float32)
        offsets = (8 - zeros.to(torch.float32)) * scales
        packed_sz = torch.stack([scales, offsets], dim=2).to(torch.bfloat16).contiguous()  # [groups, out, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", packed_sz)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._mm = (torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu"
                    else torch.ops.aten._weight_int4pack_mm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.out_features,)
        out = self._mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.packed, self.group_size,
                       self.scales_and_zeros)
        out = out.reshape(shape).to(x.dtype)
        return out if self.bias is None else out + self.bias


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words holding ``32 // bits`` codes each, packed along dim 0 (lowest bits first) -> one code per row."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0] * per_word, packed.shape[1])


def gptq_qparams(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPTQModel 4-bit layer's (codes [out, in], scales [groups, out], zero points [groups, out]), read from its
    packed checkpoint tensors (GPTQModel keeps them in its v2 format in memory: the zero points as stored).
    Raises ValueError for what tinygemm cannot express (other widths, act-order)."""
    if getattr(layer, "bits", None) != 4:
        raise ValueError(f"only 4-bit GPTQ repacks into tinygemm, got {getattr(layer, 'bits', None)} bits")
    if layer.qweight.dtype != torch.int32 or layer.qweight.shape[0] * 8 != layer.in_features:
        raise ValueError("GPTQ layer is not in its packed checkpoint layout (already transformed by a kernel?)")
    group = layer.group_size
    expected = torch.arange(layer.in_features, device=layer.g_idx.device) // group
    if not torch.equal(layer.g_idx.to(expected.dtype), expected):
        raise ValueError("act-order (desc_act) GPTQ checkpoints do not map onto tinygemm's contiguous groups")
    codes = _unpack_rows(layer.qweight, 4).t()
    zeros = _unpack_rows(layer.qzeros.t(), 4).t()[:, : layer.out_features]
    return codes, layer.scales, zeros


def rtn_qparams(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit codes of ``weight`` [out, in], in GPTQ's (codes, scales, zeros) form."""
    out, k = weight.shape
    w = weight.detach().float().reshape(out, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    codes = torch.round(w / scales[..., None] + zeros[..., None]).clamp(0, 15).reshape(out, k)
    return codes.to(torch.int32), scales.t().contiguous(), zeros.t().contiguous()


def _swap_linears(model, make) -> int:
    """Replace every decoder projection for which ``make(module)`` returns a module; returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in LINEAR_NAMES:
            continue
        new = make(module)
        if new is None:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, name.rsplit(".", 1)[-1], new)
        swapped += 1
    return swapped


@torch.no_grad()
def quantize_int8_weight_only(model) -> int:
    """Make ``model``'s decoder projections int8 weight-only in place; returns how many layers."""
    return _swap_linears(model, lambda m: Int8WeightOnlyLinear.from_linear(m) if type(m) is nn.Linear else None)


@torch.no_grad()
def quantize_int4_rtn(model, group_size: int = 128) -> int:
    """Round-to-nearest int4 tinygemm projections in place (benchmarks: the int4 kernel's speed without a GPTQ
    checkpoint; quality is GPTQ's job)."""
    def make(m):
        if type(m) is not nn.Linear:
            return None
        return Int4Linear(*rtn_qparams(m.weight, group_size), group_size, m.bias)
    return _swap_linears(model, make)


@torch.no_grad()
def repack_gptq(model) -> int:
    """Swap every GPTQModel 4-bit layer of ``model`` for an :class:`Int4Linear` with the same quantized values;
    returns how many (0 when already done). Raises ValueError when a layer cannot be repacked."""
    def make(m):
        if type(m) is nn.Linear or isinstance(m, (Int4Linear, Int8WeightOnlyLinear)) or not hasattr(m, "qweight"):
            return None
        return Int4Linear(*gptq_qparams(m), m.group_size, getattr(m, "bias", None))
    return _swap_linears(model, make)
