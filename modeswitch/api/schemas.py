"""Request bodies, validated with pydantic at the HTTP edge (strict types: ``"16"`` is not a number).

Every field is either modelled, and honoured by the mode that serves the request, or refused with a 400 naming
it: unknown fields are errors (``extra="forbid"``), except OpenAI's fields that do not change the output
(:data:`NO_EFFECT`: accepted and documented as such). Fields OpenAI or vLLM have and this server does not are
refused with the reason (:data:`REFUSED`). The published schema (``/openapi.json``) is built from these models.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engines.grammar import grammar
from ..sampling_params import Constraint, SamplingParams
from .errors import ApiError

MAX_STOP = 4
#: the most choices one request may ask for (``n``), and the most alternatives per token (``logprobs``, as vLLM's
#: default ``max_logprobs``)
MAX_N = 16
MAX_LOGPROBS = 20
NonNegFloat = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

#: Fields of OpenAI's or vLLM's API this server does not honour, and why (a 400 says so rather than "unknown").
REFUSED = {
    "best_of": "best_of is not supported (vLLM's v1 engine dropped it too); ask for n choices instead",
    "use_beam_search": "beam search is not supported",
    "suffix": "suffix (insertion) is not supported",
    "functions": "functions is deprecated by OpenAI; send tools",
    "function_call": "function_call is deprecated by OpenAI; send tool_choice",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "reasoning_effort": "this model does not reason in a separate channel",
}


#: OpenAI's fields that change nothing in the output: accepted, and without effect here
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
#: fields that shape sampling only: a greedy request (temperature 0) decodes the same whatever they are
SAMPLING_ONLY = frozenset({"top_p", "top_k", "min_p", "seed"})
#: what a request asks about rather than how: not options
_SUBJECT = frozenset({"model", "prompt", "messages"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict | str | None = Field(default=None, alias="json", description="a JSON schema the output validates against")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(default=None, description="an EBNF grammar (xgrammar's dialect, as vLLM accepts)")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self):
        if sum(v is not None for v in (self.json_, self.regex, self.choice, self.grammar, self.json_object)) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object")
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return Constraint("json", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:
            return Constraint("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return Constraint("json_object")


class StreamOptions(_Strict):
    """What a stream reports besides its text (vLLM's ``StreamOptions``); only with ``stream: true``."""

    include_usage: bool | None = Field(default=None, description="a last chunk (no choices) with the response's usage")
    continuous_usage_stats: bool | None = Field(
        default=None, description="with include_usage: every chunk also carries the usage of its choice so far (a "
                                  "chunk of several choices: their prompts, nothing generated yet)")


class JsonSchema(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = Field(default=None, description="the output always validates against the schema, "
                                                          "strict or not: it is generated under its grammar")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_object")
        if self.type == "json_schema":
            return Constraint("json", json.dumps(self.json_schema.schema_ or {}))
        return None


class _Body(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = Field(default=0, description="sample from the k likeliest tokens (0 or -1: all)")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = Field(default=None, description="the same seed, prompt and mode give the same output; choice "
                                                       "i of n uses seed + i")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, description="token id (as a string) -> bias added to its logit")
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    mode: str | None = Field(default=None, description="pin a mode by name (honoured only if it is available)")
    task: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        default="general", description="task family for the quality gate (families are named in the policy)")
    # OpenAI fields that do not change the output: accepted, and without effect here
    user: str | None = Field(default=None, description="accepted; no effect")
    metadata: dict[str, str] | None = Field(default=None, description="accepted; no effect")
    store: bool | None = Field(default=None, description="accepted; nothing is stored")
    service_tier: str | None = Field(default=None, description="accepted; no effect")
    prompt_cache_key: str | None = Field(default=None, description="accepted; no effect (prefix reuse is automatic)")
    safety_identifier: str | None = Field(default=None, description="accepted; no effect")

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in REFUSED.items():
                if name in data:
                    raise ValueError(f"{name}: {why}")
        return data

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("set response_format or structured_outputs, not both")
        return self

    @model_validator(mode="after")
    def _streamed(self):
        """As vLLM: stream options that set anything need a stream (otherwise they would be dropped silently)."""
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries usage: ``continuous_usage_stats``, which, as in vLLM, acts only with ``include_usage``."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def option_effects(self) -> dict[str, list[str]]:
        """The options this request set, by its own field names: ``honoured`` (each one the serving mode applied:
        the capability gate sends a request only to a mode that honours every option it needs, and the API layer
        honours the rest) and ``no_effect`` (accepted, changing nothing: :data:`NO_EFFECT`, and
        :data:`SAMPLING_ONLY` fields of a greedy request). A client can check a response's fidelity from them."""
        given = self.model_fields_set - _SUBJECT
        idle = (given & NO_EFFECT) | (given & SAMPLING_ONLY if self.temperature == 0.0 else set())
        return {"honoured": sorted(given - idle), "no_effect": sorted(idle)}

    def constraint(self) -> Constraint | None:
        """The grammar the output must follow, from ``response_format`` or ``structured_outputs``."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, alternatives per prompt token): None where not asked for."""
        return None, None

    def to_sampling_params(self, vocab: int, constraint: Constraint | None = None,
                           param: str = "structured_outputs") -> SamplingParams:
        """The request's decoding options (``max_tokens`` is set per prompt when generations start). Every
        :class:`SamplingParams` field this body has under the same name is taken as it is, so a new option is a
        field here and there; the few whose shape differs are converted below. Token ids are checked against the
        vocabulary and ``constraint`` (the output's grammar; ``param``: the field it came from) is parsed, so a bad
        one is a 400 before anything starts."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab:
                raise ApiError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab})", param="logit_bias")
            bias.append((int(key), value))
        if any(t >= vocab for t in self.stop_token_ids or ()):
            raise ApiError(400, f"stop_token_ids: token ids must be in [0, {vocab})", param="stop_token_ids")
        if constraint is not None:
            try:
                grammar(constraint)
            except ValueError as exc:
                raise ApiError(400, f"{param}: {exc}", param=param) from None
        logprobs, prompt_logprobs = self.logprob_counts()
        same = {f.name: getattr(self, f.name) for f in fields(SamplingParams) if f.name in type(self).model_fields}
        return SamplingParams(**{**same, "max_tokens": 1, "top_k": max(self.top_k, 0), "logit_bias": tuple(bias),
                                 "stop_token_ids": tuple(self.stop_token_ids or ()), "logprobs": logprobs,
                                 "prompt_logprobs": prompt_logprobs, "constraint": constraint})


MAX_PROMPTS = 64


class CompletionBody(_Body):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = Field(default=False, description="prepend the prompt to the returned text")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        default=None, description="each generated token's logprob and this many alternatives; with echo=true (and "
                                  "max_tokens=1, not streamed) every prompt token's instead: prompt scoring, what "
                                  "lm-eval's local-completions sends")

    @model_validator(mode="after")
    def _scoring_shape(self):
        if self.logprobs is not None and self.echo and not (self.max_tokens == 1 and not self.stream and self.n == 1):
            raise ValueError("echo with logprobs scores the prompt: max_tokens=1, n=1, stream=false")
        return self

    @property
    def scoring(self) -> bool:
        return self.logprobs is not None and self.echo

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """``logprobs`` alternatives per generated token, or per prompt token when scoring (echo)."""
        return (None, self.logprobs) if self.scoring else (self.logprobs, None)

    @property
    def prompts(self) -> list:
        """The request's prompts: strings or token-id lists (several only as a list of token-id lists)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ToolFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = Field(default=None, description="arguments always validate against parameters when the "
                                                          "call is forced (required or named tool_choice)")


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = Field(default=None, description="accepted; not shown to the model")
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self):
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, carry tool_call_id")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatBody(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = Field(default=False, description="each generated token's logprob")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        default=None, description="alternatives per token (needs logprobs=true)")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or a named function")
    parallel_tool_calls: bool = Field(default=True, description="false: at most one tool call")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tools and self.tool_choice != "none" and self.constraint() is not None:
            raise ValueError("tools (unless tool_choice is none) and a response format cannot be combined")
        return self

    @property
    def chosen_tools(self) -> str:
        """``none`` (no tools, or tool_choice none), ``auto``, ``required``, or the named function's name."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """With ``logprobs``, ``top_logprobs`` alternatives per generated token (0: the token's own logprob only)."""
        return ((self.top_logprobs or 0) if self.logprobs else None), None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part) -> bool:
    """Location parts that name fields or list positions (pydantic also inserts union member tags)."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and part not in _TYPE_TAGS


def parse(model: type[BaseModel], data) -> BaseModel:
    """Validate ``data`` or raise a 400 naming the first offending field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if _is_field(p))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field: this server refuses fields it does not honour (see /openapi.json)"
        elif not param and ": " in msg and msg.split(": ", 1)[0] in {*REFUSED, *model.model_fields}:
            # a refused field, or a field a whole-body check refuses, names itself
            param, msg = msg.split(": ", 1)
        raise ApiError(400, f"{param or 'body'}: {msg}", param=param or None) from None


class TokenizeBody(_Strict):
    prompt: str
    add_special_tokens: bool = False


class DetokenizeBody(_Strict):
    tokens: list[Annotated[int, Field(ge=0)]]


class PolicyReload(BaseModel):
    """An admin reload: a file inside the configured directories, or nothing to re-read the current one."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
