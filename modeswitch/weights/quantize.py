"""Build the demo model's quantized checkpoints: GPTQ 4-bit with GPTQModel, and INT8 W8A8 with compressed-tensors.

GPTQ settings: 4 bits, symmetric, desc_act off, GPTQ format (what auto-gptq users and vLLM read).
The group size must divide every linear layer's input width: SmolLM2-135M has 576 and 1536, so 64
(group 128 quantizes, but transformers' CPU int4 kernel then refuses K=576 and vLLM's engine fails to start).

Calibration: ``samples`` windows of ``seq_len`` tokens from the calibration split of the local corpus
(:mod:`modeswitch.weights.corpus`). Its time grows with the windows (minutes on a few CPU cores), so their
number is set by ``MODESWITCH_GPTQ_SAMPLES`` (:data:`DEFAULT_SAMPLES` if unset).

W8A8 (:func:`build_w8a8`): every decoder linear's weights as int8, symmetric, one scale per output channel
(absolute maximum / 127), and activations quantized to int8 per token at run time, written in the
compressed-tensors ``int-quantized`` format that vLLM serves with its int8 scaled-mm kernels (oneDNN on a CPU,
on AVX2 too; CUTLASS on a GPU) and that RedHatAI's published w8a8 checkpoints use. ``lm_head`` (tied to the
embeddings in the demo) stays in the reference precision. Before quantizing, SmoothQuant (:func:`smooth`,
``SMOOTHING_ALPHA``, calibrated on ``SMOOTHING_SAMPLES`` windows of the calibration split) moves the activations'
outlier channels into the weights where a norm precedes the linears: the demo's plain W8A8 failed the quality
gate on jargon_copy, and smoothed it passes (the gate's reports: evals/reports/). Folding a scale into down_proj
through up_proj as well helped perplexity but cost cloze accuracy, so it is not done.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

GROUP_SIZE = 64
SEQ_LEN = 256
DEFAULT_SAMPLES = 64


def default_samples() -> int:
    return int(os.environ.get("MODESWITCH_GPTQ_SAMPLES", DEFAULT_SAMPLES))


def publish(tmp: Path, out_dir: Path) -> None:
    """Move a checkpoint written under a temporary name into place: an interrupted build never leaves a
    half-written directory that later loads would trust, and of two processes building it the first wins."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


def build_gptq(fp16_dir: Path, out_dir: Path, samples: int, seq_len: int = SEQ_LEN, group_size: int = GROUP_SIZE,
               progress=print) -> Path:
    """Quantize ``fp16_dir`` into ``out_dir`` (written atomically); returns ``out_dir``."""
    # GPTQModel's own default is half the cores (one of two): calibrate on all of them
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    from .corpus import SOURCE, calibration_paragraphs, token_windows

    tokenizer = AutoTokenizer.from_pretrained(str(fp16_dir))
    windows = token_windows(tokenizer, calibration_paragraphs(), samples, seq_len)
    calibration = [{"input_ids": w, "attention_mask": [1] * len(w)} for w in windows]
    progress(f"GPTQ: quantizing {fp16_dir.name} to 4 bits (group {group_size}) on {samples} x {seq_len} tokens "
             f"of calibration text; this runs once")
    started = time.perf_counter()
    config = QuantizeConfig(bits=4, group_size=group_size, sym=True, desc_act=False)
    model = GPTQModel.load(str(fp16_dir), config)
    model.quantize(calibration, batch_size=1)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    model.save(str(tmp))
    elapsed = time.perf_counter() - started
    (tmp / "modeswitch_calibration.json").write_text(json.dumps({
        "source": SOURCE, "samples": samples, "seq_len": seq_len, "group_size": group_size, "bits": 4,
        "sym": True, "desc_act": False, "seconds": round(elapsed, 1)}, indent=2))
    publish(tmp, out_dir)
    progress(f"GPTQ: done in {elapsed:.0f} s -> {out_dir}")
    return out_dir


