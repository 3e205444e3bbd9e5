"""Build the demo model's GPTQ 4-bit checkpoint with GPTQModel, from the project's own calibration text.

GPTQ settings: 4 bits, symmetric, desc_act off, GPTQ format (what auto-gptq users and vLLM read).
The group size must divide every linear layer's input width: SmolLM2-135M has 576 and 1536, so 64
(group 128 quantizes, but transformers' CPU int4 kernel then refuses K=576 and vLLM's engine fails to start).

Calibration: ``samples`` windows of ``seq_len`` tokens from the calibration split of the local corpus
(:mod:`modeswitch.corpus`). Measured on 2 CPU cores: 16 x 256 tokens take about 1 minute, 128 x 256
about 5.5 minutes. The default is set by ``MODESWITCH_GPTQ_SAMPLES`` (64 if unset).
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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"GPTQ: done in {elapsed:.0f} s -> {out_dir}")
    return out_dir
