"""What travels between the cluster's ingress and its replicas: an HTTP request as plain data, and the text a
router reads to place it.

The ingress does not parse or validate OpenAI requests; each replica runs the single server's own Flask app on
the forwarded request (:mod:`modeswitch.cluster.replica`), so validation, errors and SSE framing have one
implementation. The only thing the ingress reads from a body is :func:`routing_text`, and only for placing the
request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

#: Routes whose body is a generation request: routed by prompt, retried once if the replica dies.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: the routing text of a token-id prompt (:func:`routing_text`)
TOKEN_IDS = re.compile(r"(?:\d+\|)+")


@dataclass
class Forwarded:
    """One HTTP request as the ingress received it. ``prompt`` is the routing text (:func:`routing_text`);
    Ray's ``PrefixCacheAffinityRouter`` reads the same attribute, so the baseline routes it unchanged.
    ``replica``: route to this replica only (the ingress fans ``/v1/modes`` and ``/metrics`` out this way)."""

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    client: str = "unknown"
    prompt: str = ""
    stream: bool = False
    replica: str | None = None


@dataclass
class Answer:
    """A replica's whole response to a non-streamed request."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def routing_text(path: str, body: bytes) -> tuple[str, bool]:
    """The text that identifies a generation request's prefix, and whether it asks to stream.

    Completions: the (first) prompt, a string or token ids (written as ``"17|4|"``: shared leading ids give
    shared leading text); chat: each message's role and text in order, so two
    conversations that share a system prompt and history share a prefix here as they do after the chat
    template. Anything unparsable gives ``""``: the request is still forwarded and the replica answers the
    error."""
    if path not in GENERATION_PATHS:
        return "", False
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return "", False
    if not isinstance(data, dict):
        return "", False
    stream = data.get("stream") is True
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: the first prompt places it
    if isinstance(prompt, str):
        return prompt, stream
    if isinstance(prompt, list):
        return "".join(f"{t}|" for t in prompt if isinstance(t, int)), stream
    messages = data.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role', '')}>{_content_text(m.get('content'))}" for m in messages
                       if isinstance(m, dict)), stream
    return "", stream


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only the text ones carry a prefix
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
