"""Cheap per-request features: what the controller knows when it picks a mode.

Everything here must cost microseconds: counts the request already carries, a radix-tree walk for the
prefix match, counters the engines keep, and one memory reading.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

#: Feature names a policy rule may test, with their meaning (policies are validated against this).
FEATURE_DOCS = {
    "prompt_tokens": "tokens in the prompt",
    "max_tokens": "tokens the request may generate (its expected output length)",
    "prefix_match_tokens": "leading prompt tokens whose KV a prefix-cache mode already holds",
    "prefix_match_ratio": "prefix_match_tokens / prompt_tokens",
    "queue_depth": "requests in flight (queued or running) over all modes",
    "memory_headroom": "free fraction of the device memory the models live in (0..1)",
    "memory_free_gb": "free device memory in GiB",
    "greedy": "1 when the request decodes greedily (temperature 0), else 0",
    "scoring": "1 when the request asks for prompt logprobs (echo + logprobs), else 0",
    "prefix_cache_batched": "1 when a mode that reads a prefix cache batches its requests with others (vLLM "
                            "engines: reading the cache costs a request nothing), 0 when it serves one at a time",
    "prompt_repeat": "share of the prompt's last 256 tokens' trigrams that occur earlier in them (0..1)",
    "draft_tokens_per_step": "tokens per target step prompt-lookup drafting is predicted to yield for this request "
                             "(1: no gain; learned from earlier requests of its kind, controller/speculation.py)",
    "drafts_per_step": "tokens prompt-lookup drafting is predicted to draft a target step for this request, each "
                       "verified by the step whether accepted or not (null: no request of its kind seen yet)",
    "speculation_gain": "the request's predicted speed-up on the best speculative mode over the plain batch on the "
                        "same weights, at the current load (0 when no speculative mode is resident; null, not "
                        "computed, where no rule of the policy tests it)",
}


@dataclass(frozen=True, slots=True)
class Kind:
    """A kind of request, as drafting sees it: what the speculation model learns acceptance by and what a drafting
    stream counts the requests it served by (a policy that explores reads those counts)."""

    task: str
    length: int   # log2 bucket of the prompt tokens
    repeat: int   # prompt_repeat in quarters

    @classmethod
    def of(cls, task: str, prompt_tokens: int, repeat: float) -> "Kind":
        return cls(task, max(prompt_tokens, 1).bit_length(), min(int(repeat * 4), 3))

    @property
    def name(self) -> str:
        """As ``/v1/modes`` and the costs file show it: "general/2^8/repeat2"."""
        return f"{self.task}/2^{self.length}/repeat{self.repeat}"


@dataclass(frozen=True, slots=True)
class Features:
    prompt_tokens: int
    max_tokens: int
    prefix_match_tokens: int
    prefix_match_ratio: float
    queue_depth: int
    memory_headroom: float
    memory_free_gb: float
    greedy: int
    #: per prefix-cache mode, how many leading prompt tokens that mode's store holds (rules may prefer the holder)
    prefix_match_by_mode: Mapping[str, int] = field(default_factory=dict)
    #: the request's task family hint, for the quality gate ("general" unless the request says)
    task: str = "general"
    #: 1 when the request asks for prompt logprobs (echo + logprobs) instead of free generation
    scoring: int = 0
    #: requests in flight per mode (the queue in front of a request in that mode; batch occupancy for CB)
    in_flight_by_mode: Mapping[str, int] = field(default_factory=dict)
    #: per mode, the prompt tokens its requests in flight still have to compute (those without a first token
    #: yet): the prefill a new request on the same engine lane waits behind
    prefilling_by_mode: Mapping[str, int] = field(default_factory=dict)
    #: per mode, its requests in flight each counted by the share of this request's tokens it may still be generating
    #: beside it (min(its tokens left, this max_tokens) / this max_tokens): the mean load this request's steps would
    #: meet from the requests there now (a burst's requests near their end leave soon); None: not known, every
    #: request in flight counted whole
    decode_overlap_by_mode: Mapping[str, float] | None = None
    #: 1 when a prefix-cache mode runs requests in a batch (see FEATURE_DOCS)
    prefix_cache_batched: int = 0
    #: what drafting is expected to do for this request (see FEATURE_DOCS)
    prompt_repeat: float = 0.0
    draft_tokens_per_step: float = 1.0
    drafts_per_step: float | None = None
    speculation_gain: float | None = None
    #: the request options it sets, which the mode must honour (``SamplingParams.needs``; the capability gate)
    needs: tuple[str, ...] = ()

    @property
    def kind(self) -> Kind:
        """This request's :class:`Kind`."""
        return Kind.of(self.task, self.prompt_tokens, self.prompt_repeat)

    def as_dict(self) -> dict:
        return asdict(self)
