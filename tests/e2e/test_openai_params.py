"""Every OpenAI parameter is honoured by the mode that serves it, or refused with a 400 naming it.

The fake backend checks the API's own logic (refusals, ``n``, logprobs shapes, the capability gate); the official
``openai`` client then checks each option on the real engines: the transformers server and the vLLM server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from openai import BadRequestError, OpenAI
from pydantic import BaseModel
from transformers.generation.logits_process import LogitsProcessorList

from modeswitch.api import tools
from modeswitch.api.errors import ApiError
from modeswitch.api.schemas import ChatBody, parse
from modeswitch.sampling_params import SamplingParams
from modeswitch.engines.transformers.processors import Decoding
from modeswitch.testing.engine import Script
from openai_checks import assert_most_likely

CHAT = [{"role": "user", "content": "Describe a cat in one sentence."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]


def sse(resp) -> list[dict]:
    lines = [line for line in resp.get_data(as_text=True).split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---------------------------------------------------------------------------------------------- the API's logic
def test_unknown_fields_are_refused_and_no_effect_fields_documented_and_accepted(make_app):
    app = make_app()
    bad = app.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logit_bais": {"1": 2}})
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "logit_bais"
    for field, why in (("best_of", "n choices"), ("functions", "tools"), ("suffix", "not supported")):
        err = app.post("/v1/completions", json={"prompt": "x", field: 2}).get_json()["error"]
        assert err["param"] == field and why in err["message"], err
    nested = app.post("/v1/chat/completions", json={"messages": [{**CHAT[0], "weight": 1}]})
    assert nested.status_code == 400 and nested.get_json()["error"]["param"] == "messages.0.weight"
    ok = app.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "user": "u1",
                                                 "metadata": {"k": "v"}, "store": False, "temperature": 0})
    assert ok.status_code == 200, ok.get_data(as_text=True)
    schema = app.get("/openapi.json").get_json()["components"]["schemas"]
    assert schema["ChatBody"]["additionalProperties"] is False
    assert {"seed", "logit_bias", "response_format", "tools", "tool_choice", "top_logprobs", "min_tokens",
            "structured_outputs"} <= set(schema["ChatBody"]["properties"])
    assert "no effect" in schema["ChatBody"]["properties"]["user"]["description"]


def test_n_choices_each_answered_and_streamed_side_by_side(make_app):
    app = make_app()
    body = app.complete("Hello", max_tokens=4, n=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == len(app.service.tokenizer("Hello").input_ids)  # once, not per choice
    assert body["usage"]["completion_tokens"] == 12
    chunks = sse(app.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "n": 2, "stream": True,
                                                   "temperature": 0, "stream_options": {"include_usage": True}}))
    texts, finished = {0: "", 1: ""}, {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    assert texts[0] == texts[1] == body["choices"][0]["text"] and finished == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(m["in_flight"] == 0 for m in app.modes().values())


def test_generated_logprobs_in_both_shapes_whole_and_streamed(make_app):
    app = make_app()
    body = app.complete("Hello", max_tokens=3, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == body["choices"][0]["text"] and lp["token_logprobs"] == [-1.0] * 3
    assert all(len(top) == 2 and max(top.values()) == -1.0 for top in lp["top_logprobs"])
    assert lp["text_offset"] == [0, 1, 2]
    chat = app.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                   "logprobs": True, "top_logprobs": 2}).get_json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == chat["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    chunks = sse(app.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                         "logprobs": True, "stream": True}))
    streamed = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert all(e["top_logprobs"] == [] for e in streamed)  # top_logprobs not asked for: none


def test_a_mode_that_cannot_honour_an_option_is_filtered_and_named_when_pinned(make_app):
    app = make_app(modes=("fp16", "continuous_batching"),
                   scripts={"fp16": Script(capabilities=frozenset({"temperature", "logprobs"}))})
    pinned = app.post("/v1/completions", json={"prompt": "x", "mode": "continuous_batching", "temperature": 0.7,
                                               "seed": 3, "max_tokens": 2}).get_json()["error"]
    assert pinned["param"] == "mode" and "cannot honour seed, temperature" in pinned["message"]
    served = app.post("/v1/completions", json={"prompt": "x", "temperature": 0.7, "max_tokens": 2})
    assert served.headers["X-ModeSwitch-Mode"] == "fp16"
    nobody = app.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frequency_penalty": 1.0})
    err = nobody.get_json()["error"]
    assert nobody.status_code == 400 and err["code"] == "unsupported_option" and "frequency_penalty" in err["message"]
    greedy = app.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0, "seed": 3})
    assert greedy.status_code == 200  # a seed changes nothing in greedy decoding: any mode serves it


def test_penalties_apply_as_vllm_applies_them():
    """Presence and frequency over the generated tokens only, subtracted; repetition over prompt and output."""
    logits = torch.zeros(1, 6)
    ids = torch.tensor([[4, 5, 1, 1, 2]])  # a 2-token prompt (4, 5), then 1, 1, 2 generated
    out = Decoding(SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=0.25), 2, {0}, None) \
        .processors(ids, logits.clone())
    assert out[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0]
    rep = Decoding(SamplingParams(max_tokens=4, repetition_penalty=2.0), 2, {0}, None)
    assert rep.processors(ids, torch.full((1, 6), 2.0))[0].tolist() == [2.0, 1.0, 1.0, 2.0, 1.0, 1.0]


def vllm_sampled(logits: torch.Tensor, prompt: list[int], output: list[int], generator: torch.Generator | None = None,
                 **options) -> tuple[torch.Tensor, int]:
    """One row of logits through vLLM's own v1 sampler code (``vllm/v1/sample/sampler.py``) as its engine runs it:
    the logits processors and penalties, then for a sampled request temperature, ``min_p`` and top-k/top-p, then its
    CPU pick. Returns the logits it picks from (its ``processed_logits`` mode) and the token it picks, drawing from
    ``generator`` (a seeded request's, as its model runner makes it: a CPU generator given ``manual_seed``)."""
    import types

    from vllm import SamplingParams as VllmParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    params = VllmParams(max_tokens=4, **options)
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=1))
    procs = [LogitBiasLogitsProcessor(None, torch.device("cpu"), False),
             MinPLogitsProcessor(config, torch.device("cpu"), False)]
    for proc in procs:
        proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, prompt, output)], moved=[]))
    greedy = params.temperature < 1e-5
    meta = SamplingMetadata(  # as vLLM's input batch builds it: top-k and top-p None when no request sets them
        temperature=None if greedy else torch.tensor([params.temperature]), all_greedy=greedy, all_random=not greedy,
        top_p=torch.tensor([params.top_p]) if params.top_p < 1.0 else None,
        top_k=torch.tensor([params.top_k]) if params.top_k > 0 else None,
        generators={} if generator is None else {0: generator}, max_num_logprobs=None, no_penalties=False,
        prompt_token_ids=torch.tensor([prompt]), frequency_penalties=torch.tensor([params.frequency_penalty]),
        presence_penalties=torch.tensor([params.presence_penalty]),
        repetition_penalties=torch.tensor([params.repetition_penalty]), output_token_ids=[output],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(procs))
    sampler = Sampler(logprobs_mode="processed_logits")
    out = sampler.apply_logits_processors(logits[None].clone(), meta, False)
    if greedy:
        return out[0], int(out[0].argmax())
    token, processed = sampler.sample(out, meta)
    return processed[0], int(token[0])


