"""The path both generation routes share: validate, start generations, answer as JSON or SSE.

A request with several prompts or choices (``n``) is validated completely before anything starts, its choices
beyond the modes' queues wait for its own earlier ones (``Service.start_behind``), and every generation it started
is closed (cancelled and counted) on any failure or when its client leaves, so a 4xx or 5xx never leaves work
running unanswered. A route says how its choices are written through a :class:`Shape`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Iterator, Protocol

from flask import Response, jsonify, request, stream_with_context

from ..controller.decide import NoEligibleMode
from ..engines.base import TokenLogprobs
from ..sampling_params import SamplingParams
from ..serving.admission import Refused
from ..serving.service import Generation, GenerationError
from .context import ctx
from .errors import RETRY_AFTER_S, ApiError, no_eligible_mode
from .schemas import parse


def body() -> Any:
    data = request.get_json(silent=True, force=True)
    if data is None:
        raise ApiError(400, "the request body is not valid JSON")
    return data


def validated(schema):
    """The request body parsed with ``schema``, its model served here and its pinned mode known."""
    service = ctx().service
    req = parse(schema, body())
    if req.model is not None and req.model != service.model_name:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves {service.model_name!r}",
                       param="model", code="model_not_found")
    if req.mode is not None and req.mode not in service.registry.modes:
        raise ApiError(400, f"unknown mode {req.mode!r}; modes: {', '.join(service.registry.modes)}", param="mode")
    return req


def limit_tokens(prompt_ids: list[int], max_tokens: int | None, default: int) -> int:
    """``max_tokens`` checked against the context (or the default, capped to what is left of it)."""
    ctx_len = ctx().service.registry.context_length
    if len(prompt_ids) >= ctx_len:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {ctx_len}",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return min(default, ctx_len - len(prompt_ids))
    if len(prompt_ids) + max_tokens > ctx_len:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds this "
                       f"model's context of {ctx_len} tokens", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def start_all(prompts: list[tuple[list[int], int]], req, params: SamplingParams) -> list[Generation]:
    """Start ``req.n`` generations per validated ``(prompt_ids, max_tokens)`` (choice ``i`` of a seeded request
    with seed + ``i``, so the choices differ and each is reproducible); if any cannot start, close the ones that
    did (their slots are freed and they are counted as cancelled) and answer the error."""
    service = ctx().service
    gens: list[Generation] = []
    try:
        for prompt_ids, max_tokens in prompts:
            if params.min_tokens > max_tokens:
                raise ApiError(400, f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})",
                               param="min_tokens")
            for i in range(req.n):
                seed = None if params.seed is None else params.seed + i
                choice = replace(params, max_tokens=max_tokens, seed=seed)
                gens.append(service.start_behind(gens, prompt_ids, choice, req.stop_list, req.mode, req.task))
    except NoEligibleMode as exc:
        close_all(gens)
        raise no_eligible_mode(exc, pinned=req.mode is not None) from None
    except BaseException:
        close_all(gens)
        raise
    return gens


def close_all(gens: list[Generation]) -> None:
    for gen in gens:
        gen.close()


def admitted(handler: Callable[[], Response]) -> Response:
    """Run a generation handler under an admission ticket held until the response is fully sent."""
    admission = ctx().admission
    client = request.headers.get("Authorization") or request.remote_addr or "unknown"
    try:
        admission.enter(client)
    except Refused as exc:
        raise ApiError(exc.status, str(exc), code=exc.code, retry_after=RETRY_AFTER_S) from None
    try:
        resp = handler()
    except BaseException:
        admission.leave(client)
        raise
    resp.call_on_close(lambda: admission.leave(client))
    return resp


def total_usage(gens: list[Generation], n: int) -> dict:
    """The response's ``usage``: every choice's tokens and energy; each prompt counts once, however many choices
    (``n``, consecutive in ``gens``) it has, as vLLM counts it."""
    prompt = sum(len(g.prompt_ids) for g in gens[::n])
    completion = sum(g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in gens)},
            "energy_j": round(sum(g.energy_j for g in gens), 6), "energy_source": ctx().service.registry.energy.source}


#: what a logprob of -inf (a token the grammar forbids) is written as: JSON has no infinity; vLLM's server writes this
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float | None) -> float | None:
    """A logprob as the OpenAI shapes carry it (None stays None: a prompt's first token has no logprob)."""
    return None if value is None else max(value, LOGPROB_FLOOR)


def choice_usage(gens: list[Generation], i: int | None, n: int) -> dict:
    """vLLM's continuous usage stats: the tokens of choice ``i`` so far; ``i`` None (a chunk of every choice,
    before any is generated): each prompt once (``n`` consecutive choices share one), nothing generated."""
    if i is None:
        prompt, completion = sum(len(g.prompt_ids) for g in gens[::n]), 0
    else:
        prompt, completion = len(gens[i].prompt_ids), gens[i].completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Shape(Protocol):
    """How one route writes a choice: whole (JSON), or as stream deltas. ``lps``: the token logprobs of the
    text in hand (empty unless the request asked for them)."""

    def choice(self, i: int, gen: Generation, text: str, lps: list[TokenLogprobs]) -> dict:
        """A JSON choice (``finish_reason`` is added unless it sets one)."""

    def head(self, i: int) -> dict:
        """A stream's first delta of choice ``i``."""

    def delta(self, i: int, gen: Generation, text: str, lps: list[TokenLogprobs]) -> dict | None:
        """A stream delta, or None while the choice holds its text back (its tail writes it)."""

    def tail(self, i: int, gen: Generation) -> dict:
        """The stream's last delta of choice ``i`` (``finish_reason`` is added unless it sets one)."""


def respond(gens: list[Generation], req, kind: str, shape: Shape) -> Response:
    """JSON (one choice per generation, each naming the mode that served it) or SSE. Generations not read to the
    end (an error on another one, a client gone) are closed before the error is answered."""
    streaming = False
    try:
        try:
            for gen in gens:
                gen.prime()  # retries on another mode if the first fails, before anything is sent
        except GenerationError as exc:
            raise ApiError(503, str(exc), code="mode_failed", retry_after=RETRY_AFTER_S) from None
        if req.stream:
            for gen in gens:
                gen.streamed = True
            resp, streaming = _stream(gens, req, kind, shape), True
            return resp  # the stream closes its generations when it ends or the client leaves
        try:
            return _json(gens, req, kind, shape)
        except GenerationError as exc:  # its mode failed it, and no other could take it over: try again later
            raise ApiError(503, str(exc), code="mode_failed", retry_after=RETRY_AFTER_S) from None
    finally:
        if not streaming:
            close_all(gens)


def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]


