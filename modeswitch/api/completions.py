"""``POST /v1/completions``: OpenAI's legacy completions, with prompt scoring (echo + logprobs)."""

from __future__ import annotations

from flask import Blueprint

from ..engines.base import TokenLogprobs
from .context import ctx
from .errors import ApiError
from .generation import admitted, json_logprob, limit_tokens, respond, start_all, validated
from .openapi import Completion, Operation, route
from .schemas import CompletionBody

bp = Blueprint("completions", __name__)
DEFAULT_MAX_TOKENS = 16


@route(bp, "post", "/v1/completions", Operation("Text completion (OpenAI-compatible)", Completion, CompletionBody,
                                                       errors=(400, 404, 413, 429, 503), stream=True))
def completions():
    return admitted(_completions)


def _completions():
    req = validated(CompletionBody)
    tokenizer = ctx().service.tokenizer
    vocab = len(tokenizer)
    constraint = req.constraint()
    params = req.to_sampling_params(vocab, constraint,
                                    "structured_outputs" if req.structured_outputs else "response_format")
    planned, echoes = [], []
    for prompt in req.prompts:  # every prompt is checked before any generation starts
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt).input_ids
        elif any(t < 0 or t >= vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        planned.append((prompt_ids, limit_tokens(prompt_ids, req.max_tokens, DEFAULT_MAX_TOKENS)))
        echoes.append((prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) if req.echo else "")
    gens = start_all(planned, req, params)
    return respond(gens, req, "text_completion", _Shape(req, [e for e in echoes for _ in range(req.n)]))


class _Shape:
    """Completions choices: text (after the echoed prompt), and logprobs in the legacy shape."""

    def __init__(self, req: CompletionBody, echoes: list[str]) -> None:
        self.req = req
        self.echoes = echoes
        self.offsets = [len(e) for e in echoes]  # text_offset of the next streamed token, per choice

    def _logprobs(self, i: int, lps: list[TokenLogprobs]) -> dict | None:
        if self.req.logprobs is None:
            return None
        out = generated_logprobs(lps, self.offsets[i])
        self.offsets[i] += sum(len(t) for t in out["tokens"])
        return out

    def choice(self, i, gen, text, lps) -> dict:
        logprobs = openai_logprobs(gen.logprobs) if self.req.scoring else self._logprobs(i, lps)
        return {"index": i, "text": self.echoes[i] + text, "logprobs": logprobs}

    def head(self, i) -> dict:
        return {"text": self.echoes[i], "logprobs": None}

    def delta(self, i, gen, text, lps) -> dict:
        return {"text": text, "logprobs": self._logprobs(i, lps)}

    def tail(self, i, gen) -> dict:
        return {"text": "", "logprobs": None}


def generated_logprobs(lps: list[TokenLogprobs], offset: int) -> dict:
    """Generated tokens' logprobs in the legacy completions shape; offsets count from ``offset``."""
    return openai_logprobs({"token_ids": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                            "top_logprobs": [lp.top for lp in lps]}, offset)


def _by_text(top: dict[int, float], decode) -> dict[str, float]:
    """One position's alternatives keyed by their text, most likely first. Two token ids may decode to the same
    text: the key keeps the likelier one's logprob (the later, lower one would otherwise overwrite it)."""
    out: dict[str, float] = {}
    for token, logprob in top.items():
        out.setdefault(decode([token]), json_logprob(logprob))
    return out


def openai_logprobs(lp: dict, offset: int = 0) -> dict:
    """Engine scores (token ids) in OpenAI's legacy completions shape (token strings, offsets)."""
    decode = ctx().service.tokenizer.decode
    tokens = [decode([t]) for t in lp["token_ids"]]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [None if d is None else _by_text(d, decode) for d in lp["top_logprobs"]]
    return {"tokens": tokens, "token_logprobs": [json_logprob(v) for v in lp["token_logprobs"]], "top_logprobs": top,
            "text_offset": offsets}
