"""Tool calling for chat: tools into the prompt, forced calls as a grammar, the answer back as ``tool_calls``.

* The tools reach the model through its chat template when the template renders them (``tools`` in it);
  otherwise, as for the demo's SmolLM2, in a system message in the Hermes format, which is also how an assistant's
  earlier ``tool_calls`` are written back into the history: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.
* ``tool_choice`` ``required`` and a named function constrain the output with a JSON schema built from the
  functions' ``parameters`` (as vLLM does: a list of ``{"name", "parameters"}`` objects, or the named function's
  arguments), so a forced call always has valid arguments, whatever the model.
* ``auto``: the model answers freely, and ``<tool_call>`` blocks in its answer become tool calls (the Hermes
  format, which the prompt above asks for); ``none``: the tools are shown, the answer is text.
* Either way the answer is read as it comes (:mod:`.hermes`), so that a stream sends each call as it is written,
  and the whole answer is read by the same reader, so the stream adds up to the unstreamed message.
"""

from __future__ import annotations

import json

from ..sampling_params import Constraint
from .hermes import ForcedCallStream, ToolCallStream
from .schemas import ChatBody

HERMES_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    "<tools> {tools} </tools> For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-dict>}}\n</tool_call>")


def template_renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def messages(req: ChatBody, native: bool) -> tuple[list[dict], dict]:
    """The chat history for ``apply_chat_template`` and its extra arguments (``tools`` where the template renders
    them); ``native``: the template renders tools and tool calls itself."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    out: list[dict] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        entry: dict = {"role": role, "content": m.text}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            if native:
                entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                entry["content"] += "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
        if m.tool_call_id is not None and native:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    prompt = HERMES_PROMPT.format(tools=json.dumps([t["function"] for t in tools]))
    if out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _parameters(fn) -> dict:
    return fn.parameters or {"type": "object", "properties": {}}


def constraint(req: ChatBody) -> Constraint | None:
    """The grammar a forced call is generated under (None when the model may answer in text)."""
    choice = req.chosen_tools
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        fn = next(t.function for t in req.tools if t.function.name == choice)
        return Constraint("json", json.dumps(_parameters(fn)))
    calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t.function)},
         "required": ["name", "parameters"]} for t in req.tools]}}
    if not req.parallel_tool_calls:
        calls["maxItems"] = 1
    return Constraint("json", json.dumps(calls))


def calls(req: ChatBody) -> ToolCallStream | ForcedCallStream | None:
    """A reader of one answer's content and calls, as it comes (None: ``none``, the answer is text): ``auto``
    reads Hermes blocks, a forced call the JSON its grammar allows."""
    choice = req.chosen_tools
    if choice == "none":
        return None
    if choice == "auto":
        return ToolCallStream({t.function.name for t in req.tools}, req.parallel_tool_calls)
    return ForcedCallStream(None if choice == "required" else choice)


def parse(req: ChatBody, text: str) -> tuple[str | None, list[dict]]:
    """The whole answer as (content, tool calls), read as a stream reads it, so the two add up to the same."""
    answer = calls(req)
    if answer is None:
        return text, []
    answer.feed(text)
    answer.finish()
    return answer.content or None, answer.calls

