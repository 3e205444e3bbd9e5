"""What drafting would do: the n-gram replay, acceptance learned from completed requests of any mode, the
batch-first policy's rule on the speculation gain, and the features a server computes for each request (fake
backend). What a drafting step costs is the cost model's (test_costs.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from modeswitch.controller.completed import Completed
from modeswitch.controller.speculation import SpeculationModel, ngram_replay, prompt_repeat
from modeswitch.testing.engine import Script
from policy_text import feats, policy_from

LIST = [100 + i for i in range(60)]  # a prompt of 60 distinct tokens (a list to quote)
PROSE = [200 + i for i in range(12)]  # a short prompt of another kind
BATCH_FIRST = Path(__file__).resolve().parents[2] / "policies" / "batch-first.yaml"


def test_replay_counts_the_steps_prompt_lookup_would_take_and_the_tokens_it_would_draft():
    # quoting the prompt: after the first two tokens of the quote, each step accepts k=5 and adds one
    quote = LIST[:30]
    steps, drafted = ngram_replay(LIST, quote, k=5)
    assert steps <= 2 + -(-28 // 6) + 1
    assert steps < len(quote) / 3
    assert (steps - 2) * 5 <= drafted <= steps * 5  # every step after the first two drafts its bound
    # new text matches nothing: one token per step, nothing drafted
    novel = [900 + i for i in range(30)]
    assert ngram_replay(LIST, novel) == (len(novel), 0)
    # a draft that is wrong costs its step, and only the agreeing prefix counts
    edited = LIST[:10] + [999] + LIST[11:20]
    assert len(edited) / ngram_replay(LIST, edited).steps < len(LIST[:20]) / ngram_replay(LIST, LIST[:20]).steps
    # text that matches the prompt's bigrams but goes on otherwise: one token a step, and after each of its ten
    # bigrams a full proposal drafted for nothing
    echo = [t for i in range(0, 20, 2) for t in (LIST[i], LIST[i + 1], 700 + i)]
    assert ngram_replay(LIST, echo, k=5) == (len(echo), 10 * 5)


def test_prompt_repeat_is_the_share_of_trigrams_seen_before():
    assert prompt_repeat(LIST) == 0.0
    assert prompt_repeat([1, 2, 3] * 20) > 0.9
    assert prompt_repeat([5, 6]) == 0.0


def done(prompt, output, mode="int8", in_flight=None, tpot=0.02, steps=None) -> Completed:
    in_flight = in_flight or {}
    f = feats(prompt_tokens=len(prompt), queue_depth=sum(in_flight.values()), in_flight_by_mode=in_flight,
              prompt_repeat=prompt_repeat(prompt))
    return Completed(mode, f, "ok", 0.05, tpot, 0.05 + tpot * (len(output) - 1), len(prompt), len(output), 1.0,
                     "estimated", False, False, tuple(prompt), tuple(output), steps)


def test_acceptance_is_learned_from_requests_no_speculative_mode_served():
    m = SpeculationModel()
    assert m.estimate(LIST, "general").tokens_per_step == 1.0  # nothing known: drafting is not worth its cost
    for _ in range(3):  # the plain batch served them; the replay says drafting would have quoted them
        m.observe(done(LIST, LIST[:40]))
    warm = m.estimate(LIST, "general")
    assert warm.tokens_per_step > 3
    # another kind (a short prompt, another task) is not judged by the quoting kind's evidence
    assert m.estimate([7, 8, 9, 10], "general").tokens_per_step == 1.0
    assert m.estimate(LIST, "code").tokens_per_step == 1.0
    m.observe(done([7, 8, 9, 10], [500 + i for i in range(40)]))
    assert m.estimate([7, 8, 9, 10], "general").tokens_per_step == 1.0  # prose: nothing to copy
    assert m.estimate(LIST, "general").tokens_per_step == warm.tokens_per_step


def test_the_tokens_drafted_a_step_are_learned_by_kind_from_the_same_replays():
    m = SpeculationModel()
    assert m.estimate(LIST, "general").drafts_per_step is None  # not seen: the engine's measured mean stands
    m.observe(done(LIST, LIST[:30]))
    replay = ngram_replay(LIST, LIST[:30], m.k)
    assert m.estimate(LIST, "general").drafts_per_step == replay.drafted / replay.steps
    m.observe(done([7, 8, 9, 10], [500 + i for i in range(40)]))  # prose: nothing matched, nothing drafted
    assert m.estimate([7, 8, 9, 10], "general").drafts_per_step == 0.0
    assert m.describe()["drafts_per_step"]["general/2^6/repeat0"] == round(replay.drafted / replay.steps, 3)


def test_failed_scoring_and_one_token_requests_teach_nothing():
    m = SpeculationModel()
    m.observe(done(LIST, LIST[:1]))
    f = done(LIST, LIST[:40])
    m.observe(replace(f, outcome="error"))
    m.observe(replace(f, scoring=True))
    assert m.describe()["requests"] == 0


def test_batch_first_speculates_only_when_it_pays():
    policy = policy_from(BATCH_FIRST.read_text())
    choice = policy.choose(feats(speculation_gain=2.5, prefix_cache_batched=1), {})
    assert choice.mode == "int8+speculative" and choice.rule == "speculate-when-it-pays"
    assert policy.choose(feats(speculation_gain=1.0, prefix_cache_batched=1), {}).mode == "int8+prefix_cache"
    # a gain not computed for the request (its features taken under a policy that tests none) meets no rule
    assert policy.choose(feats(prefix_cache_batched=1), {}).mode == "int8+prefix_cache"
    assert policy.tested_features >= {"speculation_gain", "prefix_cache_batched"}
    # a shared prefix is read where it is held, the speculative engine's cache included
    held = feats(speculation_gain=2.5, prefix_match_tokens=500, prefix_match_ratio=0.9,
                 prefix_match_by_mode={"int8+speculative": 500, "int8+prefix_cache": 0})
    assert policy.choose(held, {}).mode == "int8+speculative"


def test_the_server_learns_and_routes_copying_requests_to_drafting(make_app):
    modes = ["int8+prefix_cache", "int8+speculative", "fp16"]
    app = make_app(modes=modes, policy=BATCH_FIRST.read_text(), scripts={m: Script(batch=4) for m in modes})
    costs = app.service.costs
    assert costs.binding.pairs == {"int8+speculative": "int8+prefix_cache"}
    assert costs.binding.streams["int8+speculative"] == "int8+speculative drafting"
    # both engines measured: a drafting step costs 1.2x a plain one on each's own lane
    for stream, step in (("int8+prefix_cache", 0.010), ("int8+speculative drafting", 0.012)):
        costs.add_prefill(stream, 16, 0.01)
        costs.add_step(stream, 1, step)
    # prose, nothing learned yet: the batch, and the request's own answer is replayed once it is done
    first = app.complete(PROSE, max_tokens=24)
    assert first["modeswitch"]["mode"] == "int8+prefix_cache", first["modeswitch"]["reason"]
    assert first["modeswitch"]["features_us"] > 0
    assert first["modeswitch"]["features"]["draft_tokens_per_step"] == 1.0
    assert first["modeswitch"]["features"]["drafts_per_step"] is None  # its kind not seen yet
    assert app.modes()["int8+speculative"]["status"] == "available"
    assert app.get("/v1/modes").get_json()["speculation"]["requests"] == 1
    # requests of a kind whose answers quoted their prompts: drafting is predicted to pay, and is chosen
    for _ in range(2):
        app.service.speculation.observe(done(LIST, LIST[:40]))
    quoted = app.complete(LIST, max_tokens=24)["modeswitch"]
    assert quoted["mode"] == "int8+speculative", quoted["reason"]
    assert quoted["features"]["speculation_gain"] >= 1.1 and "speculate-when-it-pays" in quoted["reason"]
    assert quoted["features"]["drafts_per_step"] > 3  # a quote drafts its bound nearly every step
    prose = app.complete(PROSE, max_tokens=24)["modeswitch"]
    assert prose["mode"] == "int8+prefix_cache", prose["reason"]
    assert prose["features"]["draft_tokens_per_step"] < 1.5
