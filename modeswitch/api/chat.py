"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, tools (:mod:`.tools`), logprobs in
the chat shape."""

from __future__ import annotations

from flask import Blueprint

from ..engines.base import TokenLogprobs
from . import tools
from .context import ctx
from .errors import ApiError
from .generation import admitted, decoding, json_logprob, limit_tokens, respond, start_all, validated
from .schemas import ChatBody

bp = Blueprint("chat", __name__)
DEFAULT_MAX_TOKENS = 256


@bp.post("/v1/chat/completions")
def chat_completions():
    return admitted(_chat_completions)


def _chat_completions():
    req = validated(ChatBody)
    tokenizer = ctx().service.tokenizer
    messages, extra = tools.messages(req, tools.template_renders_tools(tokenizer))
    try:
        prompt_ids = list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **extra)["input_ids"])
    except Exception as exc:  # templates may reject role orders
        raise ApiError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from None
    forced = tools.constraint(req)
    params = decoding(req, forced or req.constraint(),
                      "tools" if forced else "structured_outputs" if req.structured_outputs else "response_format",
                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    gens = start_all([(prompt_ids, limit_tokens(prompt_ids, max_tokens, DEFAULT_MAX_TOKENS))], req, params)
    return respond(gens, req, "chat.completion", _Shape(req))


class _Shape:
    """Chat choices: a message (content, or tool calls), logprobs in the chat shape. A choice that may become tool
    calls is held back while streamed and sent whole at its end (its text must be complete to parse)."""

    def __init__(self, req: ChatBody) -> None:
        self.req = req
        self.calls = req.chosen_tools != "none"

    def _logprobs(self, lps: list[TokenLogprobs]) -> dict | None:
        return chat_logprobs(lps) if self.req.logprobs else None

    def _answer(self, text: str) -> tuple[dict, str | None]:
        """The message's fields and the finish reason tool calls set (None: the generation's own)."""
        if not self.calls:
            return {"content": text}, None
        content, calls = tools.parse(self.req, text)
        if not calls:
            return {"content": content}, None
        # as OpenAI answers: a named function's call finishes with "stop", a call the model chose with "tool_calls"
        return {"content": content, "tool_calls": calls}, "tool_calls" if self.req.chosen_tools in ("auto", "required") \
            else "stop"

    def choice(self, i, gen, text, lps) -> dict:
        fields, finish = self._answer(text)
        out = {"index": i, "message": {"role": "assistant", **fields}, "logprobs": self._logprobs(lps)}
        if finish:
            out["finish_reason"] = finish
        return out

    def head(self, i) -> dict:
        return {"delta": {"role": "assistant", "content": ""}, "logprobs": None}

    def delta(self, i, gen, text, lps) -> dict | None:
        if self.calls:
            return None
        return {"delta": {"content": text}, "logprobs": self._logprobs(lps)}

    def tail(self, i, gen) -> dict:
        if not self.calls:
            return {"delta": {}}
        fields, finish = self._answer(gen.text)
        if "tool_calls" in fields:
            fields["tool_calls"] = [{"index": j, **call} for j, call in enumerate(fields["tool_calls"])]
        out: dict = {"delta": {k: v for k, v in fields.items() if v is not None}}
        if finish:
            out["finish_reason"] = finish
        return out


def chat_logprobs(lps: list[TokenLogprobs]) -> dict:
    """Generated tokens' logprobs in the chat shape: token text, its UTF-8 bytes, and the alternatives."""
    decode = ctx().service.tokenizer.decode

    def entry(token: int, logprob: float) -> dict:
        text = decode([token])
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]}
                        for lp in lps]}
