"""W8A8 int8 linears on FBGEMM where oneDNN has no int8 kernel of its own (modeswitch.engines.vllm.int8_fbgemm): the
same arithmetic as vLLM's oneDNN path (int8 weights per channel, activations per token), taken on the CPUs that
need it and only for the checkpoints whose arithmetic it reproduces."""

from __future__ import annotations

import importlib

import pytest
import torch

from modeswitch.engines.vllm import compat, int8_fbgemm
from modeswitch.engines.vllm.args import vllm_installed

pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed"),
              pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                 reason="this torch has no FBGEMM (not x86)")]

NAMES = ("weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj")


def _layer(weight: torch.Tensor, scales: torch.Tensor, widths: list[int]) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scales.clone(), requires_grad=False)
    layer.input_scale = layer.input_zero_point = layer.azp_adj = None
    layer.logical_widths = widths
    return layer


def _kernel(symmetric: bool = True, static: bool = False, channelwise: bool = True):
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    kernel_class = compat.TARGETS["cpu_int8_onednn_weights"].owner()[0]
    config = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=static, is_channelwise=channelwise,
                                           input_symmetric=symmetric)
    kernel = kernel_class(config, NAMES)
    kernel.linear_method = kernel._apply_weights_onednn  # as process_weights_after_loading sends it to oneDNN
    return kernel


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights per output channel as a model's look: each channel's largest far above the rest (here the rest
    under half of it, so that no two neighbours' products saturate FBGEMM's 16-bit pair sums, see the module)."""
    weight = torch.randint(-60, 61, (n, k), dtype=torch.int8)
    weight[:, 0], weight[:, 1] = 127, 0
    return weight, torch.rand(n, 1) * 0.02 + 0.001


def _quantized_as_vllm(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each row quantized as vLLM quantizes activations: symmetric, 127 levels either side of zero."""
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / step) * step


@pytest.fixture
def on_fbgemm(monkeypatch):
    """The replacement installed as on an AVX2 CPU (``MODESWITCH_CPU=avx2``), vLLM's own put back afterwards."""
    kernel_class, name = compat.TARGETS["cpu_int8_onednn_weights"].owner()
    monkeypatch.setenv("MODESWITCH_CPU", "avx2")
    monkeypatch.setattr(compat, "_replaced", {})
    monkeypatch.setattr(kernel_class, name, getattr(kernel_class, name))
    int8_fbgemm.use_fbgemm_for_int8()
    return kernel_class


def test_the_linear_quantizes_per_token_close_to_the_exact_product():
    torch.manual_seed(0)
    weight, scales = _weights(96, 64)
    x = torch.randn(2, 5, 64)
    x[0, 0] *= 50  # one token far louder than the rest: one scale for all would flatten the others
    index = int8_fbgemm.pack(weight, scales)
    got = int8_fbgemm.linear(x, index)
    exact = x @ (weight.float() * scales).t()
    assert got.shape == (2, 5, 96)
    errors = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert errors.max() < 0.03, errors  # 8-bit activations per token: about 1 %
    assert torch.equal(torch.compile(lambda t: int8_fbgemm.linear(t, index), fullgraph=True)(x), got)
    x[1, 2] = float("nan")  # a row of unset memory, as in vLLM's dummy runs: its output only is lost
    out = int8_fbgemm.linear(x, index)
    assert out[1, 2].isnan().all() and torch.equal(out[0], got[0])


def test_a_tokens_result_is_vllms_per_token_arithmetic_whatever_the_tokens_beside_it():
    """A verify step computes a drafted token in a batch of them, a decode step alone: the same token gives the same
    output, bit for bit, alone and beside tokens whose ranges differ from its own (all positive, all negative, far
    louder), eager and compiled; and that output is the product of the weights with the token quantized as vLLM
    quantizes it (symmetric, per token, 127 levels either side of zero)."""
    torch.manual_seed(2)
    weight, scales = _weights(64, 48)
    index = int8_fbgemm.pack(weight, scales)
    exact = weight.float() * scales

    def eager(x: torch.Tensor) -> torch.Tensor:
        return int8_fbgemm.linear(x, index)

    compiled = torch.compile(eager, dynamic=True, fullgraph=True)  # vLLM's graphs take any number of tokens
    for trial in range(20):
        token = torch.randn(1, 48).abs() * torch.where(torch.arange(48) < 8, -0.3, 1.0) + trial / 10  # skewed
        alone = eager(token)
        vllms = _quantized_as_vllm(token) @ exact.t()
        assert (alone - vllms).norm() / vllms.norm() < 1e-5
        for beside in (torch.randn(3, 48).abs(), -torch.randn(3, 48).abs(), torch.randn(5, 48) * 40):
            for run in (eager, compiled):
                assert torch.equal(run(torch.cat([token, beside]))[:1], alone)
                assert torch.equal(run(torch.cat([beside, token]))[-1:], alone)


