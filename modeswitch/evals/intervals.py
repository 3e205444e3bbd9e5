"""How sure a gate verdict is: a paired bootstrap over the documents both a mode and the reference scored.

A gate row compares a mode's score with the reference's on the same documents, so what decides the verdict's
uncertainty is how the two differ document by document, not each score's own standard error (lm-eval's, which
ignores the pairing). The bootstrap draws documents with replacement, the same draw for both, recomputes each
aggregate on it (the mean for accuracy-like metrics; ``exp(-sum log-likelihood / sum words)`` for the
perplexities of rolling log-likelihood tasks) and takes the central :data:`CONFIDENCE` of the change (pp or %,
as :func:`~modeswitch.controller.quality.change` measures it).

A verdict is *uncertain* when its interval reaches both sides of the tolerance (:func:`uncertain`): at that many
documents the data cannot tell a pass from a fail. (A half-width over the tolerance alone does not make it so: a
-67 pp change with the interval [-92, -42] pp fails at a 1 pp tolerance however wide the interval.) The half-width
shrinks as ``1/sqrt(documents)``, so :func:`documents_needed` says how many documents the same per-document spread
needs for a half-width within the tolerance, which any verdict near the tolerance needs.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Union

#: the share of the bootstrap distribution the interval covers
CONFIDENCE = 0.95
#: bootstrap draws per interval (the percentiles move by well under 0.1 pp between seeds at this count)
RESAMPLES = 2000

#: one document's score: a number (accuracy, exact match), or (log-likelihood, weight) for a perplexity
Score = Union[float, tuple[float, float]]


def per_document(samples: Iterable[dict[str, Any]], metric: str) -> dict[str, Score]:
    """doc_id -> its score under ``metric`` (lm-eval's ``name,filter`` key) from lm-eval's logged samples
    (``simple_evaluate(..., log_samples=True)["samples"][task]``). Keys are strings, as the report's JSON keeps them."""
    name, _, filter_name = metric.partition(",")
    out: dict[str, Score] = {}
    for sample in samples:
        if filter_name and sample.get("filter", filter_name) != filter_name:
            continue
        value = sample[name]
        out[str(sample["doc_id"])] = (float(value[0]), float(value[1])) if isinstance(value, (list, tuple)) \
            else float(value)
    return out


def paired_interval(mode: dict[str, Score], ref: dict[str, Score], higher_is_better: bool,
                    resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, int] | None:
    """The :data:`CONFIDENCE` interval of the mode's change against the reference over the documents both scored,
    and how many those are; None with fewer than two."""
    import numpy as np

    docs = sorted(set(mode) & set(ref))
    if len(docs) < 2:
        return None
    draws = np.random.default_rng(seed).integers(0, len(docs), size=(resamples, len(docs)))

    def aggregates(scores: dict[str, Score]):
        values = np.array([scores[d] for d in docs], dtype=float)
        if values.ndim == 2:  # (log-likelihood, weight) per document: the weighted perplexity
            return np.exp(-values[draws, 0].sum(axis=1) / values[draws, 1].sum(axis=1))
        return values[draws].mean(axis=1)

    m, r = aggregates(mode), aggregates(ref)
    deltas = (m - r) * 100 if higher_is_better else (m / r - 1) * 100
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(deltas, [tail, 100 - tail])
    return float(lo), float(hi), len(docs)


def uncertain(lo: float, hi: float, tolerance: float, higher_is_better: bool) -> bool:
    """Whether the change's interval [lo, hi] holds both passing and failing changes: below ``-tolerance`` pp fails
    for an accuracy, above ``tolerance`` % for a perplexity (as ``controller.quality.task_failure`` judges)."""
    return lo < -tolerance <= hi if higher_is_better else lo <= tolerance < hi


def documents_needed(half_width: float, documents: int, tolerance: float) -> int:
    """Documents for a half-width within ``tolerance``, given ``half_width`` at ``documents`` (1/sqrt(n) scaling)."""
    if half_width <= tolerance:
        return documents
    return math.ceil(documents * (half_width / tolerance) ** 2)
