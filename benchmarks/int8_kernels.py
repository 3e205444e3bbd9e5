"""One W8A8 int8 linear on this CPU: vLLM's oneDNN matmul against ModeSwitch's FBGEMM one and float32.

The demo's own int8 weights (its W8A8 checkpoint, one decoder layer's linears fused as vLLM fuses them: QKV, the
attention output, gate/up, down), at token counts from one decode step to a prompt, one thread: milliseconds a
call for

- ``oneDNN``: vLLM's CPU W8A8 path as it runs its int8 linears (activations quantized per token by its op, then
  its oneDNN matmul handler, weights handed over once);
- ``FBGEMM``: :mod:`modeswitch.engines.vllm.int8_fbgemm` (weights packed once, activations per token), what
  ModeSwitch's engines run where oneDNN has no int8 kernel of its own (an AVX2-only CPU);
- ``float32``: the same weights dequantized, ``x @ w.T`` (what the reference's linears compute on such a CPU);

and each int8 kernel's error against the exact product of the int8 weights with the activations quantized per
token to 8 bits (relative norm over the output; random Gaussian activations). Prints a table and writes
``benchmarks/results/int8_kernels[_TAG].{json,md}``.

    .venv/bin/python benchmarks/int8_kernels.py [--layer 0] [--tokens 1,8,64,256] [--tag T]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402

#: the demo's linears as vLLM fuses them: name -> the checkpoint's projections, concatenated by output channel
LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
           "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def demo_linears(layer: int):
    """``{name: (int8 weight [N, K], per-channel scales [N, 1])}`` of decoder layer ``layer`` of the demo's W8A8
    checkpoint (built by ``make setup``)."""
    import torch
    from safetensors import safe_open

    from modeswitch.weights.presets import demo_dir

    path = demo_dir("demo-w8a8") / "model.safetensors"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: build the demo's W8A8 checkpoint first (make setup)")
    with safe_open(str(path), "pt") as stored:
        def get(projection: str, what: str) -> torch.Tensor:
            return stored.get_tensor(f"model.layers.{layer}.{projection}.{what}")

        return {name: (torch.cat([get(p, "weight") for p in parts]), torch.cat([get(p, "weight_scale") for p in parts]))
                for name, parts in LINEARS.items()}


def timed(call, budget_s: float = 0.3) -> float:
    """Milliseconds one ``call`` takes: the median of five batches, sized to ``budget_s`` together."""
    call()
    start = time.perf_counter()
    call()
    per = max(3, int(budget_s / 5 / max(time.perf_counter() - start, 1e-6)))
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(per):
            call()
        batches.append((time.perf_counter() - start) / per)
    return sorted(batches)[2] * 1e3


def measure(weight, scales, tokens: int) -> dict[str, float]:
    import torch
    from vllm import _custom_ops as ops

    from modeswitch.engines.vllm import int8_fbgemm

    n, k = weight.shape
    dense = (weight.float() * scales).t().contiguous()
    handler = ops.create_onednn_scaled_mm(weight.t(), scales, torch.float32, True, False, 32)
    index = int8_fbgemm.pack(weight, scales)
    x = torch.randn(tokens, k)

    def onednn() -> torch.Tensor:
        quantized, x_scales, x_zero = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((tokens, n))
        ops.onednn_scaled_mm(handler, quantized, out, x_scales, x_zero, None, None)
        return out

    def fbgemm() -> torch.Tensor:
        return int8_fbgemm.linear(x, index)

    def float32() -> torch.Tensor:
        return x @ dense

    step = x.abs().amax(dim=1, keepdim=True) / 127
    exact = (torch.round(x / step) * step) @ dense

    def error(out: torch.Tensor) -> float:
        return round(float((out - exact).norm() / exact.norm()), 4)

    return {"onednn_ms": timed(onednn), "fbgemm_ms": timed(fbgemm), "float32_ms": timed(float32),
            "onednn_error": error(onednn()), "fbgemm_error": error(fbgemm())}


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", type=int, default=0, help="the decoder layer whose linears are measured")
    ap.add_argument("--tokens", default="1,8,64,256", help="token counts (rows) per call, comma-separated")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        print("this torch has no FBGEMM (not an x86 build): nothing to compare", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = []
    for name, (weight, scales) in demo_linears(args.layer).items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            n, k = weight.shape
            row = {"linear": name, "out": n, "in": k, "tokens": tokens, **measure(weight, scales, tokens)}
            rows.append(row)
            print(row, flush=True)
    lines = [f"# One W8A8 int8 linear of the demo's layer {args.layer}, one thread ({processor()})", "",
             "| linear (out x in) | tokens | oneDNN ms | FBGEMM ms | float32 ms | FBGEMM vs oneDNN | FBGEMM vs float32 "
             "| error oneDNN | error FBGEMM |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['linear']} ({r['out']}x{r['in']}) | {r['tokens']} | {r['onednn_ms']:.3f} | "
                     f"{r['fbgemm_ms']:.3f} | {r['float32_ms']:.3f} | {r['onednn_ms'] / r['fbgemm_ms']:.2f}x | "
                     f"{r['float32_ms'] / r['fbgemm_ms']:.2f}x | {r['onednn_error']:.2%} | {r['fbgemm_error']:.2%} |")
    lines += ["", "Error: relative norm of the output against the exact product of the int8 weights with the "
              "activations quantized per token to 8 bits (random Gaussian activations)."]
    text = "\n".join(lines)
    print(text)
    save_results(args.out, "int8_kernels", args.tag, {"layer": args.layer, "rows": rows}, text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