def test_options_apply_in_vllms_order():
    """A biased token that was already generated is penalised after its bias, as vLLM's sampler does it:
    (1.0 + 3.0) / 2 = 2.0 (penalised first it would be 1.0 / 2 + 3.0 = 3.5); a sampled request's min_p, top-k and
    top-p leave what vLLM's leave. Each is checked against vLLM's own sampler code on the same logits."""
    pytest.importorskip("vllm")
    prompt, output = [4, 5], [1, 1, 2]
    ids = torch.tensor([prompt + output])
    logits = torch.tensor([0.5, 1.0, 2.0, -0.5, 1.0, 0.0, -1.0, 3.0])
    greedy = dict(logit_bias={1: 3.0, 6: 2.0}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    ours = Decoding(SamplingParams(max_tokens=4, **{**greedy, "logit_bias": tuple(greedy["logit_bias"].items())}),
                    len(prompt), {0}, None).processors(ids, logits[None].clone())[0]
    assert ours[1] == (1.0 + 3.0) / 2 - 2 * 0.5 - 0.25
    assert torch.allclose(ours, vllm_sampled(logits, prompt, output, **greedy)[0])
    torch.manual_seed(0)
    wide = torch.randn(64) * 3
    sampled = dict(temperature=2.0, min_p=0.05, top_k=20, top_p=0.8, repetition_penalty=1.3)
    pick = Decoding(SamplingParams(max_tokens=4, **sampled), len(prompt), {0}, None).processors
    assert type(pick[-1]).__name__ == "_Pick"  # what it samples from is what comes before it
    before_pick = LogitsProcessorList(pick[:-1])(ids, wide[None].clone())[0]
    theirs = vllm_sampled(wide, prompt, output, **sampled)[0]
    assert torch.equal(before_pick.isfinite(), theirs.isfinite())
    assert torch.allclose(before_pick[theirs.isfinite()], theirs[theirs.isfinite()])


def test_a_step_that_drafted_nothing_is_not_constrained():
    """vLLM's rejection sampler constrains its drafted positions by top-k even when there are none: its CPU top-k
    path then fails (it killed a speculating engine's core, for a request with top_k alone); ModeSwitch's engines
    return an empty batch of drafted positions as it is."""
    pytest.importorskip("vllm")
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from modeswitch.engines.vllm import drafting

    nothing_drafted = torch.empty(0, 8)
    with pytest.raises(RuntimeError, match="numel"):  # what the rejection sampler calls, with k over no position
        apply_top_k_top_p(nothing_drafted.clone(), torch.empty(0, dtype=torch.long), None)
    drafting.fix_empty_drafts()
    assert rejection_sampler.apply_sampling_constraints(nothing_drafted, torch.tensor([0]), None) is nothing_drafted


def test_seeded_sampling_draws_from_the_requests_own_generator():
    logits = torch.zeros(50)
    draws = [[Decoding(SamplingParams(max_tokens=1, temperature=1.0, seed=s), 0, set(), None).choose([1], logits)
              for _ in range(3)] for s in (1, 1, 2)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


@pytest.mark.parametrize("options", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_k=20, min_p=0.05),
                                     dict(temperature=1.5)], ids=["top_p", "top_k+min_p", "plain"])
