"""Choosing tokens from logits in the owned decode loop: greedy, temperature + top-p, and the acceptance of
speculative draft tokens.

Every draft here is deterministic (n-gram lookup, or a draft model decoded greedily), i.e. a point-mass
proposal. For such a proposal, speculative sampling's rule reduces to: accept draft token ``d`` with probability
``p(d)``; on rejection sample from ``p`` with ``d`` removed. That samples exactly from the target's ``p`` (the
same distribution as decoding without a draft), and in greedy mode it accepts exactly the drafts that equal the
target's argmax, so greedy output is identical to plain decoding.
"""

from __future__ import annotations

import torch

from ...sampling_params import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution of one position after temperature and top-p (nucleus) filtering."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs[before >= params.top_p] = 0.0  # the smallest set whose mass reaches top_p stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs /= probs.sum()
    return probs


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """The next token from one position's logits."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verify step yields: ``logits[i]`` is the target's prediction after the ``i``-th fed token
    (the last accepted token, then ``drafts``). Returns the accepted drafts plus one token from the target (a
    correction, or the bonus token after all drafts), so always at least one token."""
    if params.greedy:
        predicted = logits.argmax(-1).tolist()
        out = []
        for draft, target in zip(drafts, predicted):
            out.append(target)
            if draft != target:
                return out
        return out + [predicted[len(drafts)]]
    out = []
    for i, draft in enumerate(drafts):
        probs = probabilities(logits[i], params)
        if float(torch.rand((), generator=generator, device=probs.device)) < float(probs[draft]):
            out.append(draft)
            continue
        probs[draft] = 0.0
        if float(probs.sum()) <= 0.0:  # the draft held all the mass yet was rejected: impossible but for rounding
            return out + [draft]
        return out + [int(torch.multinomial(probs / probs.sum(), 1, generator=generator))]
    return out + [choose(logits[len(drafts)], params, generator)]
