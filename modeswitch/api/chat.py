"""``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

from __future__ import annotations

from flask import Blueprint

from .context import ctx
from .errors import ApiError
from .generation import admitted, limit_tokens, respond, start_all, validated
from .schemas import ChatBody

bp = Blueprint("chat", __name__)
DEFAULT_MAX_TOKENS = 256


@bp.post("/v1/chat/completions")
def chat_completions():
    return admitted(_chat_completions)


def _chat_completions():
    req = validated(ChatBody)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in req.messages]
    try:
        prompt_ids = list(ctx().service.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    except Exception as exc:  # templates may reject role orders
        raise ApiError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    gens = start_all([(prompt_ids, limit_tokens(prompt_ids, max_tokens, DEFAULT_MAX_TOKENS))], req)

    def choice(i, gen, text: str) -> dict:
        return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None}

    return respond(gens, req, "chat.completion", choice, None)