def test_a_seed_picks_the_tokens_vllms_sampler_picks(options):
    """Given the same logits, a seeded request's every token is the one vLLM's CPU sampler picks with that seed:
    the same integer drawn from the request's generator each step, the same noise hashed from it, the same filters
    before. 40 steps of one request over a 32,000-token vocabulary, many tokens possible at each."""
    pytest.importorskip("vllm")
    torch.manual_seed(3)
    rows = torch.randn(40, 32000) * 3
    prompt, output, ours = [4, 5], [], []
    decoding = Decoding(SamplingParams(max_tokens=40, seed=7, **options), len(prompt), set(), None)
    theirs = torch.Generator().manual_seed(7)
    for row in rows:
        ours.append(decoding.choose(prompt + ours, row))
        output.append(vllm_sampled(row, prompt, output, theirs, **options)[1])
    assert ours == output and len(set(ours)) > 20  # sampled, not one likeliest token


def test_gumbel_argmax_is_vllms_kernel():
    """:func:`gumbel_argmax` against vLLM's C++ ``fused_gumbel_argmax`` (what its CPU sampler calls), row by row: wide
    and narrow logits, rows masked to a few tokens by a filter, a row all -inf, vocabularies of 7 to 151,936."""
    pytest.importorskip("vllm.v1.sample.sampler")  # which loads vLLM's kernels for this CPU

    from modeswitch.engines.draws import SEED_BOUND, gumbel_argmax

    torch.manual_seed(0)
    for vocab in (7, 32000, 151936):
        for scale in (0.3, 3.0, 30.0):
            logits = torch.randn(16, vocab) * scale
            logits[1, 5:] = -float("inf")
            logits[2] = -float("inf")
            seeds = torch.randint(0, SEED_BOUND, (16,))
            theirs = torch.ops._C.fused_gumbel_argmax(logits, seeds).tolist()
            assert [gumbel_argmax(row, int(seed)) for row, seed in zip(logits, seeds)] == theirs


