"""A request's decoding options as transformers logits processors, for every transformers decode path.

The list applies the options in the order vLLM's v1 sampler (``vllm/v1/sample/sampler.py``) applies them, so a
request means the same on both engines: the grammar's mask (vLLM's model runner applies it before the sampler),
then the logprobs are read (vLLM's ``raw_logprobs``), then ``min_tokens`` and ``logit_bias`` (its logits processors
that can change the greedy choice), then the repetition, frequency and presence penalties; a greedy request takes
the argmax there. A sampled one goes on through temperature, ``min_p`` (its argmax-invariant processor), top-k and
top-p, and :class:`_Pick`. The order matters where two options touch one token: a biased token that was already
generated is penalised after its bias (``(logit + bias) / penalty`` when positive), and top-p counts only the
probability ``min_p`` left.

``generate()`` runs with ``do_sample=False`` and this list: :class:`_Pick` samples one token with the request's
own generator and leaves only that token possible, so ``generate()``'s greedy choice takes it. Sampling that way is
what makes ``seed`` work (``generate()`` samples from torch's global generator, which every engine thread shares),
and :class:`_Pick` draws as vLLM's CPU sampler does (:mod:`modeswitch.engines.draws`), so a seed gives the text
vLLM gives wherever the two engines' logits agree. The owned static-cache loop applies the same list to its logits
(:meth:`Decoding.choose`).

OpenAI's presence and frequency penalties have no transformers processor; :class:`_Penalties` applies them as
vLLM does (over the generated tokens, subtracted from the logits).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper)

from ..base import TokenLogprobs
from ..draws import gumbel_argmax, step_seed
from ...sampling_params import SamplingParams
from ..grammar import Grammars


class _Penalties(LogitsProcessor):
    """``logits -= frequency * count + presence * (count > 0)`` over the tokens generated so far (vLLM's rule)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len:]
        if not out.numel():
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class _Record(LogitsProcessor):
    """Right after the grammar's mask: keeps each step's log-softmax of the model's logits, so the chosen token's
    logprob and the top alternatives can be read once it is known (:meth:`Decoding.logprobs`)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append(torch.log_softmax(scores[0].float(), dim=-1))
        return scores


class _Pick(LogitsProcessor):
    """Last in the list: sample one token per row from the processed logits as vLLM's CPU sampler does (one integer
    from the request's generator, then :func:`~modeswitch.engines.draws.gumbel_argmax`), and mask every other token,
    so a greedy choice after it takes the sampled one."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, -float("inf"))
        for row in range(scores.shape[0]):
            out[row, gumbel_argmax(scores[row], step_seed(self.generator))] = 0.0
        return out


def generator(seed: int | None) -> torch.Generator:
    """The request's own CPU generator: seeded by ``seed``, else from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def warpers(params: SamplingParams) -> list[LogitsProcessor]:
    """What a sampled request's logits go through after the penalties, in vLLM's order: temperature, ``min_p``,
    top-k, top-p (each removed token at -inf). The speculative loop's verify step applies them too
    (:func:`modeswitch.engines.static.sampling.accept`)."""
    p = params
    out: list[LogitsProcessor] = [TemperatureLogitsWarper(p.temperature)]
    if p.min_p > 0.0:
        out.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        out.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        out.append(TopPLogitsWarper(p.top_p))
    return out


def stop_ids(params: SamplingParams, eos: set[int]) -> set[int]:
    """Tokens that end this request: the model's end-of-sequence tokens (unless ``ignore_eos``) and its own."""
    return (set() if params.ignore_eos else set(eos)) | set(params.stop_token_ids)


class Decoding:
    """One request's processors (:attr:`processors`, for ``generate()``) and what reads them back."""

    def __init__(self, params: SamplingParams, prompt_len: int, eos: set[int], grammars: Grammars | None) -> None:
        p = params
        self.params = params
        #: the request's own random generator (None when greedy); speculative acceptance draws from it too
        self.generator = None if p.greedy else generator(p.seed)
        self._record = _Record() if p.logprobs is not None else None
        procs: list[LogitsProcessor] = []
        if p.constraint is not None:
            if grammars is None:
                raise ValueError("this engine was started without a grammar compiler")
            procs.append(grammars.processor(p.constraint))
        if self._record is not None:
            procs.append(self._record)
        if p.min_tokens:
            procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, sorted(stop_ids(p, eos)) or [-1]))
        if p.logit_bias:
            procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias]))
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            procs.append(_Penalties(prompt_len, p.presence_penalty, p.frequency_penalty))
        if not p.greedy:
            procs += [*warpers(p), _Pick(self.generator)]
        self.processors = LogitsProcessorList(procs)
        self._read = 0

    def choose(self, input_ids: list[int], logits: torch.Tensor) -> int:
        """The next token after ``input_ids`` from one position's logits (the owned loop's decode step)."""
        if self.processors:
            ids = torch.tensor([input_ids], device=logits.device)
            logits = self.processors(ids, logits[None].float())[0]
        return int(logits.argmax())

    def logprobs(self, token_ids: list[int]) -> list[TokenLogprobs]:
        """Logprobs of the tokens chosen since the last call (one recorded step each), for the ``tokens`` event."""
        if self._record is None:
            return []
        k = self.params.logprobs
        out = []
        for token, step in zip(token_ids, self._record.steps[self._read:]):
            top = step.topk(k) if k else None
            out.append(TokenLogprobs(token, float(step[token]), {} if top is None else
                                     dict(zip(top.indices.tolist(), top.values.tolist()))))
        self._read += len(out)
        return out
