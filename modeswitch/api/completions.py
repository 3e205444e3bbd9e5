"""``POST /v1/completions``: OpenAI's legacy completions, with prompt scoring (echo + logprobs)."""

from __future__ import annotations

from flask import Blueprint

from .context import ctx
from .errors import ApiError
from .generation import admitted, limit_tokens, respond, start_all, validated
from .schemas import CompletionBody

bp = Blueprint("completions", __name__)
DEFAULT_MAX_TOKENS = 16


@bp.post("/v1/completions")
def completions():
    return admitted(_completions)


def _completions():
    req = validated(CompletionBody)
    tokenizer = ctx().service.tokenizer
    if req.stream and len(req.prompts) > 1:
        raise ApiError(400, "streaming takes one prompt per request", param="prompt")
    vocab = len(tokenizer)
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
    gens = start_all(planned, req)

    def choice(i, gen, text: str) -> dict:
        return {"index": i, "text": echoes[i] + text,
                "logprobs": openai_logprobs(gen.logprobs) if gen.logprobs else None}

    return respond(gens, req, "text_completion", choice, lambda text: {"text": text, "logprobs": None})


def openai_logprobs(lp: dict) -> dict:
    """Engine scores (token ids) in OpenAI's legacy completions shape (token strings, offsets)."""
    decode = ctx().service.tokenizer.decode
    tokens = [decode([t]) for t in lp["token_ids"]]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [None if d is None else {decode([t]): v for t, v in d.items()} for d in lp["top_logprobs"]]
    return {"tokens": tokens, "token_logprobs": lp["token_logprobs"], "top_logprobs": top, "text_offset": offsets}