def test_a_sampled_verify_step_keeps_the_tokens_vllms_rejection_sampler_keeps():
    """The owned loop's verify step against vLLM's sampler and rejection sampler on n-gram drafts (no draft
    probabilities), as ModeSwitch's vLLM engines run them (``vllm_rejection.py``): the same generator draws in the
    same order give the same accepted drafts, correction and bonus token, in 300 steps of three drafts each."""
    pytest.importorskip("vllm")
    from modeswitch.engines.static.sampling import accept
    from modeswitch.serving.launcher import ROOT

    torch.manual_seed(0)
    cases = []
    for seed in range(300):
        logits = torch.randn(4, 64) * 2
        drafts = torch.randint(0, 64, (3,)).tolist()
        drafts[0] = int(logits[0].argmax())  # a likely draft, often accepted
        cases.append({"logits": logits.tolist(), "drafts": drafts, "seed": seed, "temperature": 0.8,
                      "top_p": 0.9 if seed % 3 else None})
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_rejection.py"))], input=json.dumps(cases),
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout)
    ours = [accept(torch.tensor(c["logits"]), c["drafts"], SamplingParams(
        max_tokens=8, temperature=c["temperature"], top_p=c["top_p"] or 1.0), torch.Generator().manual_seed(c["seed"]))
        for c in cases]
    assert ours == theirs
    assert sum(len(tokens) - 1 for tokens in ours) > 100  # drafts were accepted, not only corrected


