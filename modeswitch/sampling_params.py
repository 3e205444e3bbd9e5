"""What a request asks of decoding, in one type the API builds and every engine reads (as vLLM's ``SamplingParams``).

The HTTP layer turns a validated body into :class:`SamplingParams` (``api.schemas``' ``to_sampling_params``);
engines, the controller's capability gate and the fake engine read it. A new request option is a field here, a
field of the request schema with the same name, and the engines that honour it (each declares the
:data:`OPTIONS` it honours); nothing between them maps it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass


#: Every request option an engine may or may not honour, by the name of the OpenAI / vLLM field that asks for it.
#: An engine declares the ones it honours (:attr:`Engine.capabilities`); a request needs the ones it sets
#: (:attr:`SamplingParams.needs`), and the controller never sends it to a mode that lacks one.
OPTIONS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "structured_outputs", "prompt_logprobs",
})


@dataclass(frozen=True)
class Constraint:
    """Output constrained to a grammar (what ``response_format``, ``structured_outputs`` and forced tool calls
    ask for). ``kind``: ``json`` (``spec`` is a JSON schema, as JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (``spec`` is a JSON list of the allowed strings) or ``grammar`` (EBNF)."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """What the engine needs to know about decoding. ``temperature == 0`` means greedy.

    The fields mean what vLLM's ``SamplingParams`` fields of the same names mean (penalties apply as vLLM applies
    them: presence and frequency over the generated tokens, repetition over prompt and generated tokens)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias added to its logit)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    #: tokens that end the generation besides the model's end-of-sequence tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: each generated token's logprob, and this many most likely alternatives at its position
    logprobs: int | None = None
    constraint: Constraint | None = None
    #: score the prompt instead of generating: per-token logprobs with this many alternatives, plus one
    #: greedy next token (what OpenAI's echo + logprobs + max_tokens=1 returns; lm-eval scores with it)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs(self) -> frozenset[str]:
        """The :data:`OPTIONS` this request sets: what a mode must honour to serve it. Sampling settings count
        only when sampling (a greedy request decodes the same whatever they are)."""
        sampled = not self.greedy and {"temperature": True, "top_p": self.top_p < 1.0, "top_k": self.top_k > 0,
                                       "min_p": self.min_p > 0.0, "seed": self.seed is not None}
        set_ = {"presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
                "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": bool(self.logit_bias),
                "min_tokens": self.min_tokens > 0, "stop_token_ids": bool(self.stop_token_ids),
                "ignore_eos": self.ignore_eos, "logprobs": self.logprobs is not None,
                "structured_outputs": self.constraint is not None, "prompt_logprobs": self.prompt_logprobs is not None,
                **(sampled or {})}
        return frozenset(name for name, on in set_.items() if on)
