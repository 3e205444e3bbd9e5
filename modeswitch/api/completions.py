"""``POST /v1/completions``: OpenAI's legacy completions, with prompt scoring (echo + logprobs)."""

from __future__ import annotations

from flask import Blueprint

from ..engines.base import TokenLogprobs
from .context import ctx
from .errors import ApiError
from .generation import admitted, json_logprob, limit_tokens, respond, start_all, validated
from .openapi import Completion, Operation, route
from .schemas import CompletionBody
from .token_text import TokenTexts

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
        self._texts: dict[int, TokenTexts] = {}  # each choice's token texts, across the chunks of a stream

    def _logprobs(self, i: int, lps: list[TokenLogprobs]) -> dict | None:
        if self.req.logprobs is None:
            return None
        texts = self._texts.setdefault(i, TokenTexts(ctx().service.tokenizer.decode))
        out = generated_logprobs(lps, self.offsets[i], texts)
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


def generated_logprobs(lps: list[TokenLogprobs], offset: int, texts: TokenTexts) -> dict:
    """Generated tokens' logprobs in the legacy completions shape; offsets count from ``offset``, and ``texts`` has
    read the tokens chosen before them."""
    return openai_logprobs({"token_ids": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                            "top_logprobs": [lp.top for lp in lps]}, offset, texts)


def openai_logprobs(lp: dict, offset: int = 0, texts: TokenTexts | None = None) -> dict:
    """Engine scores (token ids) in OpenAI's legacy completions shape (token strings, offsets), each token written as
    vLLM's server writes it (:mod:`.token_text`). One position's alternatives are keyed by their text, most likely
    first: two token ids may be written alike, and the key keeps the likelier one's logprob."""
    texts = texts or TokenTexts(ctx().service.tokenizer.decode)
    tokens, top, offsets, pos = [], [], [], offset
    for token, alternatives in zip(lp["token_ids"], lp["top_logprobs"]):
        written = texts.position(token, alternatives or ())
        tokens.append(written[token])
        offsets.append(pos)
        pos += len(written[token])
        by_text: dict[str, float] | None = None
        if alternatives is not None:
            by_text = {}
            for t, logprob in alternatives.items():
                by_text.setdefault(written[t], json_logprob(logprob))
        top.append(by_text)
    return {"tokens": tokens, "token_logprobs": [json_logprob(v) for v in lp["token_logprobs"]], "top_logprobs": top,
            "text_offset": offsets}
