"""Build the demo model's quantized checkpoints: GPTQ 4-bit with GPTQModel, and INT8 W8A8 with compressed-tensors.

GPTQ settings: 4 bits, symmetric, desc_act off, GPTQ format (what auto-gptq users and vLLM read).
The group size must divide every linear layer's input width: SmolLM2-135M has 576 and 1536, so 64
(group 128 quantizes, but transformers' CPU int4 kernel then refuses K=576 and vLLM's engine fails to start).

Calibration: ``samples`` windows of ``seq_len`` tokens from the calibration split of the local corpus
(:mod:`modeswitch.corpus`). Measured on 2 CPU cores: 16 x 256 tokens take about 1 minute, 128 x 256
about 5.5 minutes. The default is set by ``MODESWITCH_GPTQ_SAMPLES`` (64 if unset).

W8A8 (:func:`build_w8a8`): every decoder linear's weights as int8, symmetric, one scale per output channel
(absolute maximum / 127), and activations quantized to int8 per token at run time, written in the
compressed-tensors ``int-quantized`` format that vLLM serves with its int8 scaled-mm kernels (oneDNN on a CPU,
on AVX2 too; CUTLASS on a GPU) and that RedHatAI's published w8a8 checkpoints use. ``lm_head`` (tied to the
embeddings in the demo) stays in the reference precision. No calibration or smoothing: dynamic per-token
activation scales follow each token's own range, and on the demo the held-out perplexity rose 3 % against
the bf16 reference (the quality gate's tolerance is 10 %), so the build is deterministic and takes seconds.
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
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))  # 2-core machines need it set
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


def build_w8a8(fp16_dir: Path, out_dir: Path, progress=print) -> Path:
    """Write ``fp16_dir``'s W8A8 int8 checkpoint to ``out_dir`` (atomically); returns ``out_dir``.

    compressed-tensors attaches the scheme's quantization parameters to every ``Linear`` but ``lm_head``;
    the weight scales are set here from each output channel's absolute maximum (what its min-max observer
    computes for a symmetric scheme), then its compressor rounds the weights to int8 and writes the
    ``quantization_config`` vLLM reads. The model is quantized from fp32 so the scales are exact."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    progress(f"W8A8: quantizing {fp16_dir.name} to int8 weights per channel, int8 activations per token")
    model = AutoModelForCausalLM.from_pretrained(str(fp16_dir), dtype=torch.float32)
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
    AutoTokenizer.from_pretrained(str(fp16_dir)).save_pretrained(str(tmp))
    publish(tmp, out_dir)
    progress(f"W8A8: done in {time.perf_counter() - started:.0f} s -> {out_dir}")
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m modeswitch.quantize",
                                     description="Write a W8A8 int8 checkpoint (what vLLM engines serve as INT8).")
    parser.add_argument("scheme", choices=["w8a8"])
    parser.add_argument("source", type=Path, help="a local transformers checkpoint (the reference weights)")
    parser.add_argument("out", type=Path, help="the directory to write (serve it with serve.py --w8a8 OUT)")
    args = parser.parse_args()
    build_w8a8(args.source, args.out)