def _headers(gens: list[Generation]) -> dict[str, str]:
    headers = {"X-ModeSwitch-Mode": ",".join(dict.fromkeys(g.mode for g in gens))}
    replica = ctx().http.replica
    if replica:
        headers["X-ModeSwitch-Replica"] = replica
    return headers


def _report(gen: Generation, req) -> dict:
    """The ``modeswitch`` block: the generation's mode, reason and timings, the request's options it honoured and
    those without effect, and in a cluster the replica."""
    report = {**gen.report(), **req.option_effects()}
    replica = ctx().http.replica
    if replica:
        report["replica"] = replica
    return report


def _json(gens: list[Generation], req, kind: str, shape: Shape) -> Response:
    service = ctx().service
    choices = []
    for i, gen in enumerate(gens):
        for _ in gen.deltas():  # read to the end; a failed attempt's text is replaced by its retry's
            pass
        entry = shape.choice(i, gen, gen.text, gen.take_logprobs())
        entry.setdefault("finish_reason", gen.finish_reason)
        if len(gens) > 1:
            entry["modeswitch"] = _report(gen, req)
        choices.append(entry)
    resp = jsonify({"id": response_id(kind), "object": kind, "created": int(time.time()), "model": service.model_name,
                    "choices": choices, "usage": total_usage(gens, req.n), "modeswitch": _report(gens[0], req)})
    resp.headers.update(_headers(gens))
    return resp


def _stream(gens: list[Generation], req, kind: str, shape: Shape) -> Response:
    headers = {**_headers(gens), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # the request context stays open while the stream is sent: the generator reads the app context
    return Response(stream_with_context(_sse(gens, req, kind, shape)), mimetype="text/event-stream", headers=headers)


def _interleaved(gens: list[Generation]) -> Iterator[tuple[int, str | None, list[TokenLogprobs]]]:
    """``(choice, text, logprobs)`` as each generation produces them, then ``(choice, None, rest)`` when it ends;
    raises the first :class:`GenerationError`. One generation is read on this thread; several each on a thread of
    their own, so that no choice waits for another."""
    if len(gens) == 1:
        for text in gens[0].deltas():
            yield 0, text, gens[0].take_logprobs()
        yield 0, None, gens[0].take_logprobs()
        return
    out: queue.Queue = queue.Queue()

    def pump(i: int, gen: Generation) -> None:
        try:
            for text in gen.deltas():
                out.put((i, text, gen.take_logprobs()))
            out.put((i, None, gen.take_logprobs()))
        except BaseException as exc:  # handed to the reader, which answers it
            out.put((i, exc, []))

    for i, gen in enumerate(gens):
        threading.Thread(target=pump, args=(i, gen), name=f"stream-choice-{i}", daemon=True).start()
    ended = 0
    while ended < len(gens):
        i, text, lps = out.get()
        if isinstance(text, BaseException):
            raise text
        ended += text is None
        yield i, text, lps


def _sse(gens: list[Generation], req, kind: str, shape: Shape) -> Iterator[str]:
    model = ctx().service.model_name
    rid = response_id(kind)
    created = int(time.time())
    obj = kind + ".chunk" if kind == "chat.completion" else kind

    def chunk(choices: list[dict], **extra) -> str:
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
        if req.continuous_usage and choices:
            payload["usage"] = choice_usage(gens, choices[0]["index"] if len(choices) == 1 else None, req.n)
        return f"data: {json.dumps(payload)}\n\n"

    try:
        first = _report(gens[0], req)
        del first["timings"]
        yield chunk([{"index": i, **shape.head(i), "finish_reason": None} for i in range(len(gens))], modeswitch=first)
        try:
            for i, text, lps in _interleaved(gens):
                # at the end (text None), the logprobs of tokens whose text never came out (held back, then cut
                # by a stop string) still go out
                delta = shape.delta(i, gens[i], text or "", lps) if text is not None or lps else None
                if delta is not None:
                    yield chunk([{"index": i, **delta, "finish_reason": None}])
                if text is not None:
                    continue
                last = shape.tail(i, gens[i])
                last.setdefault("finish_reason", gens[i].finish_reason)
                yield chunk([{"index": i, **last}], modeswitch=_report(gens[i], req))
        except GenerationError as exc:
            yield f"data: {json.dumps(ApiError(500, str(exc), code='mode_failed').body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if req.include_usage:
            yield chunk([], usage=total_usage(gens, req.n))
        yield "data: [DONE]\n\n"
    finally:
        close_all(gens)