def test_tools_reach_a_template_without_tool_support_and_auto_calls_are_parsed():
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}], "tools": TOOLS}
    req = parse(ChatBody, body)
    rendered, extra = tools.messages(req, native=False)
    assert extra == {} and rendered[0]["role"] == "system" and '"get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    native, extra = tools.messages(req, native=True)
    assert extra["tools"][0]["function"]["name"] == "get_weather" and native[1]["tool_calls"][0]["function"][
        "arguments"] == {"city": "Oslo"} and native[2]["tool_call_id"] == "c1"
    content, calls = tools.parse(req, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Bergen", "unit": "celsius"}}\n</tool_call>')
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"])["city"] == "Bergen"
    assert tools.parse(req, "<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert tools.parse(req, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')[1] == []  # not offered
    assert tools.constraint(req) is None  # auto: the model may answer in text
    forced = parse(ChatBody, {**body, "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(tools.constraint(forced).spec)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    with pytest.raises(ApiError, match="not in tools"):
        parse(ChatBody, {**body, "tool_choice": {"type": "function", "function": {"name": "other"}}})


# ---------------------------------------------------------------------------------------------- real engines
class Cat(BaseModel):
    name: str
    age: int


def honoured_everywhere(client: OpenAI) -> None:
    """What both engines must do, asked through the official client, wherever the controller sends it (each
    decoding option pinned to each mode: ``test_options_matrix.py``)."""
    # n and logprobs: sampled (the chosen token is often not the likeliest) and greedy (it is)
    two = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=1.0, seed=1, n=2,
                                         logprobs=True, top_logprobs=3)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].message.content != two.choices[1].message.content
    for choice in two.choices:
        assert len(choice.logprobs.content) == 6
        for e in choice.logprobs.content:
            assert_most_likely(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs], 3)
    greedy_lp = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert all(e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token for e in greedy_lp)
    legacy = client.completions.create(model="demo", prompt="My favourite animal is", max_tokens=6, temperature=1.0,
                                       seed=3, logprobs=4).choices[0].logprobs
    for token, logprob, top in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs):
        assert_most_likely(token, logprob, list(top.items()), 4, by_text=True)
    # structured outputs: the client's pydantic helper, json_object, a regex and a choice. The helper's request is
    # pinned to the reference weights: the test servers run without the quality gate, and the demo's GPTQ weights
    # (which fail it) answer this prompt with whitespace inside the object until max_tokens
    parsed = client.chat.completions.parse(model="demo", response_format=Cat, max_tokens=64, temperature=0,
                                           messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                           extra_body={"mode": "fp16"})
    assert isinstance(parsed.choices[0].message.parsed, Cat)
    obj = client.chat.completions.create(model="demo", max_tokens=200, temperature=0, messages=[{
        "role": "user", "content": "Describe a cat as a JSON object with the keys name and age."}],
        response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":  # a grammar ends the object; max_tokens may cut a model that loops keys
        assert isinstance(json.loads(content), dict)
    else:
        assert obj.choices[0].finish_reason == "length" and content.lstrip().startswith("{"), content
    digits = client.completions.create(model="demo", prompt="A phone number:", max_tokens=20, temperature=0,
                                       logprobs=3, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert len(digits.choices[0].text) == 8 and digits.choices[0].text[3] == "-"
    # logprobs under the grammar's mask, as vLLM reads them: after three digits "-" is the one token allowed (the
    # demo's tokenizer has no "-" + digit token), and the forbidden ones are written as vLLM's server writes -inf
    dash = digits.choices[0].logprobs
    assert dash.tokens[3] == "-" and abs(dash.token_logprobs[3]) < 1e-6
    allowed, *forbidden = dash.top_logprobs[3].values()
    assert abs(allowed) < 1e-6 and forbidden and set(forbidden) == {-9999.0}
    yes_no = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Is the sky green?"}],
                                            max_tokens=4, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert yes_no.choices[0].message.content in ("yes", "no")
    # tools: a forced call has valid arguments; its result goes back; the model then answers. One call each: the
    # grammar of "required" admits any number, and the demo may repeat its call until max_tokens cuts the array
    # (it did on the AVX2 machine's vLLM arithmetic)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        call = client.chat.completions.create(model="demo", messages=ask, tools=TOOLS, tool_choice=choice,
                                              parallel_tool_calls=False, max_tokens=128, temperature=0)
        message = call.choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
        assert call.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    answer = client.chat.completions.create(model="demo", tools=TOOLS, max_tokens=16, temperature=0, messages=[
        *ask, message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temperature": 21}'}])
    assert answer.choices[0].message.content
    streamed = list(client.chat.completions.create(model="demo", messages=ask, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, max_tokens=128, temperature=0,
                                                   stream=True))
    calls = [tc for chunk in streamed for c in chunk.choices for tc in (c.delta.tool_calls or ())]
    # the call's name first, then its arguments in pieces as the model writes them
    assert calls[0].function.name == "get_weather" and len(calls) > 2
    assert json.loads("".join(tc.function.arguments or "" for tc in calls if tc.index == 0))["city"]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def transformers_client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_every_option_is_honoured_on_the_transformers_engine(transformers_client):
    honoured_everywhere(transformers_client)


def test_transformers_modes_that_cannot_constrain_are_never_chosen_for_a_grammar(transformers_client):
    raw = transformers_client.chat.completions.with_raw_response.create(
        model="demo", messages=CHAT, max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert raw.headers["X-ModeSwitch-Mode"] not in ("speculative", "continuous_batching")
    with pytest.raises(BadRequestError) as exc:  # transformers' speculative path cannot follow a grammar
        transformers_client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4,
                                                    response_format={"type": "json_object"},
                                                    extra_body={"mode": "speculative"})
    assert "structured_outputs" in str(exc.value)


@pytest.fixture(scope="module")
def vllm_client(vllm_server) -> OpenAI:
    return OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0)


def test_every_option_is_honoured_on_the_vllm_engine(vllm_client):
    honoured_everywhere(vllm_client)


def test_vllm_speculative_modes_refuse_what_vllm_refuses_with_drafting(vllm_client):
    with pytest.raises(BadRequestError) as exc:
        vllm_client.completions.create(model="demo", prompt="x", max_tokens=2, logit_bias={"28": 5},
                                       extra_body={"mode": "speculative"})
    assert "logit_bias" in str(exc.value)
    drafted = vllm_client.completions.with_raw_response.create(
        model="demo", prompt="one two three one two three one two", max_tokens=8, temperature=0, logprobs=1,
        extra_body={"mode": "speculative"})
    assert drafted.headers["X-ModeSwitch-Mode"] == "speculative"
    assert len(drafted.parse().choices[0].logprobs.tokens) == 8
    constrained = vllm_client.chat.completions.create(  # vLLM drafts under a grammar
        model="demo", messages=CHAT, max_tokens=40, temperature=0, extra_body={"mode": "speculative", "structured_outputs": {
            "choice": ["a cat", "a dog"]}})
    assert constrained.choices[0].message.content in ("a cat", "a dog")
