"""The published API schema (``GET /openapi.json``), built from the same pydantic models that validate requests.

Request bodies come straight from :mod:`.schemas`, so the schema cannot drift from validation; response
models below describe what the routes return, and the fuzz tests (schemathesis) check every response
against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .schemas import ChatBody, CompletionBody, DetokenizeBody, PolicyReload, TokenizeBody

REF = "#/components/schemas/{model}"
#: One server-sent event: ``data`` is a JSON chunk (the completion's shape, with deltas) or ``[DONE]``.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(_Open):
    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    energy_j: float = Field(description="energy attributed to this request's share of the engine steps, in joules")
    energy_source: Literal["measured", "estimated"] = Field(
        description="measured: NVML energy counter; estimated: configured power x time, split by a roofline model")


class GatePending(_Open):
    status: Literal["pending"]
    reason: str = Field(description="how the kernels the mode's gate rows were scored on differ from the ones it "
                                    "serves on here")


class ModeSwitchInfo(_Open):
    """Which mode served the request and why (plus features, timings, cached tokens, retries)."""

    mode: str
    reason: str
    quality_gate: GatePending | None = Field(
        default=None, description="present when the request pinned a mode whose quality verdict is pending: no gate "
                                  "row was scored on the kernels it serves on here, so nothing vouches for the answer")
    honoured: list[str] = Field(description="the options the request set (by its field names) that were applied")
    no_effect: list[str] = Field(description="the options the request set that change nothing: OpenAI's "
                                             "bookkeeping fields, and sampling settings of a greedy request")


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    modeswitch: ModeSwitchInfo


class FunctionCallOut(_Open):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallOut(_Open):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Open):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Open):
    content: list[TokenLogprob]


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    modeswitch: ModeSwitchInfo


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    owned_by: str


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class ModeCard(_Open):
    name: str
    status: Literal["available", "loading", "restarting", "unavailable", "quarantined"]
    backend: str = Field(description="the engine family serving the mode: transformers or vllm")
    reason: str
    quality_gate: str | None = Field(
        default=None, description="with a gate report loaded: pass, not in report, why it fails, or 'gate pending: "
                                  "...' (its rows were scored on other kernels: served only when a request pins it)")


class ModeList(_Open):
    modes: list[ModeCard]
    policy: dict[str, Any]
    memory: dict[str, Any]
    backend: str = Field(description="the engine family serving every mode")
    engines: dict[str, Any] = Field(description="the running engines, by key: their modes, status and memory")


class Health(_Open):
    status: str
    modes_available: int
    modes_loading: int  # a staged start's modes still coming up, or restarting (benchmarks wait for 0)
    modes_down: list[str] = Field(default_factory=list, description="modes that were up and whose engine is down")


class PolicyInfo(_Open):
    name: str
    type: Literal["rules", "learned"]
    source: str


class GateInfo(_Open):
    report: str
    runs: int = Field(description="the gate runs the report holds, each scored on one set of kernels")
    modes: list[str]


class Tokens(_Open):
    tokens: list[int]
    count: int


class Detokenized(_Open):
    prompt: str


class TokenizerInfo(_Open):
    eos_token: str | None
    model_max_length: int


def _schema(model: type[BaseModel], components: dict) -> dict:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def _errors(components: dict, *codes: int) -> dict:
    ref = _schema(Error, components)
    return {str(c): {"description": "error", "content": {"application/json": {"schema": ref}}} for c in codes}


def build_spec(auth: bool) -> dict:
    """OpenAPI 3.1 document for this server (``auth``: whether routes need a bearer token)."""
    comps: dict[str, Any] = {}

    def json_ok(model: type[BaseModel], description: str = "ok") -> dict:
        return {"200": {"description": description, "content": {"application/json": {"schema": _schema(model, comps)}}}}

    def generation(body: type[BaseModel], out: type[BaseModel], summary: str) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _schema(body, comps)}}},
            "responses": {"200": {"description": "the completion (JSON), or SSE chunks ending in [DONE] when stream=true",
                                  "content": {"application/json": {"schema": _schema(out, comps)},
                                              "text/event-stream": {"schema": SSE_EVENT}}},
                          **_errors(comps, 400, 404, 413, 429, 503, *([401] if auth else []))}}}

    auth_errors = _errors(comps, 401) if auth else {}
    admin_errors = _errors(comps, 400, 403, *([401] if auth else []))  # 403: closed on an exposed bind
    paths = {
        "/v1/completions": generation(CompletionBody, Completion, "Text completion (OpenAI-compatible)"),
        "/v1/chat/completions": generation(ChatBody, ChatCompletion, "Chat completion (OpenAI-compatible)"),
        "/v1/models": {"get": {"summary": "The served model", "responses": {**json_ok(ModelList), **auth_errors}}},
        "/v1/modes": {"get": {"summary": "Every mode: status, reason, statistics, memory",
                              "responses": {**json_ok(ModeList), **auth_errors}}},
        "/health": {"get": {"summary": "Liveness; 503 when no mode can serve", "security": [],
                            "responses": {**json_ok(Health), "503": {"description": "no mode available", "content": {
                                "application/json": {"schema": _schema(Health, comps)}}}}}},
        "/admin/policy": {
            "get": {"summary": "The routing policy in force",
                    "responses": {**json_ok(PolicyInfo), **_errors(comps, 403, *([401] if auth else []))}},
            "post": {"summary": "Reload the policy (its file, or another in the policy directories); a broken file "
                             "changes nothing",
                     "requestBody": {"required": False, "content": {
                         "application/json": {"schema": _schema(PolicyReload, comps)}}},
                     "responses": {**json_ok(PolicyInfo), **admin_errors}}},
        "/admin/gate": {
            "post": {"summary": "Reload the quality gate report; a broken file changes nothing",
                     "requestBody": {"required": False, "content": {
                         "application/json": {"schema": _schema(PolicyReload, comps)}}},
                     "responses": {**json_ok(GateInfo), **admin_errors}}},
        "/tokenize": {"post": {"summary": "Token ids of a text (vLLM's shape)", "requestBody": {"required": True,
                      "content": {"application/json": {"schema": _schema(TokenizeBody, comps)}}},
                      "responses": {**json_ok(Tokens), **_errors(comps, 400, *([401] if auth else []))}}},
        "/detokenize": {"post": {"summary": "Text of token ids", "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _schema(DetokenizeBody, comps)}}},
                        "responses": {**json_ok(Detokenized), **_errors(comps, 400, *([401] if auth else []))}}},
        "/tokenizer_info": {"get": {"summary": "Special tokens, chat template, context length",
                                    "responses": {**json_ok(TokenizerInfo), **auth_errors}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format)", "responses": {"200": {
            "description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}, **auth_errors}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
            "description": "OpenAPI document", "content": {"application/json": {"schema": {"type": "object"}}}},
            **auth_errors}}},
    }
    spec: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": "ModeSwitch", "version": "0.1.0"},
                            "paths": paths, "components": {"schemas": comps}}
    if auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    return spec
