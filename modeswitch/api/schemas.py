"""Request bodies, validated with pydantic at the HTTP edge (strict types: ``"16"`` is not a number).

Unknown fields are ignored, as OpenAI clients send many optional ones; fields we know but cannot honour
yet are rejected with a clear message instead of being silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ApiError

MAX_STOP = 4
NonNegFloat = Annotated[float, Field(ge=0.0, le=2.0)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=1, description="only n=1 is supported")] = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    mode: str | None = Field(default=None, description="pin a mode by name (honoured only if it is available)")
    task: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        default="general", description="task family for the quality gate (families are named in the policy)")

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


MAX_PROMPTS = 64


class CompletionBody(_Body):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = Field(default=False, description="prepend the prompt to the returned text")
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = Field(
        default=None, description="prompt scoring: with echo=true and max_tokens=1, every prompt token's logprob "
                                  "and this many alternatives per position (what lm-eval's local-completions sends)")

    @model_validator(mode="after")
    def _scoring_only(self):
        if self.logprobs is not None and not (self.echo and self.max_tokens == 1 and not self.stream):
            raise ValueError("logprobs is supported for prompt scoring: echo=true, max_tokens=1, stream=false")
        return self

    @property
    def prompts(self) -> list:
        """The request's prompts: strings or token-id lists (several only as a list of token-id lists)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

    @model_validator(mode="after")
    def _text_parts_only(self):
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatBody(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None


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
        raise ApiError(400, f"{param or 'body'}: {err['msg']}", param=param or None) from None


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: str
    add_special_tokens: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[Annotated[int, Field(ge=0)]]


class PolicyReload(BaseModel):
    """An admin reload: a file inside the configured directories, or nothing to re-read the current one."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
