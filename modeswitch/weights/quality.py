"""Cheap quality measurements between weight variants: held-out perplexity and greedy agreement.

The lm-eval quality gate is the authority on accuracy; these two numbers are what the modes benchmark
and the quantization tests check on the way (perplexity barely moves under int8, so greedy agreement with
fp16 is tracked as well).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .corpus import heldout_paragraphs, token_windows


@torch.inference_mode()
def perplexity(model, tokenizer, windows: int = 8, length: int = 256) -> float:
    """Perplexity over ``windows`` x ``length`` tokens of held-out corpus text."""
    nll = n = 0.0
    for window in token_windows(tokenizer, heldout_paragraphs(), windows, length):
        x = torch.tensor([window], device=model.device)
        nll += model(x, labels=x).loss.item() * (len(window) - 1)
        n += len(window) - 1
    return math.exp(nll / n)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens before the first difference (the shorter length when one extends the other)."""
    return next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))
