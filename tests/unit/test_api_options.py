"""What a stream reports (``stream_options``, as vLLM models it) and what each response says it honoured, over the
fake backend."""

from __future__ import annotations

import json

import pytest

from modeswitch.sampling_params import OPTIONS

CHAT = [{"role": "user", "content": "Hi"}]


def sse(resp) -> list[dict]:
    lines = [line for line in resp.get_data(as_text=True).split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "Hello"}),
                                         ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_options_are_modelled_and_need_a_stream(make_app, route, body):
    app = make_app()
    unknown = app.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True, "chunked": 1}})
    assert unknown.status_code == 400 and unknown.get_json()["error"]["param"] == "stream_options.chunked"
    unstreamed = app.post(route, json={**body, "stream_options": {"include_usage": True}})
    err = unstreamed.get_json()["error"]
    assert unstreamed.status_code == 400 and err["param"] == "stream_options" and "stream: true" in err["message"]
    assert app.post(route, json={**body, "max_tokens": 2, "stream_options": {}}).status_code == 200  # sets nothing


def test_usage_at_the_end_or_on_every_chunk_as_vllm_sends_it(make_app):
    app = make_app()
    body = {"prompt": "Hello", "max_tokens": 3, "n": 2, "stream": True, "temperature": 0}
    prompt = len(app.service.tokenizer("Hello").input_ids)
    plain = sse(app.post("/v1/completions", json=body))
    assert all("usage" not in c for c in plain)
    # continuous_usage_stats acts only with include_usage, as in vLLM
    alone = sse(app.post("/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": True}}))
    assert all("usage" not in c for c in alone)
    chunks = sse(app.post("/v1/completions", json={**body, "stream_options": {"include_usage": True,
                                                                               "continuous_usage_stats": True}}))
    *streamed, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6 and last["usage"]["prompt_tokens"] == prompt
    assert streamed[0]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    seen = {0: 0, 1: 0}
    for chunk in streamed[1:]:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen[choice["index"]]  # its own choice's tokens, so far
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 3, 1: 3}


def test_each_response_says_which_options_were_honoured_and_which_had_no_effect(make_app):
    app = make_app()
    sampled = app.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "temperature": 0.7, "seed": 3, "top_p": 0.9, "logprobs": True,
        "top_logprobs": 2, "user": "u1", "metadata": {"k": "v"}})
    block = sampled.get_json()["modeswitch"]
    assert block["honoured"] == ["logprobs", "max_tokens", "seed", "temperature", "top_logprobs", "top_p"]
    assert block["no_effect"] == ["metadata", "user"]
    # what a mode honours of the engine's options is on its card: the serving mode's covers the response's
    card = app.modes()[block["mode"]]["honours"]
    assert set(block["honoured"]) & OPTIONS <= set(card)
    # a greedy request: sampling settings change nothing, and the response says so
    greedy = app.complete("Hello", max_tokens=2, seed=5, top_k=4, store=False)["modeswitch"]
    assert greedy["honoured"] == ["max_tokens", "temperature"] and greedy["no_effect"] == ["seed", "store", "top_k"]
    chunks = sse(app.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True, "user": "u"}))
    blocks = [c["modeswitch"] for c in chunks if "modeswitch" in c]
    assert blocks and all(b["honoured"] == ["max_tokens", "stream"] and b["no_effect"] == ["user"] for b in blocks)


def test_a_request_body_carries_every_decoding_option_into_the_engines_parameters():
    """``to_sampling_params`` takes every :class:`SamplingParams` field the body has under the same name: each option
    set to a value other than its default arrives as it was sent (an option added to both without a conversion the
    shapes need would fail here), and ids outside the vocabulary are a 400 naming the field."""
    from dataclasses import fields

    from modeswitch.api.errors import ApiError
    from modeswitch.api.schemas import ChatBody, CompletionBody, parse
    from modeswitch.sampling_params import Constraint, SamplingParams

    sent = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {"7": 2.0}, "min_tokens": 2,
            "stop_token_ids": [9], "ignore_eos": True}
    regex = Constraint("regex", "[a-z]+")
    params = parse(CompletionBody, {"prompt": "Hi", "logprobs": 2, **sent}).to_sampling_params(100, regex)
    expected = {**sent, "logit_bias": ((7, 2.0),), "stop_token_ids": (9,), "logprobs": 2, "constraint": regex}
    assert {f.name: getattr(params, f.name) for f in fields(SamplingParams)} == {
        "max_tokens": 1, "prompt_logprobs": None, **expected}
    scoring = parse(CompletionBody, {"prompt": "Hi", "logprobs": 1, "echo": True, "max_tokens": 1})
    assert (scoring.to_sampling_params(100).logprobs, scoring.to_sampling_params(100).prompt_logprobs) == (None, 1)
    chat = parse(ChatBody, {"messages": CHAT, "logprobs": True, "top_logprobs": 3, "top_k": -1})
    assert (chat.to_sampling_params(100).logprobs, chat.to_sampling_params(100).top_k) == (3, 0)
    for field, value in (("logit_bias", {"100": 1.0}), ("stop_token_ids", [100])):
        with pytest.raises(ApiError) as err:
            parse(CompletionBody, {"prompt": "Hi", field: value}).to_sampling_params(100)
        assert err.value.status == 400 and err.value.param == field


def test_a_token_ending_inside_a_character_is_written_as_vllms_server_writes_it(make_app):
    """Byte tokens split "é" (0xC3 0xA9): the first decodes alone to U+FFFD, which vLLM's server writes as "" (the
    character is incomplete), and the second as the character it completes after the token chosen before it. The
    same across a stream's chunks (each token its own chunk), in the chat shape with each text's bytes, and for an
    alternative ending inside a character."""
    from modeswitch.testing.engine import Script

    app = make_app(scripts={"fp16": Script(reply="aé!")})
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    lp = app.post("/v1/completions", json=body).get_json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "", "é"] and lp["text_offset"] == [0, 1, 1]
    streamed = [c["choices"][0]["logprobs"] for c in sse(app.post("/v1/completions", json={**body, "stream": True}))]
    assert [t for chunk in streamed if chunk for t in chunk["tokens"]] == ["a", "", "é"]
    chat = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    content = app.post("/v1/chat/completions", json=chat).get_json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [("a", [97]), ("", []), ("é", [195, 169])]
    chunks = sse(app.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert [c["token"] for chunk in chunks if (lps := chunk["choices"][0].get("logprobs")) for c in lps["content"]] \
        == ["a", "", "é"]


def test_token_texts_follow_vllms_correction():
    """The rule alone, against the byte tokenizer: a lone continuation byte with nothing before it that completes a
    character is "", a character's last byte after its lead bytes is the whole character, an alternative is read
    against the tokens chosen before its position, and a whole token is its own text."""
    from modeswitch.api.token_text import TokenTexts
    from modeswitch.testing.tokenizer import ByteTokenizer

    texts = TokenTexts(ByteTokenizer().decode)
    euro = list("€".encode())  # three bytes
    assert texts.position(euro[0], [97]) == {euro[0]: "", 97: "a"}
    assert texts.position(euro[1], [euro[2]]) == {euro[1]: "", euro[2]: ""}
    assert texts.position(euro[2], [0xC3]) == {euro[2]: "€", 0xC3: ""}
    assert texts.position(0xA9) == {0xA9: ""}  # a continuation byte after a whole character completes nothing
    assert TokenTexts(ByteTokenizer().decode).position(0xA9) == {0xA9: ""}
