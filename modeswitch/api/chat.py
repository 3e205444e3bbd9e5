"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, tools (:mod:`.tools`), logprobs in
the chat shape."""

from __future__ import annotations

from flask import Blueprint

from ..engines.base import TokenLogprobs
from . import tools
from .context import ctx
from .errors import ApiError
from .generation import admitted, json_logprob, limit_tokens, respond, start_all, validated
from .hermes import ForcedCallStream, Piece, ToolCallStream
from .openapi import ChatCompletion, Operation, route
from .schemas import ChatBody
from .token_text import TokenTexts

bp = Blueprint("chat", __name__)
DEFAULT_MAX_TOKENS = 256


@route(bp, "post", "/v1/chat/completions", Operation("Chat completion (OpenAI-compatible)", ChatCompletion, ChatBody,
                                                            errors=(400, 404, 413, 429, 503), stream=True))
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
    params = req.to_sampling_params(
        len(tokenizer), forced or req.constraint(),
        "tools" if forced else "structured_outputs" if req.structured_outputs else "response_format")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    gens = start_all([(prompt_ids, limit_tokens(prompt_ids, max_tokens, DEFAULT_MAX_TOKENS))], req, params)
    return respond(gens, req, "chat.completion", _Shape(req))


class _Shape:
    """Chat choices: a message (content, or tool calls), logprobs in the chat shape. Streamed with tools, a choice
    sends its content and calls as they are written, each choice read by its own reader (:func:`tools.calls`)."""

    def __init__(self, req: ChatBody) -> None:
        self.req = req
        self._answers: dict[int, ToolCallStream | ForcedCallStream] = {}  # each choice's reader, by index
        self._texts: dict[int, TokenTexts] = {}  # each choice's token texts, across the chunks of a stream

    def _logprobs(self, i: int, lps: list[TokenLogprobs]) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(lps, self._texts.setdefault(i, TokenTexts(ctx().service.tokenizer.decode)))

    def _finish(self, gen, calls: list[dict]) -> str | None:
        """The finish reason tool calls set (None: the generation's own). As OpenAI answers: calls the model chose
        finish with "tool_calls"; a named function's call keeps the generation's "stop", and an answer cut by
        max_tokens keeps "length" (its last call's arguments may be cut)."""
        chosen = calls and self.req.chosen_tools in ("auto", "required") and gen.finish_reason == "stop"
        return "tool_calls" if chosen else None

    def choice(self, i, gen, text, lps) -> dict:
        content, calls = tools.parse(self.req, text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out = {"index": i, "message": message, "logprobs": self._logprobs(i, lps)}
        finish = self._finish(gen, calls)
        if finish:
            out["finish_reason"] = finish
        return out

    def head(self, i) -> dict:
        answer = tools.calls(self.req)
        if answer is not None:
            self._answers[i] = answer
        return {"delta": {"role": "assistant", "content": ""}, "logprobs": None}

    def delta(self, i, gen, text, lps) -> dict | None:
        answer = self._answers.get(i)
        piece = answer.feed(text) if answer else Piece(text)
        if answer and not (piece or lps):
            return None
        return {"delta": piece.delta(), "logprobs": self._logprobs(i, lps)}

    def tail(self, i, gen) -> dict:
        answer = self._answers.get(i)
        if answer:
            piece, calls = answer.finish(), answer.calls
        else:
            piece, calls = Piece(), []
        out: dict = {"delta": piece.delta() if piece else {}}
        finish = self._finish(gen, calls)
        if finish:
            out["finish_reason"] = finish
        return out


def chat_logprobs(lps: list[TokenLogprobs], texts: TokenTexts) -> dict:
    """Generated tokens' logprobs in the chat shape: token text (as vLLM's server writes it, :mod:`.token_text`; ``texts``
    has read the tokens chosen before them), its UTF-8 bytes, and the alternatives."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode())}

    content = []
    for lp in lps:
        written = texts.position(lp.token, lp.top)
        content.append({**entry(written[lp.token], lp.logprob),
                        "top_logprobs": [entry(written[t], v) for t, v in lp.top.items()]})
    return {"content": content}
