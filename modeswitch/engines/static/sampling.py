"""The owned decode loop's verify step: which drafted tokens it keeps, as vLLM's rejection sampler
(``vllm/v1/sample/rejection_sampler.py``) decides for drafts that carry no probabilities (its n-gram ones).

Every draft here is deterministic (n-gram lookup, or a draft model decoded greedily), i.e. a point-mass proposal.
For such a proposal, speculative sampling's rule reduces to: accept draft token ``d`` with probability ``p(d)``;
on rejection sample from ``p`` with ``d`` removed. That samples exactly from the target's ``p`` (the same
distribution as decoding without a draft), and in greedy mode it accepts exactly the drafts that equal the target's
argmax, so greedy output is identical to plain decoding.

A sampled verify step draws from the request's generator in vLLM's order: the bonus token first (the token after
the last draft, picked as its sampler picks: :mod:`modeswitch.engines.draws`), then one uniform per draft (float64,
compared in float32), then one float32 exponential per vocabulary entry, shared by the step's drafted positions. A draft is kept while
``p(d) >= uniform``; the first one rejected is replaced by ``argmax(p' / exponential)``, ``p'`` its position's
probabilities with ``d`` removed. Given the same drafts and logits, the tokens are vLLM's; which tokens are drafted
is the drafter's choice (:mod:`modeswitch.engines.static.drafts`), not vLLM's proposer's.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList

from ...sampling_params import SamplingParams
from ..draws import gumbel_argmax, step_seed
from ..transformers.processors import warpers


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The rows of ``logits`` in float32 after temperature and the sampling filters
    (:func:`~modeswitch.engines.transformers.processors.warpers`): what vLLM's rejection sampler takes the
    target's probabilities from."""
    return LogitsProcessorList(warpers(params))(None, logits.float())


def accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verify step yields: ``logits[i]`` is the target's prediction after the ``i``-th fed token
    (the last accepted token, then ``drafts``). Returns the accepted drafts plus one token from the target (a
    correction, or the bonus token after all drafts), so always at least one token. A sampled request draws from
    ``generator`` (None: torch's global one)."""
    if params.greedy:
        predicted = logits.argmax(-1).tolist()
        out = []
        for draft, target in zip(drafts, predicted):
            out.append(target)
            if draft != target:
                return out
        return out + [predicted[len(drafts)]]
    scores = processed(logits, params)
    bonus = gumbel_argmax(scores[len(drafts)], step_seed(generator))
    if not drafts:
        return [bonus]
    # drawn in float64, compared in float32 (vLLM's CPU kernel takes them as float32)
    uniforms = torch.empty(len(drafts), dtype=torch.float64).uniform_(generator=generator).float().tolist()
    inv_q = torch.empty(scores.shape[-1], dtype=torch.float32).exponential_(generator=generator).reciprocal()
    probs = torch.softmax(scores[:len(drafts)].cpu(), dim=-1, dtype=torch.float32)
    out = []
    for i, draft in enumerate(drafts):
        if float(probs[i, draft]) >= uniforms[i]:
            out.append(draft)
            continue
        probs[i, draft] = 0.0
        return out + [int((probs[i] * inv_q).argmax())]
    return out + [bonus]
