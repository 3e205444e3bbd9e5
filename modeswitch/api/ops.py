"""Operations and information routes: health, metrics, the OpenAPI document, models, modes, tokenizer."""

from __future__ import annotations

from functools import lru_cache

from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST

from ..controller.quality import describe_kernels, kernels_key, runs
from ..weight_kinds import REFERENCE_MODE
from .context import ctx
from .errors import ApiError
from .generation import body
from .openapi import (Detokenized, Health, ModeList, ModelList, Operation, TokenizerInfo, Tokens, build_spec,
                      route)
from .schemas import DetokenizeBody, TokenizeBody, parse

bp = Blueprint("ops", __name__)


@route(bp, "get", "/health", Operation("Liveness; 503 when no mode can serve", Health, public=True,
                                    also=((503, "no mode available"),)))
def health():
    c = ctx()
    registry = c.service.registry
    available = len(registry.available())
    down = sorted(m.name for m in registry.modes.values() if m.down)
    status = 200 if available else 503
    # degraded: it serves, but modes that were up are down (their engine died and is restarting, or gave up)
    return jsonify({"status": "no mode available" if not available else "degraded" if down else "ok",
                    "model": c.service.model_name, "modes_down": down,
                    "modes_available": available, "modes_loading": len(registry.loading()),
                    "in_flight": c.admission.active,
                    "draining": c.admission.draining}), status


@route(bp, "get", "/metrics", Operation("Prometheus metrics (text exposition format)",
                                     content={"text/plain": {"schema": {"type": "string"}}}))
def metrics():
    return Response(ctx().service.metrics.render(), mimetype=CONTENT_TYPE_LATEST)


@route(bp, "get", "/openapi.json", Operation("This document",
                                          content={"application/json": {"schema": {"type": "object"}}}))
def openapi():
    return jsonify(_spec(bool(ctx().http.api_key)))


@lru_cache(maxsize=2)
def _spec(auth: bool) -> dict:
    """The document depends only on whether a key is required: built once for each."""
    return build_spec(auth=auth)


@route(bp, "get", "/v1/models", Operation("The served model", ModelList))
def models():
    c = ctx()
    return jsonify({"object": "list", "data": [{"id": c.service.model_name, "object": "model", "created": c.started,
                                                "owned_by": "modeswitch",
                                                "max_model_len": c.service.registry.context_length}]})


@route(bp, "get", "/v1/modes", Operation("Every mode: status, reason, statistics, memory", ModeList))
def modes():
    service = ctx().service
    controller = service.controller
    policy, report = controller.policy, controller.quality_report
    described = service.registry.describe()
    verdicts = controller.quality_verdicts()
    if verdicts is not None:
        for d in described:
            judged = verdicts.get(d["name"])
            d["quality_gate"] = ("not in report" if judged is None else "pass" if judged.status == "pass"
                                 else judged.detail)
            if judged is not None:  # the report row it is judged by (while pending: the newest, on other kernels),
                # the kernels that row was scored on, and whether they are the ones the mode runs here
                d["gate_row"] = {"report": controller.quality_report_path.name, "row": d["name"],
                                 "run": judged.run.get("date") if judged.run else None, "scored_on": judged.scored_on,
                                 "same_kernels": judged.scored_on is not None
                                 and kernels_key(judged.scored_on) == kernels_key(d.get("kernels"))}
    gate = {}
    if report:
        scored = runs(report)
        gate = {"report": str(controller.quality_report_path), "date": scored[-1].get("date"),
                "runs": [{"date": r.get("date"), "reference": describe_kernels(r.get("kernels", {}).get(REFERENCE_MODE))}
                         for r in scored]}
    gate["holds_for"] = service.registry.gate_key  # the report name (evals/reports/<model>-<this>.json) it needs
    return jsonify({"modes": described, "policy": {"name": policy.name, "source": policy.source},
                    "quality_gate": gate, "memory": service.registry.memory(),
                    "startup_seconds": service.registry.startup_seconds(), "backend": service.registry.backend_name,
                    "engines": service.registry.engines(), "speculation": service.speculation.describe(),
                    "costs": service.costs.describe()})


# ---------------------------------------------------------------- tokenizer (vLLM's shapes, as lm-eval probes)
@route(bp, "post", "/tokenize", Operation("Token ids of a text (vLLM's shape)", Tokens, TokenizeBody, errors=(400,)))
def tokenize():
    service = ctx().service
    req = parse(TokenizeBody, body())
    tokens = service.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": service.registry.context_length})


@route(bp, "post", "/detokenize", Operation("Text of token ids", Detokenized, DetokenizeBody, errors=(400,)))
def detokenize():
    tokenizer = ctx().service.tokenizer
    req = parse(DetokenizeBody, body())
    vocab = len(tokenizer)
    if any(t >= vocab for t in req.tokens):
        raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return jsonify({"prompt": tokenizer.decode(req.tokens)})


@route(bp, "get", "/tokenizer_info", Operation("Special tokens, chat template, context length", TokenizerInfo))
def tokenizer_info():
    service = ctx().service
    tok = service.tokenizer
    return jsonify({"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                    "pad_token": tok.pad_token, "chat_template": tok.chat_template,
                    "model_max_length": service.registry.context_length, "vocab_size": len(tok)})
