"""The path both generation routes share: validate, start generations, answer as JSON or SSE.

A request with several prompts is validated completely before anything starts, and every generation it
started is closed (cancelled and counted) on any failure, so a 4xx or 5xx never leaves work running
unanswered.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Iterator

from flask import Response, jsonify, request, stream_with_context

from ..admission import Refused
from ..controller.decide import NoEligibleMode
from ..engines.base import SamplingParams
from ..service import Generation, GenerationError
from .context import ctx
from .errors import RETRY_AFTER_S, ApiError, no_eligible_mode
from .schemas import CompletionBody, parse


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


def start_all(prompts: list[tuple[list[int], int]], req) -> list[Generation]:
    """Start one generation per validated ``(prompt_ids, max_tokens)``; if any cannot start, close the ones
    that did (their slots are freed and they are counted as cancelled) and answer the error."""
    service = ctx().service
    gens: list[Generation] = []
    try:
        for prompt_ids, max_tokens in prompts:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    prompt_logprobs=req.logprobs if isinstance(req, CompletionBody) else None)
            gens.append(service.start(prompt_ids, params, req.stop_list, req.mode, req.task))
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


def usage(gen: Generation) -> dict:
    prompt = len(gen.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": gen.completion_tokens,
            "total_tokens": prompt + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
            "energy_j": round(gen.energy_j, 6), "energy_source": ctx().service.registry.energy.source}


def respond(gens: list[Generation], req, kind: str, choice: Callable[[int, Generation, str], dict],
            piece: Callable[[str], dict] | None) -> Response:
    """JSON (one choice per generation, each naming the mode that served it) or SSE (one generation);
    ``piece`` builds a streamed completions delta (None means chat). Generations not read to the end
    (an error on another one) are closed before the error is answered."""
    streaming = False
    try:
        try:
            for gen in gens:
                gen.prime()  # retries on another mode if the first fails, before anything is sent
        except GenerationError as exc:
            raise ApiError(503, str(exc), code="mode_failed", retry_after=RETRY_AFTER_S) from None
        if req.stream:
            resp, streaming = _stream(gens[0], req, kind, piece), True
            return resp  # the stream closes its generation when it ends or the client leaves
        try:
            return _json(gens, kind, choice)
        except GenerationError as exc:
            raise ApiError(500, str(exc), code="mode_failed") from None
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


def _report(gen: Generation) -> dict:
    """The ``modeswitch`` block: the generation's mode, reason and timings, and in a cluster the replica."""
    report = gen.report()
    replica = ctx().http.replica
    if replica:
        report["replica"] = replica
    return report


def _json(gens: list[Generation], kind: str, choice: Callable[[int, Generation, str], dict]) -> Response:
    service = ctx().service
    choices = []
    for i, gen in enumerate(gens):
        text = "".join(gen.deltas())
        entry = {**choice(i, gen, text), "finish_reason": gen.finish_reason}
        if len(gens) > 1:
            entry["modeswitch"] = _report(gen)
        choices.append(entry)
    totals = [usage(g) for g in gens]
    total = {k: sum(u[k] for u in totals) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {"cached_tokens": sum(g.cached_tokens for g in gens)}
    total["energy_j"] = round(sum(g.energy_j for g in gens), 6)
    total["energy_source"] = service.registry.energy.source
    resp = jsonify({"id": response_id(kind), "object": kind, "created": int(time.time()), "model": service.model_name,
                    "choices": choices, "usage": total, "modeswitch": _report(gens[0])})
    resp.headers.update(_headers(gens))
    return resp


def _stream(gen: Generation, req, kind: str, piece) -> Response:
    headers = {**_headers([gen]), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # the request context stays open while the stream is sent: the generator reads the app context
    return Response(stream_with_context(_sse(gen, req, kind, piece)), mimetype="text/event-stream", headers=headers)


def _sse(gen: Generation, req, kind: str, piece) -> Iterator[str]:
    model = ctx().service.model_name
    rid = response_id(kind)
    created = int(time.time())
    obj = kind + ".chunk" if piece is None else kind

    def chunk(delta: dict | None, finish: str | None, **extra) -> str:
        choices = [] if delta is None else [{"index": 0, **delta, "finish_reason": finish}]
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    def wrap(text: str) -> dict:
        return {"delta": {"content": text}} if piece is None else piece(text)

    first = _report(gen)
    del first["timings"]
    head = {"delta": {"role": "assistant", "content": ""}} if piece is None else piece("")
    yield chunk(head, None, modeswitch=first)
    try:
        for delta in gen.deltas():
            yield chunk(wrap(delta), None)
    except GenerationError as exc:
        yield f"data: {json.dumps(ApiError(500, str(exc), code='mode_failed').body())}\n\n"
        yield "data: [DONE]\n\n"
        return
    yield chunk({"delta": {}} if piece is None else piece(""), gen.finish_reason, modeswitch=_report(gen))
    if req.include_usage:
        yield chunk(None, None, usage=usage(gen))
    yield "data: [DONE]\n\n"
