"""``auto`` tool calls streamed as they are written (Hermes ``<tool_call>`` blocks, in vLLM's delta shape), asked
through the official ``openai`` client of a fake backend whose modes answer a scripted text, byte by byte; and
the reader itself, fed the same answers in every split."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from modeswitch.api.hermes import ForcedCallStream, ToolCallStream
from modeswitch.sampling_params import OPTIONS
from modeswitch.testing.engine import Script

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
         for name in ("get_weather", "add")]
ASK = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
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


def client(make_app, reply: str, **script) -> OpenAI:
    app = make_app(scripts={m: Script(reply=reply, **script) for m in ("fp16", "prefix_cache", "continuous_batching")})
    return OpenAI(base_url=app.serve() + "/v1", api_key="none", max_retries=0)


def accumulated(chunks) -> dict[int, dict]:
    """Each choice of a stream, added up as a client adds it: content, calls by index, finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            choice["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = choice["calls"].setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name is not None:
                    assert call["name"] is None and d.id and d.type == "function"  # the call's first delta
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
            choice["finish_reason"] = c.finish_reason or choice["finish_reason"]
    return out


def message(choice) -> dict:
    calls = {i: {"name": c.function.name, "arguments": c.function.arguments}
             for i, c in enumerate(choice.message.tool_calls or ())}
    return {"content": choice.message.content or "", "calls": calls, "finish_reason": choice.finish_reason}


@pytest.mark.parametrize("name", ANSWERS)
def test_a_stream_adds_up_to_the_message_of_the_same_answer(make_app, name):
    reply, max_tokens, content, names = ANSWERS[name]
    ai = client(make_app, reply)
    ask = {"model": "demo", "messages": ASK, "tools": TOOLS, "temperature": 0, "n": 2,
           "max_tokens": max_tokens or len(reply.encode()) + 8}
    whole = ai.chat.completions.create(**ask)
    streamed = accumulated(ai.chat.completions.create(**ask, stream=True))
    assert [streamed[i] for i in (0, 1)] == [message(c) for c in whole.choices]  # each choice read on its own
    first = message(whole.choices[0])
    assert first["content"] == content and [c["name"] for c in first["calls"].values()] == names
    if max_tokens:  # cut: a call's arguments as far as they came, and the finish reason says so
        assert first["finish_reason"] == "length"
        assert [c["arguments"] for c in first["calls"].values()] == (['{"a": 1'] if names else [])
        return
    assert first["finish_reason"] == ("tool_calls" if names else "stop")
    for call in first["calls"].values():  # written as json.dumps writes the model's JSON, as vLLM writes it
        assert call["arguments"] == json.dumps(json.loads(call["arguments"]))
    if names and names[0] == "get_weather":
        args = json.loads(first["calls"][0]["arguments"])
        assert args["note"] == 'café 😀 "quoted"' and args["days"] == [1, 2.5, 30.0]


def held_back(reply: str, chunks) -> list[str]:
    """At each chunk of a stream asked with logprobs (so every token sends one, even when it adds no text), what
    the reply (one token a character) had generated that the content had not yet sent."""
    generated = sent = 0
    held = []
    for chunk in chunks[1:]:
        choice = chunk.choices[0]
        generated += len(choice.logprobs.content) if choice.logprobs else 0
        text = choice.delta.content or ""
        assert reply[sent:].startswith(text)
        sent += len(text)
        held.append(reply[sent:generated])
    return held


def only_what_may_be_the_tag(held: str) -> bool:
    """Whitespace (dropped if a call follows it), then what may be the start of ``<tool_call>``."""
    return "<tool_call>".startswith(held.lstrip())


def test_a_call_streams_as_it_is_written(make_app):
    reply = "Let me check.\n" + WEATHER
    ai = client(make_app, reply)
    chunks = list(ai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, temperature=0, logprobs=True,
                                             max_tokens=400, stream=True))
    deltas = [(n, c.choices[0].delta) for n, c in enumerate(chunks) if c.choices]
    name_at = [n for n, d in deltas for t in d.tool_calls or () if t.function.name]
    argument_at = [n for n, d in deltas for t in d.tool_calls or () if t.function.arguments]
    end = len(chunks) - 1
    assert chunks[end].choices[0].finish_reason == "tool_calls" and not chunks[end].choices[0].delta.tool_calls
    # the content as it comes, until the tag is complete; the name before the stream ends, its first delta
    # carrying index, id, type, name and no arguments yet; then the arguments, in pieces
    tag_at = len("Let me check.\n<tool_call>")  # its chunk
    assert all(only_what_may_be_the_tag(h) for h in held_back(reply, chunks)[:tag_at])
    assert "".join(d.content or "" for _, d in deltas) == "Let me check." and tag_at < name_at[0] < end
    (first,) = deltas[name_at[0]][1].tool_calls
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.arguments == ""
    assert len(argument_at) > 10 and max(argument_at) < end


