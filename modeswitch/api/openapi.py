"""The published API schema (``GET /openapi.json``), built from the same pydantic models that validate requests.

Each route declares what the document says of it where it is defined (:func:`route`: the Flask route and its
:class:`Operation` in one decorator), so a new route is one place and cannot go undocumented. Request bodies come
straight from :mod:`.schemas`, so the schema cannot drift from validation; response models below describe what the
routes return, and the fuzz tests (schemathesis) check every response against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from flask import Blueprint
from pydantic import BaseModel, ConfigDict, Field

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


@dataclass(frozen=True)
class Operation:
    """What the document says of one route's method."""

    summary: str
    #: the JSON answer's model (None: ``content`` says what it answers)
    out: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    body_required: bool = True
    #: error statuses it answers with an OpenAI-style error (401 is added where a key is required)
    errors: tuple[int, ...] = ()
    #: it also answers server-sent events (``stream: true``)
    stream: bool = False
    #: a non-JSON answer: media type -> schema
    content: dict[str, dict] | None = None
    #: open without the API key
    public: bool = False
    #: statuses that answer with ``out`` too, with their description
    also: tuple[tuple[int, str], ...] = ()


#: every documented route: path -> method -> what the document says (filled as the route modules are imported)
ROUTES: dict[str, dict[str, Operation]] = {}


def route(bp: Blueprint, method: str, path: str, operation: Operation) -> Callable:
    """Register a Flask route on ``bp`` and what ``/openapi.json`` says of it, in one decorator."""
    ROUTES.setdefault((bp.url_prefix or "") + path, {})[method] = operation
    return bp.route(path, methods=[method.upper()])


def build_spec(auth: bool) -> dict:
    """OpenAPI 3.1 document for this server (``auth``: whether routes need a bearer token)."""
    comps: dict[str, Any] = {}

    def operation(op: Operation) -> dict:
        if op.out is not None:
            json = {"application/json": {"schema": _schema(op.out, comps)}}
            content = {**json, "text/event-stream": {"schema": SSE_EVENT}} if op.stream else json
        else:
            content = op.content or {}
        ok = "the answer (JSON), or SSE chunks ending in [DONE] when stream=true" if op.stream else "ok"
        responses = {"200": {"description": ok, "content": content},
                     **{str(status): {"description": why, "content": {"application/json": {
                         "schema": _schema(op.out, comps)}}} for status, why in op.also}}
        errors = (*op.errors, *([401] if auth and not op.public else []))
        if errors:
            responses.update(_errors(comps, *errors))
        out: dict[str, Any] = {"summary": op.summary, "responses": responses}
        if op.body is not None:
            out["requestBody"] = {"required": op.body_required, "content": {
                "application/json": {"schema": _schema(op.body, comps)}}}
        if op.public:
            out["security"] = []
        return out

    paths = {path: {method: operation(op) for method, op in methods.items()} for path, methods in ROUTES.items()}
    spec: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": "ModeSwitch", "version": "0.1.0"},
                            "paths": paths, "components": {"schemas": comps}}
    if auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    return spec