@pytest.mark.skipif(not int8_fbgemm.onednn_lacks_int8_kernel(), reason="oneDNN has an int8 kernel of its own here")
def test_where_it_replaces_onednn_it_computes_what_vllms_onednn_kernel_computes_saturation_included():
    """On an AVX2-only CPU vLLM's own W8A8 kernel (oneDNN) and this one give the same outputs to float rounding,
    also where skewed activations beside large weights saturate both kernels' 16-bit pair sums."""
    from vllm import _custom_ops as ops

    torch.manual_seed(4)
    weight, scales = torch.randint(-127, 128, (96, 64), dtype=torch.int8), torch.rand(96, 1) * 0.02 + 0.001
    x = torch.randn(7, 64)
    x[:, 3] = -30.0
    handler = ops.create_onednn_scaled_mm(weight.t(), scales, torch.float32, True, False, 32)
    quantized, x_scales, x_zero = ops.onednn_scaled_int8_quant(x, None, None, True)
    vllms = torch.empty((7, 96))
    ops.onednn_scaled_mm(handler, quantized, vllms, x_scales, x_zero, None, None)
    got = int8_fbgemm.linear(x, int8_fbgemm.pack(weight, scales))
    assert (got - vllms).norm() / vllms.norm() < 1e-6
    unsaturated = _quantized_as_vllm(x) @ (weight.float() * scales).t()
    assert (vllms - unsaturated).norm() > 1e-3 * vllms.norm()  # the case is one where the pair sums saturate


def test_on_an_avx2_cpu_vllms_int8_linears_run_on_fbgemm(on_fbgemm):
    torch.manual_seed(1)
    weight, scales = _weights(80, 48)
    bias = torch.randn(80)
    x = torch.randn(3, 48)
    kernel, layer = _kernel(), _layer(weight, scales, [32, 48])
    kernel.process_weights_for_onednn(layer)
    assert kernel.linear_method.__name__ == "_apply_weights_fbgemm" and layer.weight is None
    exact = x @ (weight.float() * scales).t() + bias
    assert (kernel.apply_weights(layer, x, bias) - exact).norm() / exact.norm() < 0.03
    int8_fbgemm.use_fbgemm_for_int8()
    assert compat.original("cpu_int8_onednn_weights") is getattr(*compat.TARGETS["cpu_int8_onednn_weights"].owner())


def test_a_fused_layers_per_tensor_scales_become_per_channel(on_fbgemm):
    torch.manual_seed(2)
    weight = _weights(40, 32)[0]
    scales = torch.tensor([0.01, 0.03])  # one per fused part (24 + 16 rows)
    x = torch.randn(4, 32)
    kernel, layer = _kernel(channelwise=False), _layer(weight, scales, [24, 16])
    kernel.process_weights_for_onednn(layer)
    exact = x @ (weight.float() * torch.repeat_interleave(scales, torch.tensor([24, 16]))[:, None]).t()
    assert (kernel.apply_weights(layer, x) - exact).norm() / exact.norm() < 0.03


@pytest.mark.parametrize("symmetric,static", [(False, False), (True, True)])
def test_other_activation_schemes_stay_on_onednn(on_fbgemm, symmetric, static):
    torch.manual_seed(3)
    weight, scales = _weights(32, 32)
    kernel, layer = _kernel(symmetric=symmetric, static=static), _layer(weight, scales, [32])
    if static:
        layer.input_scale = torch.nn.Parameter(torch.tensor([0.05]), requires_grad=False)
    kernel.process_weights_for_onednn(layer)
    assert kernel.linear_method.__name__ == "_apply_weights_onednn"


def test_only_where_onednn_lacks_an_int8_kernel(monkeypatch):
    from modeswitch import device

    monkeypatch.setenv("MODESWITCH_CPU", "avx2")
    assert int8_fbgemm.onednn_lacks_int8_kernel()
    monkeypatch.delenv("MODESWITCH_CPU")
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "avx_vnni"})
    monkeypatch.setattr(device, "cpu_has_avx512", lambda: False)
    assert not int8_fbgemm.onednn_lacks_int8_kernel()  # AVX-VNNI: oneDNN's own int8 kernel
    monkeypatch.setattr(device, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert not int8_fbgemm.onednn_lacks_int8_kernel()
    cpu = importlib.import_module(compat.TARGETS["cpu_int8_onednn_weights"].module)
    before = cpu.CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
    int8_fbgemm.use_fbgemm_for_int8()
    assert cpu.CPUInt8ScaledMMLinearKernel.process_weights_for_onednn is before


def test_vllms_own_server_gets_the_fbgemm_linears_only_when_asked(monkeypatch):
    """The plugin loads into every vLLM process of the environment. In vLLM's own server (no ModeSwitch server
    above it) it changes nothing, unless ``FBGEMM_ENV`` asks for the int8 linears ModeSwitch's engines use (a
    like-with-like peer): then those, and nothing else of the plugin."""
    from modeswitch.engines.vllm import drafting, plugin

    kernel_class, name = compat.TARGETS["cpu_int8_onednn_weights"].owner()
    monkeypatch.setenv("MODESWITCH_CPU", "avx2")
    monkeypatch.delenv(plugin.SERVER_ENV, raising=False)
    monkeypatch.setattr(compat, "_replaced", {})
    monkeypatch.setattr(kernel_class, name, getattr(kernel_class, name))
    shipped = getattr(kernel_class, name)
    drafted = []
    monkeypatch.setattr(drafting, "draft_per_request", drafted.append)
    plugin.register()
    assert getattr(kernel_class, name) is shipped and not drafted
    monkeypatch.setenv(plugin.FBGEMM_ENV, "1")
    plugin.register()
    assert getattr(kernel_class, name) is not shipped and getattr(getattr(kernel_class, name), "fbgemm", False)
    assert not drafted
