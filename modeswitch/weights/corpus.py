"""Local English text for calibration and held-out measurements (no hub needed).

The corpus is prose from The Jargon File 4.4.7 (public domain), built by ``scripts/make_corpus.py``.
Paragraphs are split deterministically: every 5th paragraph is held out (perplexity, agreement), the
rest may calibrate quantizers. Calibration never sees held-out text.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from ..resources import CORPUS

SOURCE = "The Jargon File 4.4.7 (public domain), prose paragraphs; see scripts/make_corpus.py"


@lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return tuple(p for p in f.read().split("\n\n") if p.strip())


def calibration_paragraphs() -> list[str]:
    return [p for i, p in enumerate(paragraphs()) if i % 5 != 4]


def heldout_paragraphs() -> list[str]:
    return [p for i, p in enumerate(paragraphs()) if i % 5 == 4]


def token_windows(tokenizer, texts: list[str], count: int, length: int) -> list[list[int]]:
    """``count`` windows of exactly ``length`` tokens from the concatenated ``texts``, in order."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n").input_ids)
        if len(ids) >= count * length:
            break
    if len(ids) < count * length:
        raise ValueError(f"corpus too small for {count} windows of {length} tokens")
    return [ids[i * length:(i + 1) * length] for i in range(count)]
