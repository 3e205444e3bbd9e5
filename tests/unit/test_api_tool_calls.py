"""Streamed tool calls' readers: ``auto`` answers (Hermes ``<tool_call>`` blocks) fed in every split, and JSON
re-written as it comes."""

from __future__ import annotations

import json

import pytest

from modeswitch.api.hermes import ToolCallStream
from modeswitch.api.jsonstream import JsonValue

WEATHER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit":"celsius", '
           '"days": [1, 2.50, 3e1], "note": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\""}}\n</tool_call>')
ADD = '<tool_call>{"arguments": {"a": 1, "b": -2}, "name": "add"}</tool_call>'
CUT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b"'
LOOKALIKES = "a <tool> b <tool_call_x> c </tool_call> <<tool_cal d < e "
#: answers: (the reply, max_tokens (None: all of it), the message's content, its calls' names), whoever reads it
ANSWERS = {
    "content, then a call": ("Let me check.\n" + WEATHER, None, "Let me check.", ["get_weather"]),
    "two calls, text between and after": ("Intro\n" + WEATHER + "\n" + ADD + "\nDone.", None, "Intro\n\n\nDone.",
                                          ["get_weather", "add"]),
    "a call, then one not offered": (ADD + '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None,
                                     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', ["add"]),
    "not JSON": ("<tool_call>{not json</tool_call>", None, "<tool_call>{not json</tool_call>", []),
    "unfinished before its name": ('Hm. <tool_call>{"na', None, 'Hm. <tool_call>{"na', []),
    "cut by max_tokens before its name": (ADD, 30, ADD[:30], []),
    "cut by max_tokens in its arguments": (CUT + ": 2}}</tool_call>", len(CUT), "", ["add"]),
    "look-alikes of the tag": (LOOKALIKES, None, LOOKALIKES, []),
}


SPLITS = (None, 1, 2, 5)


def read(text: str, split: int | None, parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """What the streamed pieces of ``text`` (cut every ``split`` characters) add up to, checked against the
    message the reader holds."""
    stream = ToolCallStream({"get_weather", "add"}, parallel)
    pieces = [stream.feed(text[i:i + (split or len(text))]) for i in range(0, len(text), split or len(text) or 1)]
    pieces.append(stream.finish())
    content, calls = "".join(p.content for p in pieces), {}
    for p in pieces:
        for d in p.calls:
            calls.setdefault(d["index"], ["", ""])
            calls[d["index"]][0] += d["function"].get("name", "")
            calls[d["index"]][1] += d["function"].get("arguments", "")
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls]
    assert (content, [tuple(c) for c in calls.values()]) == (stream.content, whole)
    return content, whole


@pytest.mark.parametrize("name", ANSWERS)
def test_every_split_of_an_answer_reads_the_same(name):
    reply, max_tokens, content, names = ANSWERS[name]
    results = [read(reply[:max_tokens], split) for split in SPLITS]
    assert all(r == results[0] for r in results)
    assert results[0][0] == content and [n for n, _ in results[0][1]] == names


def test_whitespace_next_to_a_call_goes_and_a_call_without_arguments_has_none():
    assert read("  \n" + ADD + "  Hello  \n", 1) == ("Hello", [("add", '{"a": 1, "b": -2}')])
    assert read("  Hello  \n", 1) == ("  Hello  \n", [])  # no call: the text as it is
    assert read('<tool_call> {"name" : "add" } </tool_call>', 1) == ("", [("add", "{}")])
    # arguments given as a string are that string; a block after the first call is dropped when not parallel
    assert read('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', 1)[1] == [("add", '{"a": 1}')]
    assert read(ADD + "\n" + WEATHER + " ok", 1, parallel=False) == ("ok", [("add", '{"a": 1, "b": -2}')])
    # JSON that breaks off after the name: the arguments stop there, and the rest of the block is not content
    assert read('<tool_call>{"name": "add", "arguments": {"a": 1 ]}</tool_call>x', 1) == ("x", [("add", '{"a": 1')])


@pytest.mark.parametrize("text", ['{"a": 1}', ' { "k" : [1,2.50,-0,1e3,true,false,null,{},[]] , "s":"\\u00e9\\/\\n" }',
                                  '"\\ud83d\\ude00 \\ud83d x"', "12", "[NaN, -Infinity]", '{"a":{"b":[[],[{}]]}}'])
def test_json_is_written_as_json_dumps_writes_it(text):
    value, out = JsonValue(), []
    for c in text + " ":
        consumed = value.feed(c)
        out.append(value.take())
        if not consumed:
            break
    assert value.done and "".join(out) == json.dumps(json.loads(text))


@pytest.mark.parametrize("text", ["{a}", '{"a" 1}', "[1,]", '{"a":1,}', "01 ", '"\x01"', '"\\x"', '"\\u12g4"',
                                  "[1 2]", '{"a":1]', "+1 "])
def test_what_is_not_json_fails(text):
    value = JsonValue()
    assert not all(value.feed(c) for c in text) and value.failed