#: the compressed-tensors preset: int8 weights per output channel (static), int8 activations per token (dynamic)
W8A8_SCHEME = "W8A8"
#: SmoothQuant's migration strength (0: all quantization difficulty left on the activations, 1: all on the weights)
SMOOTHING_ALPHA = 0.5
#: calibration windows (of ``SEQ_LEN`` tokens) whose activations set the smoothing scales
SMOOTHING_SAMPLES = 16


def smooth(model, windows: list[list[int]], alpha: float = SMOOTHING_ALPHA) -> int:
    """SmoothQuant (Xiao et al., 2023) on a Llama-family model, in place; returns the layers smoothed.

    Per-token int8 activations lose precision where a few input channels carry outliers. Where a norm feeds
    linears (``input_layernorm`` -> q/k/v, ``post_attention_layernorm`` -> gate/up), each input channel j is
    divided by s_j in the norm's weight and multiplied by s_j in the linears' weights, with
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over the calibration ``windows``: the function is unchanged,
    the activations' range is evened out, and the weights (quantized per output channel) take the rest."""
    import torch

    peaks: dict[int, torch.Tensor] = {}

    def record(key: int):
        def hook(_module, args):
            peak = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
            peaks[key] = torch.maximum(peaks[key], peak) if key in peaks else peak
        return hook

    groups = []  # (norm, linears it feeds)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]),
                   (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])]
    handles = [linears[0].register_forward_pre_hook(record(i)) for i, (_, linears) in enumerate(groups)]
    try:
        with torch.no_grad():
            for window in windows:
                model(torch.tensor([window]))
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        for i, (norm, linears) in enumerate(groups):
            weight_peak = torch.stack([linear.weight.abs().amax(0) for linear in linears]).amax(0)
            scale = (peaks[i].clamp(min=1e-5) ** alpha / weight_peak.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
            norm.weight.div_(scale)
            for linear in linears:
                linear.weight.mul_(scale)
    return len(groups) // 2


def build_w8a8(fp16_dir: Path, out_dir: Path, progress=print) -> Path:
    """Write ``fp16_dir``'s W8A8 int8 checkpoint to ``out_dir`` (atomically); returns ``out_dir``.

    The model is smoothed first (:func:`smooth`). compressed-tensors then attaches the scheme's quantization
    parameters to every ``Linear`` but ``lm_head``; the weight scales are set here from each output channel's
    absolute maximum (what its min-max observer computes for a symmetric scheme), then its compressor rounds the
    weights to int8 and writes the ``quantization_config`` vLLM reads. The model is quantized from fp32 so the
    scales are exact."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .corpus import calibration_paragraphs, token_windows

    started = time.perf_counter()
    progress(f"W8A8: smoothing and quantizing {fp16_dir.name} to int8 weights per channel, int8 activations per "
             "token")
    model = AutoModelForCausalLM.from_pretrained(str(fp16_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(fp16_dir))
    smooth(model, token_windows(tokenizer, calibration_paragraphs(), SMOOTHING_SAMPLES, SEQ_LEN))
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(W8A8_SCHEME, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                absmax = module.weight.abs().amax(dim=1, keepdim=True)
                module.weight_scale.copy_((absmax / 127).clamp(min=torch.finfo(torch.float32).tiny))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    model.save_pretrained(str(tmp))
    compressor.update_config(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    publish(tmp, out_dir)
    progress(f"W8A8: done in {time.perf_counter() - started:.0f} s -> {out_dir}")
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m modeswitch.weights.quantize",
                                     description="Write a W8A8 int8 checkpoint (what vLLM engines serve as INT8).")
    parser.add_argument("scheme", choices=["w8a8"])
    parser.add_argument("source", type=Path, help="a local transformers checkpoint (the reference weights)")
    parser.add_argument("out", type=Path, help="the directory to write (serve it with serve.py --w8a8 OUT)")
    args = parser.parse_args()
    build_w8a8(args.source, args.out)
