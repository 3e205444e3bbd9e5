"""Streamed tool calls' readers: JSON re-written as it comes."""

from __future__ import annotations

import json

import pytest

from modeswitch.api.jsonstream import JsonValue


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