def test_the_clients_stream_helper_reads_the_calls_as_they_come(make_app):
    reply = "Checking.\n" + WEATHER + ADD
    ai = client(make_app, reply)
    ask = {"model": "demo", "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    with ai.chat.completions.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    kinds = [e.type for e in events]
    argument_deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert {e.name for e in argument_deltas} == {"get_weather", "add"} and len(argument_deltas) > 2
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == ["get_weather", "add"] and done[1].arguments == '{"a": 1, "b": -2}'
    last_content = len(kinds) - 1 - kinds[::-1].index("content.delta")
    assert last_content < kinds.index("tool_calls.function.arguments.delta") < kinds.index(
        "tool_calls.function.arguments.done") < len(kinds) - 1
    whole = ai.chat.completions.create(**ask)
    assert message(final.choices[0]) == message(whole.choices[0]) and final.choices[0].message.content == "Checking."


def test_text_that_only_looks_like_a_tag_streams_unchanged_and_at_once(make_app):
    reply = LOOKALIKES + "end"
    ai = client(make_app, reply)
    chunks = list(ai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, temperature=0, logprobs=True,
                                             max_tokens=400, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply
    assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
    # held back only while it may become the tag: "<tool" until the "_x" after "<tool_call"
    held = held_back(reply, chunks)
    assert all(only_what_may_be_the_tag(h) for h in held) and " <tool_call" in held and held[-1] == ""


# ---------------------------------------------------------------------------------------------- the readers
SPLITS = (None, 1, 2, 5)


def read(text: str, split: int | None, parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """What the streamed pieces of ``text`` (cut every ``split`` characters) add up to, checked against the
    message the reader holds."""
    stream, step = ToolCallStream({"get_weather", "add"}, parallel), split or max(len(text), 1)
    pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
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
    # JSON that breaks off after the name: the arguments stop at what was certain, the rest of the block is not
    # content
    assert read('<tool_call>{"name": "add", "arguments": {"a": [1, 2], "b" 2}}</tool_call>x', 1) == (
        "x", [("add", '{"a": [1, 2]')])


def arguments_of(text: str, split: int | None) -> str:
    (call,) = read(f'<tool_call>{{"name": "add", "arguments": {text}}}</tool_call>', split)[1]
    return call[1]


@pytest.mark.parametrize("text", ['{"a": 1}', ' { "k" : [1,2.50,-0,1e3,true,false,null,{},[]] , "s":"\\u00e9\\/\\n" }',
                                  "12", "[NaN, -Infinity]", '{"a":{"b":[[],[{}]]}}', '"{\\"a\\": \\ud83d\\ude00 \\ud83d x"'])
def test_arguments_are_written_as_json_dumps_writes_them(text):
    """In every split; arguments given as a string are that string."""
    value = json.loads(text)
    assert {arguments_of(text, split) for split in SPLITS} == {value if isinstance(value, str) else json.dumps(value)}


def test_arguments_go_out_once_they_can_no_longer_change():
    """The closers partial_json_parser adds are held back; a number, literal or escape goes once what follows
    ends it."""
    stream = ToolCallStream({"add"}, True)
    stream.feed('<tool_call>{"name": "add", "arguments": ')
    sent = []
    for text in ['{"a": 1', ".5", ", ", '"s": [tr', 'ue, "caf\\u00', "e9", '"]', "}", "}"]:
        stream.feed(text)
        sent.append(stream.calls[0]["function"]["arguments"])
    assert sent == ["{", "{", '{"a": 1.5', '{"a": 1.5, "s": [', '{"a": 1.5, "s": [true, "caf',
                    '{"a": 1.5, "s": [true, "caf', '{"a": 1.5, "s": [true, "caf\\u00e9"]',
                    '{"a": 1.5, "s": [true, "caf\\u00e9"]}', '{"a": 1.5, "s": [true, "caf\\u00e9"]}']


@pytest.mark.parametrize("text, certain", [
    ("{a}", "{"), ('{"a" 1}', "{"), ("[1,]", "[1"), ('{"a":1,}', '{"a": 1'), ('{"a": 01}', "{"),
    ('{"s": "\x01"}', '{"s": "'), ('{"s": "ab\\x"}', '{"s": "ab'), ('{"s": "\\u12g4"}', '{"s": "'), ("[1 2]", "["),
    ('{"a":1]', "{"), ("[+1]", "["), ('{"a": 1.5.5}', "{"), ('{"a": tru}', "{")])
def test_arguments_that_are_not_json_stop_at_what_was_certain(text, certain):
    """The same in every split, and the rest of the block is not content."""
    reply = f'<tool_call>{{"name": "add", "arguments": {text}}}</tool_call>after'
    assert [read(reply, split) for split in SPLITS] == [("after", [("add", certain)])] * len(SPLITS)


def test_an_answer_cut_anywhere_reads_the_same_in_every_split():
    reply = "Intro\n" + WEATHER + "\n" + ADD + ' <tool_call>{"name": "add", "arguments": [1,]}</tool_call>'
    for end in range(0, len(reply), 7):
        results = [read(reply[:end], split) for split in SPLITS]
        assert all(r == results[0] for r in results), reply[:end]


# ---------------------------------------------------------------------------------------------- forced calls
#: a forced call's answer, as its grammar writes it: a named function's arguments, or ``required``'s array
NAMED_ARGS = '{"city": "Paris", "unit": "celsius", "days": [1, 2.50, 3e1], "note": "caf\\u00e9"}'
REQUIRED = ('[{"name": "get_weather", "parameters": ' + NAMED_ARGS + '}, '
            '{"parameters": {"a": 1, "b": -2}, "name": "add"}]')
FORCED = {"named": ({"type": "function", "function": {"name": "get_weather"}}, NAMED_ARGS, ["get_weather"]),
          "required": ("required", REQUIRED, ["get_weather", "add"])}


@pytest.mark.parametrize("name", FORCED)
def test_the_clients_stream_helper_reads_a_forced_call_as_it_comes(make_app, name):
    """As vLLM streams a forced call: its name first, then its arguments in pieces while the model writes them,
    adding up to the message of the same answer unstreamed."""
    choice, reply, names = FORCED[name]
    ai = client(make_app, reply, capabilities=OPTIONS)  # a grammar: the answer is the scripted one all the same
    ask = {"model": "demo", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
           "max_tokens": 400}
    with ai.chat.completions.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    kinds = [e.type for e in events]
    argument_deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert [e.name for e in argument_deltas if e.name == "get_weather"][5:]  # more than a few pieces
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == names and not any(e.delta for e in events if e.type == "content.delta")
    assert kinds.index("tool_calls.function.arguments.delta") < len(kinds) // 4  # from the start, not at the end
    whole = ai.chat.completions.create(**ask)
    assert message(final.choices[0]) == message(whole.choices[0])
    assert json.loads(done[0].arguments) == json.loads(NAMED_ARGS)
    assert final.choices[0].finish_reason == ("stop" if name == "named" else "tool_calls")


@pytest.mark.parametrize("name", FORCED)
def test_a_forced_call_cut_by_max_tokens_streams_what_was_certain(make_app, name):
    """Cut in its arguments, a forced call keeps them as far as they were certain, streamed or not; a
    ``required`` answer cut before its first name made no call: its text is the content."""
    choice, reply, names = FORCED[name]
    cut_in_arguments = reply.index('"days"') + 11  # after "[1,"
    ai = client(make_app, reply, capabilities=OPTIONS)
    for max_tokens, content, arguments in [(cut_in_arguments, "", '{"city": "Paris", "unit": "celsius", "days": [1'),
                                           (5, reply[:5] if name == "required" else "", "{")]:
        ask = {"model": "demo", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0, "n": 2,
               "max_tokens": max_tokens}
        whole = ai.chat.completions.create(**ask)
        streamed = accumulated(ai.chat.completions.create(**ask, stream=True))
        assert [streamed[i] for i in (0, 1)] == [message(c) for c in whole.choices]
        first = message(whole.choices[0])
        assert first["content"] == content and first["finish_reason"] == "length"
        if content:
            assert first["calls"] == {}
        else:
            assert first["calls"][0] == {"name": "get_weather", "arguments": arguments}


@pytest.mark.parametrize("split", SPLITS)
def test_a_forced_reader_reads_every_split_the_same(split):
    """Named, required with two calls, and required broken off in its array, cut anywhere."""
    for name, reply in [("get_weather", NAMED_ARGS), (None, REQUIRED), (None, '[{"name": "add", "parameters": {}} x')]:
        for end in range(0, len(reply) + 1, 3):
            text = reply[:end]
            stream, step = ForcedCallStream(name), split or max(len(text), 1)
            pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
            whole = ForcedCallStream(name)
            whole.feed(text)
            whole.finish()
            calls: dict[int, list[str]] = {}
            for p in pieces:
                for d in p.calls:
                    call = calls.setdefault(d["index"], ["", ""])
                    call[0] += d["function"].get("name", "")
                    call[1] += d["function"].get("arguments", "")
            assert "".join(p.content for p in pieces) == stream.content == whole.content
            assert [tuple(c) for c in calls.values()] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
