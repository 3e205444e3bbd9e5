"""Flask routes: OpenAI-style completions and chat (JSON or SSE), models, modes, health, policy admin."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any, Callable, Iterator

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException

from ..admission import Admission, Refused
from ..controller.decide import NoEligibleMode
from ..engines.base import SamplingParams
from ..service import Generation, GenerationError, Service
from ..yamlconf import ConfigError
from .errors import ApiError
from .openapi import PolicyReload, build_spec
from .schemas import ChatBody, CompletionBody, parse

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20
DEFAULT_CHAT_MAX_TOKENS = 256
RETRY_AFTER_S = 1


def create_app(service: Service, admission: Admission | None = None, api_key: str | None = None) -> Flask:
    """The HTTP app. ``api_key``: required as a bearer token on every route but /health."""
    app = Flask("modeswitch")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.sort_keys = False
    started = int(time.time())
    admission = admission or Admission(per_client=0)
    app.extensions["modeswitch.admission"] = admission

    @app.before_request
    def _authenticate():
        if not api_key or request.path == "/health":
            return None
        given = request.headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())):
            return ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                            code="invalid_api_key").response()
        return None

    def client_id() -> str:
        return request.headers.get("Authorization") or request.remote_addr or "unknown"

    def admitted(handler: Callable[[], Response]) -> Response:
        """Run a generation handler under an admission ticket held until the response is fully sent."""
        client = client_id()
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

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        if exc.status in (429, 503):
            service.metrics.rejected.labels(exc.code or str(exc.status)).inc()
        return exc.response()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        message = {404: "no such route", 405: "method not allowed", 413: f"request body over {MAX_BODY_BYTES} bytes"}
        resp = ApiError(exc.code or 500, message.get(exc.code, exc.description or exc.name)).response()
        allow = dict(exc.get_headers()).get("Allow")
        if allow:  # 405 must say which methods the route has
            resp.headers["Allow"] = allow
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {exc.__class__.__name__}").response()

    def body() -> Any:
        data = request.get_json(silent=True, force=True)
        if data is None:
            raise ApiError(400, "the request body is not valid JSON")
        return data

    def validated(schema):
        """The request body parsed with ``schema``, its model served here and its pinned mode known."""
        req = parse(schema, body())
        if req.model is not None and req.model != service.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {service.model_name!r}",
                           param="model", code="model_not_found")
        if req.mode is not None and req.mode not in service.pool.modes:
            raise ApiError(400, f"unknown mode {req.mode!r}; modes: {', '.join(service.pool.modes)}", param="mode")
        return req

    def limit_tokens(prompt_ids: list[int], max_tokens: int | None, default: int) -> int:
        ctx = service.pool.context_length
        if len(prompt_ids) >= ctx:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {ctx}",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            return min(default, ctx - len(prompt_ids))
        if len(prompt_ids) + max_tokens > ctx:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds this "
                           f"model's context of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def start(prompt_ids: list[int], req, max_tokens: int) -> Generation:
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p)
        try:
            return service.start(prompt_ids, params, req.stop_list, req.mode)
        except NoEligibleMode as exc:
            if req.mode is not None and exc.code == "unavailable":
                raise ApiError(400, str(exc), param="mode", code="mode_unavailable") from None
            codes = {"saturated": "overloaded", "quarantined": "mode_quarantined"}
            raise ApiError(503, str(exc), code=codes.get(exc.code, "no_eligible_mode"),
                           retry_after=RETRY_AFTER_S) from None

    # ------------------------------------------------------------------ generation routes
    @app.post("/v1/completions")
    def completions():
        return admitted(_completions)

    def _completions():
        req = validated(CompletionBody)
        prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else req.prompt
        if isinstance(prompt, str):
            prompt_ids = service.tokenizer(prompt).input_ids
        else:
            vocab = len(service.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        gen = start(prompt_ids, req, limit_tokens(prompt_ids, req.max_tokens, 16))
        return respond(gen, req, "text_completion", lambda delta: {"text": delta, "logprobs": None})

    @app.post("/v1/chat/completions")
    def chat_completions():
        return admitted(_chat_completions)

    def _chat_completions():
        req = validated(ChatBody)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in req.messages]
        try:
            prompt_ids = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=True)["input_ids"]
        except Exception as exc:  # templates may reject role orders
            raise ApiError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        gen = start(list(prompt_ids), req, limit_tokens(list(prompt_ids), max_tokens, DEFAULT_CHAT_MAX_TOKENS))
        return respond(gen, req, "chat.completion", None)

    def respond(gen: Generation, req, kind: str, piece: Callable[[str], dict] | None) -> Response:
        """Non-streaming JSON or SSE; ``piece`` builds a completions choice (None means chat)."""
        rid = ("chatcmpl-" if piece is None else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        try:
            gen.prime()  # retries on another mode if the first fails, before anything is sent
        except GenerationError as exc:
            raise ApiError(503, str(exc), code="mode_failed", retry_after=RETRY_AFTER_S) from None
        headers = {"X-ModeSwitch-Mode": gen.mode}
        if req.stream:
            stream = sse(gen, req, rid, created, kind, piece)
            return Response(stream, mimetype="text/event-stream",
                            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text = "".join(gen.deltas())
        except GenerationError as exc:
            raise ApiError(500, str(exc), code="mode_failed") from None
        if piece is None:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": gen.finish_reason}
        else:
            choice = {"index": 0, **piece(text), "finish_reason": gen.finish_reason}
        resp = jsonify({"id": rid, "object": kind, "created": created, "model": service.model_name,
                        "choices": [choice], "usage": usage(gen), "modeswitch": gen.report()})
        resp.headers.update(headers)
        return resp

    def usage(gen: Generation) -> dict:
        prompt = len(gen.request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": gen.completion_tokens,
                "total_tokens": prompt + gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}

    def sse(gen: Generation, req, rid: str, created: int, kind: str, piece) -> Iterator[str]:
        obj = kind + ".chunk" if piece is None else kind

        def chunk(delta: dict | None, finish: str | None, **extra) -> str:
            choices = [] if delta is None else [{"index": 0, **delta, "finish_reason": finish}]
            payload = {"id": rid, "object": obj, "created": created, "model": service.model_name, "choices": choices,
                       **extra}
            return f"data: {json.dumps(payload)}\n\n"

        def wrap(text: str) -> dict:
            return {"delta": {"content": text}} if piece is None else piece(text)

        first = gen.report()
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
        yield chunk({"delta": {}} if piece is None else piece(""), gen.finish_reason, modeswitch=gen.report())
        if req.include_usage:
            yield chunk(None, None, usage=usage(gen))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ information routes
    @app.get("/health")
    def health():
        available = len(service.pool.available())
        status = 200 if available else 503
        return jsonify({"status": "ok" if available else "no mode available", "model": service.model_name,
                        "modes_available": available, "in_flight": admission.active,
                        "draining": admission.draining}), status

    @app.get("/metrics")
    def metrics():
        return Response(service.metrics.render(), mimetype=CONTENT_TYPE_LATEST)

    spec = build_spec(auth=bool(api_key))

    @app.get("/openapi.json")
    def openapi():
        return jsonify(spec)

    @app.get("/v1/models")
    def models():
        return jsonify({"object": "list", "data": [{"id": service.model_name, "object": "model", "created": started,
                                                    "owned_by": "modeswitch",
                                                    "max_model_len": service.pool.context_length}]})

    @app.get("/v1/modes")
    def modes():
        policy = service.controller.policy
        return jsonify({"modes": service.pool.describe(), "policy": {"name": policy.name, "source": policy.source},
                        "memory": service.pool.memory()})

    # ------------------------------------------------------------------ admin
    @app.get("/admin/policy")
    def get_policy():
        p = service.controller.policy
        return jsonify({"name": p.name, "source": p.source, "description": p.description,
                        "rules": [{"name": r.name, "use": list(r.use),
                                   "when": [f"{c.feature} {c.op} {c.value:g}" for c in r.conditions]} for r in p.rules],
                        "default": list(p.default), "fallback": list(p.fallback)})

    @app.post("/admin/policy")
    def reload_policy():
        data = request.get_json(silent=True, force=True) if request.data else {}
        if data is None:
            raise ApiError(400, 'body must be empty or {"path": "policies/NAME.yaml"}', param="path")
        reload = parse(PolicyReload, data)
        try:
            policy = service.controller.reload(reload.path or None)
        except ConfigError as exc:
            raise ApiError(400, f"policy not changed: {exc}", param="path", code="invalid_policy") from None
        log.info("policy reloaded: %s from %s", policy.name, policy.source)
        return jsonify({"name": policy.name, "source": policy.source, "rules": len(policy.rules)})

    return app
