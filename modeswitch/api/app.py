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
from ..controller.quality import judge
from ..controller.verdicts import Code
from ..engines.base import SamplingParams
from ..service import Generation, GenerationError, Service
from ..yamlconf import ConfigError
from .errors import ApiError
from .openapi import PolicyReload, build_spec
from .schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, parse

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
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                prompt_logprobs=req.logprobs if isinstance(req, CompletionBody) else None)
        try:
            return service.start(prompt_ids, params, req.stop_list, req.mode, req.task)
        except NoEligibleMode as exc:
            if req.mode is not None and not exc.code.transient:
                raise ApiError(400, str(exc), param="mode", code="mode_unavailable") from None
            codes = {Code.SATURATED: "overloaded", Code.QUARANTINED: "mode_quarantined",
                     Code.MEMORY: "insufficient_memory"}
            raise ApiError(503, str(exc), code=codes.get(exc.code, "no_eligible_mode"),
                           retry_after=RETRY_AFTER_S) from None

    # ------------------------------------------------------------------ generation routes
    @app.post("/v1/completions")
    def completions():
        return admitted(_completions)

    def _completions():
        req = validated(CompletionBody)
        prompts = req.prompts
        if req.stream and len(prompts) > 1:
            raise ApiError(400, "streaming takes one prompt per request", param="prompt")
        vocab = len(service.tokenizer)
        gens, echoes = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt_ids = service.tokenizer(prompt).input_ids
            elif any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            else:
                prompt_ids = list(prompt)
            if not prompt_ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            max_tokens = limit_tokens(prompt_ids, req.max_tokens, 16)
            echoes.append((prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt_ids))
                          if req.echo else "")
            gens.append(start(prompt_ids, req, max_tokens))

        def choice(i: int, gen: Generation, text: str) -> dict:
            return {"index": i, "text": echoes[i] + text,
                    "logprobs": openai_logprobs(gen.logprobs) if gen.logprobs else None}

        return respond(gens, req, "text_completion", choice, lambda text: {"text": text, "logprobs": None})

    def openai_logprobs(lp: dict) -> dict:
        """Engine scores (token ids) in OpenAI's legacy completions shape (token strings, offsets)."""
        decode = service.tokenizer.decode
        tokens = [decode([t]) for t in lp["token_ids"]]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        top = [None if d is None else {decode([t]): v for t, v in d.items()} for d in lp["top_logprobs"]]
        return {"tokens": tokens, "token_logprobs": lp["token_logprobs"], "top_logprobs": top, "text_offset": offsets}

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

        def choice(i: int, gen: Generation, text: str) -> dict:
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None}

        return respond([gen], req, "chat.completion", choice, None)

    def respond(gens: list[Generation], req, kind: str, choice: Callable[[int, Generation, str], dict],
                piece: Callable[[str], dict] | None) -> Response:
        """JSON (one choice per generation) or SSE (one generation); ``piece`` builds a streamed completions
        delta (None means chat)."""
        rid = ("chatcmpl-" if piece is None else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        try:
            for gen in gens:
                gen.prime()  # retries on another mode if the first fails, before anything is sent
        except GenerationError as exc:
            for gen in gens:
                gen.request.cancel()
            raise ApiError(503, str(exc), code="mode_failed", retry_after=RETRY_AFTER_S) from None
        headers = {"X-ModeSwitch-Mode": gens[0].mode}
        if req.stream:
            stream = sse(gens[0], req, rid, created, kind, piece)
            return Response(stream, mimetype="text/event-stream",
                            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices = []
        try:
            for i, gen in enumerate(gens):
                text = "".join(gen.deltas())
                choices.append({**choice(i, gen, text), "finish_reason": gen.finish_reason})
        except GenerationError as exc:
            raise ApiError(500, str(exc), code="mode_failed") from None
        totals = [usage(g) for g in gens]
        total = {k: sum(u[k] for u in totals) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        total["prompt_tokens_details"] = {"cached_tokens": sum(g.cached_tokens for g in gens)}
        total["energy_j"] = round(sum(g.energy_j for g in gens), 6)
        total["energy_source"] = service.pool.energy.source
        resp = jsonify({"id": rid, "object": kind, "created": created, "model": service.model_name,
                        "choices": choices, "usage": total, "modeswitch": gens[0].report()})
        resp.headers.update(headers)
        return resp

    def usage(gen: Generation) -> dict:
        prompt = len(gen.request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": gen.completion_tokens,
                "total_tokens": prompt + gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
                "energy_j": round(gen.energy_j, 6), "energy_source": service.pool.energy.source}

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

    # ------------------------------------------------------------------ tokenizer (vLLM's shapes, as lm-eval probes)
    @app.post("/tokenize")
    def tokenize():
        req = parse(TokenizeBody, body())
        tokens = service.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": service.pool.context_length})

    @app.post("/detokenize")
    def detokenize():
        req = parse(DetokenizeBody, body())
        vocab = len(service.tokenizer)
        if any(t >= vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return jsonify({"prompt": service.tokenizer.decode(req.tokens)})

    @app.get("/tokenizer_info")
    def tokenizer_info():
        tok = service.tokenizer
        return jsonify({"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                        "pad_token": tok.pad_token, "chat_template": tok.chat_template,
                        "model_max_length": service.pool.context_length, "vocab_size": len(tok)})

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
        controller = service.controller
        policy, report = controller.policy, controller.quality_report
        described = service.pool.describe()
        if report is not None:
            verdicts = judge(report, policy.quality, "general")
            for d in described:
                d["quality_gate"] = ("not in report" if d["name"] not in verdicts
                                     else "pass" if verdicts[d["name"]] is None else verdicts[d["name"]])
        gate = {"report": str(controller.quality_report_path), "date": report["date"]} if report else None
        return jsonify({"modes": described, "policy": {"name": policy.name, "source": policy.source},
                        "quality_gate": gate, "memory": service.pool.memory(),
                        "startup_seconds": service.pool.startup_seconds(), "engine": service.pool.engine_kind,
                        "vllm_engines": service.pool.engines()})

    # ------------------------------------------------------------------ admin
    def reload_path(example: str) -> str | None:
        """The ``{"path": ...}`` of an admin reload; None (empty body) re-reads the current file."""
        data = request.get_json(silent=True, force=True) if request.data else {}
        if data is None:
            raise ApiError(400, f'body must be empty or {{"path": "{example}"}}', param="path")
        return parse(PolicyReload, data).path or None

    @app.post("/admin/gate")
    def reload_gate():
        """Re-read the quality gate report (or another file); a broken file changes nothing."""
        try:
            report = service.controller.load_quality_report(reload_path("evals/reports/MODEL.json"))
        except ConfigError as exc:
            raise ApiError(400, f"gate report not changed: {exc}", param="path", code="invalid_gate_report") from None
        return jsonify({"report": str(service.controller.quality_report_path), "date": report.get("date"),
                        "modes": sorted(report["modes"])})

    @app.get("/admin/policy")
    def get_policy():
        return jsonify(service.controller.policy.describe())

    @app.post("/admin/policy")
    def reload_policy():
        try:
            policy = service.controller.reload(reload_path("policies/NAME.yaml"))
        except ConfigError as exc:
            raise ApiError(400, f"policy not changed: {exc}", param="path", code="invalid_policy") from None
        log.info("policy reloaded: %s from %s", policy.name, policy.source)
        return jsonify(policy.describe())

    return app
