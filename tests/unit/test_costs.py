"""The cost model (measured curves, predictions, persistence) and the default policy that orders modes by it: on
the fake backend, engines whose costs differ by a factor the test sets, measured by the server's own calibration."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import requests

from modeswitch.controller.completed import Completed
from modeswitch.controller.costs import Binding, CostModel, stream_key
from modeswitch.controller.curves import MIN_FIT, Curve, StreamCosts
from modeswitch.resources import DEFAULT_POLICY
from modeswitch.yamlconf import ConfigError
from modeswitch.testing.engine import Script
from openai_checks import generating
from policy_text import feats, policy_from, shipped_run

FASTEST = DEFAULT_POLICY.read_text()
#: the default without exploring: what the prediction alone chooses
PREDICTED_ONLY = "\n".join(line for line in FASTEST.splitlines() if not line.startswith("explore:"))


def test_a_curve_interpolates_between_measured_buckets_and_extends_the_last_slope():
    curve = Curve()
    assert curve.at(4) is None and not curve.measured
    curve.add(1, 0.010)
    assert curve.at(1) == curve.at(100) == pytest.approx(0.010)  # one point: flat
    curve.add(4, 0.016)
    assert curve.at(2) == pytest.approx(0.012)  # a third of the way from 1 to 4
    assert curve.at(0.5) == pytest.approx(0.010 - 0.002 * 0.5)  # the first slope below the first
    assert curve.at(8) == pytest.approx(0.016 + 0.002 * 4)  # the last slope beyond the last
    assert curve.samples(4) == 1 and curve.samples(16) == 0
    assert curve.at(5) == pytest.approx(0.018)  # read once before the samples below: a sample changes what is read
    for _ in range(200):  # a bucket follows its recent samples
        curve.add(5, 0.050)
    assert curve.at(5) == pytest.approx(0.050, rel=0.01)


def test_below_its_first_bucket_a_curve_follows_the_slope_to_a_bucket_twice_its_size_never_to_nothing():
    """A step bucket whose requests mostly ran beside others means more than one request: a lone request is read
    below it. The slope is taken to a bucket at least twice as large (two close means make a steep, noisy slope),
    and never takes a cost below the first bucket's in proportion to size."""
    curve = Curve()
    for load, seconds in ((1.4, 0.030), (2.1, 0.040), (4.5, 0.046)):  # a noisy pair: 14 ms a request between them
        curve.add(load, seconds)
    assert curve.at(1) == pytest.approx(0.030 - (0.046 - 0.030) / (4.5 - 1.4) * 0.4)  # 2.1 is not twice 1.4
    steep = Curve()
    steep.add(10, 0.010)
    steep.add(20, 0.100)
    assert steep.at(5) == pytest.approx(0.005)  # the slope would leave less than half at half the size
    falling = Curve()
    falling.add(1.5, 0.030)
    falling.add(4, 0.020)
    assert falling.at(1) == pytest.approx(0.030)  # never rising toward smaller sizes
    lone = Curve()
    lone.add(1.5, 0.030)
    lone.add(2.5, 0.050)
    assert lone.at(1) == pytest.approx(0.030)  # no bucket twice its size: flat


def test_an_unmeasured_stream_predicts_nothing_and_a_measured_one_by_its_curves():
    costs = CostModel()
    costs.bind(Binding(streams={"a": "a", "b": "b"}, lanes={"a": "0", "b": "1"}, engines={"a": "a", "b": "b"},
                       slots={"a": 4, "b": 4}))
    assert costs.predict("a", feats()) is None
    costs.add_prefill("a", 100, 0.2)
    assert costs.predict("a", feats()) is None  # prefill alone is not enough
    costs.add_step("a", 1, 0.01)
    costs.add_step("a", 2, 0.02)
    alone = costs.predict("a", feats(prompt_tokens=100, max_tokens=11))
    assert alone.prefill_s == pytest.approx(0.2) and alone.decode_s == pytest.approx(10 * 0.01)
    assert alone.delay_s == 0 and alone.total == pytest.approx(0.3)
    # one request already on its lane (another mode of the lane counts too): its steps cost 0.02 now, and the
    # request adds its prefill less the step the one already there takes all the same (0.01), and 10 x 0.01 of
    # step growth
    busy = costs.predict("a", feats(prompt_tokens=100, max_tokens=11, in_flight_by_mode={"a": 1}))
    assert busy.decode_s == pytest.approx(10 * 0.02) and busy.delay_s == pytest.approx(0.2 - 0.01 + 10 * 0.01)
    # another lane's load is not this lane's
    assert costs.predict("a", feats(prompt_tokens=100, max_tokens=11, in_flight_by_mode={"b": 3})).delay_s == 0


def test_prompts_not_computed_yet_on_the_lane_are_computed_before_a_new_one():
    """A burst's prompts are computed one after another: a request joining a lane whose requests have 300 prompt
    tokens still to compute waits for them (its prefill is read at 300 + its own), and delays the requests there
    by its own share only; a finished request's time to first token is learned at the tokens it waited behind."""
    costs = CostModel()
    costs.bind(Binding(streams={"a": "a", "b": "b"}, lanes={"a": "0", "b": "1"}, engines={"a": "a", "b": "b"},
                       slots={"a": 8, "b": 8}))
    for stream in ("a", "b"):
        costs.add_prefill(stream, 100, 0.1)
        costs.add_prefill(stream, 400, 0.4)
        costs.add_step(stream, 1, 0.01)
    behind = costs.predict("a", feats(prompt_tokens=100, max_tokens=1, in_flight_by_mode={"a": 3},
                                      prefilling_by_mode={"a": 300}))
    assert behind.prefill_s == pytest.approx(0.4) and behind.delay_s == pytest.approx(3 * 0.1)
    other = costs.predict("b", feats(prompt_tokens=100, max_tokens=1, prefilling_by_mode={"a": 300}))
    assert other.prefill_s == pytest.approx(0.1)
    costs.observe(Completed("b", feats(prompt_tokens=100, in_flight_by_mode={"b": 1}, prefilling_by_mode={"b": 300}),
                            "ok", 0.8, None, 1.0, 100, 1, 1.0, "estimated", False, False))
    assert costs.stream("b").prefill.samples(400) == 2 and costs.stream("b").prefill.samples(100) == 1
    assert not costs.stream("b").join.measured  # it waited for the prompts queued, not for a step in flight


def test_a_prompt_that_finds_its_engine_busy_is_learned_and_predicted_apart_from_one_on_an_idle_engine():
    """A first token on an idle engine teaches the prefill curve; on one decoding with no prompt queued (within its
    batch), what it took over that curve, by the requests it found (``join``): the step in flight it waited for. A
    prediction adds it on such an engine only, to the request's own time, not to what its prompt stalls the others
    by; never below nothing. A request that found the batch full waited for a slot, which ``wait`` predicts:
    neither curve learns from it."""
    costs = CostModel()
    costs.bind(Binding(streams={"a": "a"}, lanes={"a": "0"}, engines={"a": "a"}, slots={"a": 2}))
    costs.add_step("a", 1, 0.01)
    costs.add_step("a", 2, 0.02)

    def finished(ttft: float, running: int) -> Completed:
        return Completed("a", feats(prompt_tokens=100, in_flight_by_mode={"a": running}), "ok", ttft, None, ttft,
                         100, 1, 1.0, "estimated", False, False)

    costs.observe(finished(0.09, 1))  # busy before anything idle was measured: nothing to take it over
    assert not costs.stream("a").join.measured and not costs.stream("a").prefill.measured
    costs.observe(finished(0.10, 0))
    costs.observe(finished(0.15, 1))
    costs.observe(finished(0.50, 2))  # the batch (2) was full: it waited for a slot
    a = costs.stream("a")
    assert a.prefill.at(100) == pytest.approx(0.10) and a.prefill.samples(100) == 1
    assert a.join.at(1) == pytest.approx(0.05) and a.join.samples(1) == 1 and a.join.samples(2) == 0
    idle = costs.predict("a", feats(prompt_tokens=100, max_tokens=1))
    busy = costs.predict("a", feats(prompt_tokens=100, max_tokens=1, in_flight_by_mode={"a": 1}))
    assert idle.prefill_s == pytest.approx(0.10) and busy.prefill_s == pytest.approx(0.15)
    assert busy.delay_s == pytest.approx(0.10 - 0.01)  # its prompt's marginal time over their step, as before
    behind = costs.predict("a", feats(prompt_tokens=100, max_tokens=1, in_flight_by_mode={"a": 1},
                                      prefilling_by_mode={"a": 100}))
    assert behind.prefill_s == pytest.approx(a.prefill.at(200))  # behind a prompt queued: the prefill curve's
    costs.observe(finished(0.02, 1))  # a faster one pulls the mean down (signed), and a prediction never goes below
    costs.observe(finished(0.02, 1))
    assert a.join.at(1) < 0
    assert costs.predict("a", feats(prompt_tokens=100, max_tokens=1, in_flight_by_mode={"a": 1})).prefill_s \
        == pytest.approx(0.10)
    assert StreamCosts.load(a.dump()).join.dump() == a.join.dump()


def test_requests_near_their_end_count_by_the_share_of_a_new_request_they_run_beside():
    """Engine ``a`` runs 6 requests with 2 tokens left each, ``b`` 3 that have just started, both slower by half a
    step per request: counted whole, a new request of 24 tokens would meet 6 on ``a`` for all its steps and slow
    all of theirs, and ``b`` is predicted first; counted by the share of its tokens each may still generate beside
    it (6 x 2 / 24 on ``a``, 3 x 24 / 24 on ``b``: what a burst's last requests look like), ``a`` is."""
    costs = CostModel()
    costs.bind(Binding(streams={"a": "a", "b": "b"}, lanes={"a": "0", "b": "1"}, engines={"a": "a", "b": "b"},
                       slots={"a": 8, "b": 8}))
    for stream in ("a", "b"):
        costs.add_prefill(stream, 10, 0.05)
        for load in (1, 2, 4, 8):
            costs.add_step(stream, load, 0.010 + 0.005 * (load - 1))
    whole = feats(prompt_tokens=10, max_tokens=24, in_flight_by_mode={"a": 6, "b": 3})
    assert costs.predict("b", whole).total < costs.predict("a", whole).total
    assert costs.predict("a", whole).decode_s == pytest.approx(23 * 0.040)  # its steps at 7 requests
    near_end = replace(whole, decode_overlap_by_mode={"a": 6 * 2 / 24, "b": 3.0})
    a, b = costs.predict("a", near_end), costs.predict("b", near_end)
    assert a.total < b.total
    # its steps at the mean load they meet (itself and half a request's worth of the 6); its prompt stalls all 6
    # by its prefill less the step they take all the same (at 6), and each of its steps lengthens theirs by the
    # step's growth at 7 only while they run (2 of its 24 tokens each)
    assert a.decode_s == pytest.approx(23 * (0.010 + 0.005 * 0.5))
    assert a.delay_s == pytest.approx(6 * (0.05 - 0.035) + 0.5 * 23 * 0.005)
    assert b.decode_s == pytest.approx(23 * 0.025) and b.delay_s == pytest.approx(3 * (0.05 - 0.02) + 3 * 23 * 0.005)


def test_a_prompt_stalls_a_busy_engine_by_its_marginal_time_with_or_without_prompts_queued():
    """Two engines of 4 running requests each, ``a`` with a 256-token prompt queued, ``b`` with none: a new prompt
    stalls the requests of either by what it adds to their next step, its prefill less what that step costs
    without it (the queued prompt's on ``a``, a plain step on ``b``). Counted from nothing on ``b``, an engine
    with a prompt queued looked cheaper to join by a whole step per request, and a burst's returning clients
    piled onto it."""
    costs = CostModel()
    costs.bind(Binding(streams={"a": "a", "b": "b"}, lanes={"a": "0", "b": "1"}, engines={"a": "a", "b": "b"},
                       slots={"a": 8, "b": 8}))
    for stream in ("a", "b"):
        for tokens in (64, 256, 512, 1024):
            costs.add_prefill(stream, tokens, 0.02 + 0.001 * tokens)
        for load in (1, 2, 4, 8):
            costs.add_step(stream, load, 0.02)
    f = feats(prompt_tokens=256, max_tokens=2, in_flight_by_mode={"a": 4, "b": 4}, prefilling_by_mode={"a": 256})
    a, b = costs.predict("a", f), costs.predict("b", f)
    assert a.delay_s == pytest.approx(4 * 0.256) and b.delay_s == pytest.approx(4 * 0.256)
    assert a.prefill_s == pytest.approx(0.532) and b.prefill_s == pytest.approx(0.276) and b.total < a.total
    # an idle engine's step would not run without it: its whole prefill is new work for its lane
    idle = costs.predict("b", replace(f, in_flight_by_mode={"a": 4}))
    assert idle.delay_s == 0 and idle.prefill_s == pytest.approx(0.276)

def test_a_request_sees_how_many_tokens_the_requests_in_flight_have_left(make_app):
    """``decode_overlap_by_mode``: a request of 10 tokens beside one with 200 to go counts it whole; one of 2000
    tokens counts it by the share of its own it will run beside (under 200 / 2000); once it ends, nothing."""
    app = make_app(modes=["prefix_cache", "fp16"], scripts={"prefix_cache": Script(token_s=0.02), "fp16": Script()})
    url = app.serve()
    body = {"prompt": "A very long story", "max_tokens": 200, "mode": "prefix_cache", "stream": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
        assert generating(resp)
        short = app.complete("Another", max_tokens=10, mode="fp16")["modeswitch"]["features"]
        long = app.complete("Another", max_tokens=2000, mode="fp16")["modeswitch"]["features"]
    assert short["decode_overlap_by_mode"] == {"prefix_cache": 1.0}
    assert 0.05 < long["decode_overlap_by_mode"]["prefix_cache"] < 0.1
    deadline = time.monotonic() + 10  # the stream hung up: its generation is cancelled
    while any(app.service.running.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert app.complete("Again", max_tokens=10, mode="fp16")["modeswitch"]["features"]["decode_overlap_by_mode"] == {}


def test_engines_sharing_a_lane_take_turns_and_an_unpinned_engine_shares_every_lane():
    """Two engines pinned to one core (``a``, ``b``) and one pinned nowhere (``u``): a request on ``a`` while ``b``
    runs 2 waits one step of ``b`` each step, and lengthens every step of the 2 by its own; ``u`` shares both
    cores, so ``c``'s load (core 1) is its neighbour too; a finished request that shared its lane with another busy
    engine does not teach its engine's step curve."""
    costs = CostModel()
    costs.bind(Binding(streams={m: m for m in "abcu"}, lanes={"a": "0", "b": "0", "c": "1", "u": ""},
                       engines={m: m for m in "abcu"}, slots={m: 8 for m in "abcu"}))
    for m, step in (("a", 0.01), ("b", 0.03), ("c", 0.02), ("u", 0.05)):
        costs.add_prefill(m, 10, 0.0)
        costs.add_step(m, 1, step)
        costs.add_step(m, 2, 2 * step)
    shared = costs.predict("a", feats(prompt_tokens=10, max_tokens=11, in_flight_by_mode={"b": 2}))
    assert shared.decode_s == pytest.approx(10 * (0.01 + 0.06)) and shared.delay_s == pytest.approx(2 * 10 * 0.01)
    both = costs.predict("a", feats(prompt_tokens=10, max_tokens=11, in_flight_by_mode={"a": 1, "b": 2}))
    assert both.decode_s == pytest.approx(10 * (0.02 + 0.06))  # its own step at 2, and b's, not its own twice
    assert costs.predict("c", feats(prompt_tokens=10, max_tokens=11, in_flight_by_mode={"b": 2})).total == \
        pytest.approx(10 * 0.02)  # another core's engines are not its own
    unpinned = costs.predict("u", feats(prompt_tokens=10, max_tokens=11, in_flight_by_mode={"c": 1}))
    assert unpinned.decode_s == pytest.approx(10 * (0.05 + 0.02)) and unpinned.delay_s == pytest.approx(10 * 0.05)
    assert costs.lane_load("u", {"a": 1, "c": 2}) == 3 and costs.lane_load("a", {"c": 2}) == 0
    before = costs.stream("a").step.dump()
    costs.observe(Completed("a", feats(prompt_tokens=10), "ok", 0.1, 0.5, 1.0, 10, 5, 1.0, "estimated", False, False,
                            loads_met={"a": 1.0, "b": 0.25}))  # b's engine computed on its cores a quarter of it
    assert costs.stream("a").step.dump() == before and costs.stream("a").prefill.samples(10) == 2


def test_a_prefix_cache_hit_drafting_and_a_full_batch_enter_the_prediction():
    costs = CostModel()
    costs.bind(Binding(streams={"pc": "e", "spec": "e drafting"}, lanes={}, engines={"pc": "e", "spec": "e"},
                       slots={"pc": 2, "spec": 2}, drafting=frozenset({"spec"})))
    for stream in ("e", "e drafting"):
        costs.add_prefill(stream, 16, 0.05)
        costs.add_prefill(stream, 512, 0.5)
        costs.add_step(stream, 1, 0.02 if stream == "e" else 0.03)
    full = costs.predict("pc", feats(prompt_tokens=512))
    held = costs.predict("pc", feats(prompt_tokens=512, prefix_match_by_mode={"pc": 496}))
    assert held.prefill_s == pytest.approx(0.05) and full.prefill_s == pytest.approx(0.5)
    # drafting: a step costs 1.5x, but yields 3 tokens: half the decode time; one token a step: 1.5x
    assert costs.predict("spec", feats(max_tokens=31), tokens_per_step=3.0).decode_s == pytest.approx(10 * 0.03)
    assert costs.predict("spec", feats(max_tokens=31)).decode_s == pytest.approx(30 * 0.03)
    # a batch of 2 full: the third waits for one request's time on it (measured by finished requests)
    costs.add_service("e", 1.5)
    queued = costs.predict("pc", feats(in_flight_by_mode={"pc": 1, "spec": 1}))
    assert queued.wait_s == pytest.approx(1.5)


def test_finished_requests_correct_the_curves_at_the_load_they_met():
    costs = CostModel()
    costs.bind(Binding(streams={"m": "m", "d": "m drafting"}, lanes={}, engines={"m": "m", "d": "m"},
                       slots={"m": 8, "d": 8}, drafting=frozenset({"d"})))

    def done(mode, met, tpot, steps=None, **kw) -> Completed:
        f = feats(prompt_tokens=64, in_flight_by_mode={"m": 1})  # what it found: one request on its engine
        return Completed(mode, f, "ok", 0.1, tpot, 1.0, 64, 21, 1.0, "estimated", False, False, target_steps=steps,
                         loads_met=met, **kw)

    costs.observe(done("m", {"m": 4.0}, 0.02))  # filed under the mean load it met (itself included), not 2
    assert costs.stream("m").step.dump() == [[4.0, 0.02, 1]]
    # its first token came on a busy engine, with no idle prefill measured to take it over: neither curve learns
    assert not costs.stream("m").prefill.measured and not costs.stream("m").join.measured
    costs.observe(done("d", {"m": 3.0, "d": 1.0}, 0.01, steps=6))  # 20 tokens after the first in 5 steps: 0.04
    assert costs.stream("m drafting").step.at(4) == pytest.approx(0.04)
    costs.observe(done("m", None, 0.5))  # the loads it met not known: no step time
    assert costs.stream("m").step.dump() == [[4.0, 0.02, 1]]
    for failed in (replace(done("m", {}, 0.5), outcome="error"), replace(done("m", {}, 0.5), retried=True),
                   replace(done("m", {}, 0.5), scoring=True)):
        costs.observe(failed)
    assert costs.stream("m").step.dump() == [[4.0, 0.02, 1]]


def test_an_engine_counting_the_prompts_it_computed_files_a_request_at_them():
    """A burst's first request found its engine idle, but the prompts that came after it were computed in its step:
    its time to first token is filed at every prompt its engine computed until then (and at what another engine on
    its lane had queued), and its time per token less the prompts computed beside its steps, at the prefill
    curve's seconds per token."""
    costs = CostModel()
    costs.bind(Binding(streams={"a": "a", "b": "b"}, lanes={"a": "0", "b": "0"}, engines={"a": "a", "b": "b"},
                       slots={"a": 8, "b": 8}))
    costs.add_prefill("a", 100, 0.1)
    costs.add_prefill("a", 1100, 0.6)  # 0.5 ms a token
    f = feats(prompt_tokens=100, prefilling_by_mode={"b": 50})
    costs.observe(Completed("a", f, "ok", 0.45, 0.02, 2.0, 100, 21, 1.0, "estimated", False, False,
                           loads_met={"a": 4.0}, prefilled_tokens=(800, 200)))
    assert costs.stream("a").prefill.samples(850) == 1  # 800 on its engine, 50 queued on b
    # 20 steps in 0.4 s, 200 prompt tokens (0.1 s) of it beside them: 0.015 s a step
    assert costs.stream("a").step.dump() == [[4.0, 0.015, 1]]
    costs.observe(Completed("a", f, "ok", 0.45, 0.004, 2.0, 100, 21, 1.0, "estimated", False, False,
                           loads_met={"a": 4.0}, prefilled_tokens=(800, 200)))  # the prompts were all of it
    assert costs.stream("a").step.samples(4) == 1


def test_a_drafting_request_whose_steps_were_all_prompts_still_teaches_its_yield():
    """Nothing of its time per step is left once the prompts beside it are taken out: no step is filed, but the
    drafting gain it got is."""
    costs = CostModel()
    costs.bind(Binding(streams={"d": "e drafting"}, lanes={}, engines={"d": "e"}, slots={"d": 8},
                       drafting=frozenset({"d"})))
    costs.add_prefill("e drafting", 100, 0.1)
    costs.add_prefill("e drafting", 1100, 0.6)  # 0.5 ms a token
    f = feats(prompt_tokens=100, draft_tokens_per_step=3.0)
    costs.observe(Completed("d", f, "ok", 0.1, 0.004, 1.0, 100, 21, 1.0, "estimated", False, False, target_steps=11,
                            loads_met={"d": 2.0}, prefilled_tokens=(100, 200)))
    assert not costs.stream("e drafting").step.measured
    assert costs.stream("e drafting").draft_yield.at(2) == pytest.approx(0.5)  # 2 tokens a step of 3 promised


def test_an_engine_integrates_its_requests_in_flight_so_a_request_knows_the_loads_it_met(monkeypatch, make_app):
    """What a request's time per token is filed under: the mean requests on its engine from its first token to its
    end, the difference of two readings of the engine's in-flight request-seconds, whatever it found when decided
    (a request that found its engine idle at the start of a burst spent its steps beside the burst)."""
    import types

    import modeswitch.engines.base as base
    from modeswitch.engines.base import Engine, GenRequest
    from modeswitch.sampling_params import SamplingParams

    class Holding(Engine):  # keeps what it is given until it is answered
        def _enqueue(self, req):
            pass

        def close(self):
            pass

    clock = [100.0]
    monkeypatch.setattr(base, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    engine = Holding(8)
    first, second = (GenRequest([i], SamplingParams(max_tokens=1)) for i in (1, 2))
    engine.submit(first)
    clock[0] = 101.0
    assert engine.load_seconds() == (101.0, 1.0)
    engine.submit(second)
    clock[0] = 103.0
    first.emit("done")
    clock[0] = 104.0
    then, counted = 101.0, 1.0
    now, total = engine.load_seconds()
    assert (total - counted) / (now - then) == pytest.approx(5 / 3)  # two for 2 s, then one for 1 s
    monkeypatch.undo()

    app = make_app(modes=["prefix_cache"], scripts={"prefix_cache": Script(token_s=0.005, batch=4)})
    seen: list[Completed] = []
    app.service.controller.add_observer(seen.append)
    app.complete([65, 66, 67], max_tokens=8)
    assert seen[-1].loads_met == {"prefix_cache": pytest.approx(1.0, rel=0.05)}  # alone, itself included


def test_measurements_are_kept_under_their_key_and_read_back_by_the_same_engine(tmp_path):
    path = tmp_path / "costs.json"
    card = {"kernels": {"engine": "vllm:fp16", "compute": "float32"}, "decode": "compiled", "cpus": [0]}
    key = stream_key("cpu X [avx2] x2", "demo", "vllm", "fp16", card)
    binding = Binding(streams={"fp16": "fp16"}, lanes={}, engines={}, slots={}, keys={"fp16": key})
    first = CostModel(path)
    first.bind(binding)
    first.add_prefill("fp16", 32, 0.1)
    first.add_step("fp16", 1, 0.02)
    first.save()
    again = CostModel(path)
    again.bind(binding)
    assert again.measured("fp16") and again.predict("fp16", feats(max_tokens=2)).total == pytest.approx(0.12)
    other = CostModel(path)  # the same engine on an AVX-512 machine reads nothing of it
    other.bind(replace(binding, keys={"fp16": stream_key("cpu X [avx2 avx512f] x2", "demo", "vllm", "fp16", card)}))
    assert not other.measured("fp16")
    # the same engine drafting for a speculative mode on it: its plain requests take vLLM's drafting path too
    drafts = stream_key("cpu X [avx2] x2", "demo", "vllm", "fp16", {**card, "engine_drafts": "ngram"})
    drafting = CostModel(path)
    drafting.bind(replace(binding, keys={"fp16": drafts}))
    assert not drafting.measured("fp16")


def test_an_engine_slower_at_every_load_than_another_on_its_cores_is_idle_by_measurement():
    """int8 beside fp16 on one core, 3x slower at every load both measured: idle, and a request's predictor names
    each of its modes. Not where it computes on cores of its own (it adds capacity there), not against an engine on the same
    weights (a cached prefix or drafting tells those apart), and not where the faster one has not measured every
    load the slower one has (nothing is claimed on an extrapolation)."""
    def model(int8_lane="0", int8_weights="int8", fp16_loads=(1, 2, 4)):
        costs = CostModel()
        modes = {"fp16": "fp16", "prefix_cache": "fp16", "int8": "int8", "int8+prefix_cache": "int8"}
        costs.bind(Binding(streams=dict(modes), lanes={m: "0" if e == "fp16" else int8_lane for m, e in modes.items()},
                           engines=dict(modes), slots={m: 4 for m in modes},
                           weights={m: "fp16" if e == "fp16" else int8_weights for m, e in modes.items()}))
        for load in (1, 2, 4):
            costs.add_prefill("int8", 16, 0.01)
            costs.add_step("int8", load, 0.03 * load)
        for load in fp16_loads:
            costs.add_prefill("fp16", 16, 0.01)
            costs.add_step("fp16", load, 0.01 * load)
        return costs

    costs = model()
    assert costs.idle_by_measurement() == ["int8"]
    assert costs.describe()["streams"]["int8"]["idle_by_measurement"] is True
    predict = costs.predictor(feats(max_tokens=8, in_flight_by_mode={"fp16": 3}))
    assert predict.idle == {"int8", "int8+prefix_cache"}
    assert model(int8_lane="1").idle_by_measurement() == []
    assert model(int8_weights="fp16").idle_by_measurement() == []
    assert model(fp16_loads=(1, 2)).idle_by_measurement() == []
    # the faster engine slows below it at one load: not idle any more
    costs.add_step("fp16", 4, 0.2)
    costs.add_step("fp16", 4, 0.2)
    assert costs.idle_by_measurement() == []


def test_an_engine_of_drafting_modes_only_is_idle_by_measurement_against_the_drafting_engines_on_its_cores():
    """A first start gives each weights' speculative mode an engine of its own, on the same core: the one whose
    drafting steps are slower at every load is idle; a plain engine's steps (no verification in them) are not what
    a drafting engine is compared with."""
    def model(int8_plain=False):
        costs = CostModel()
        engines = {"speculative": "speculative", "int8+speculative": "int8+speculative", "fp16": "fp16"}
        streams = {"speculative": "speculative drafting", "int8+speculative": "int8+speculative drafting",
                   "fp16": "fp16"}
        if int8_plain:  # a plain int8 mode on that engine: compared as a plain engine, with fp16
            engines["int8"], streams["int8"] = "int8+speculative", "int8+speculative"
        costs.bind(Binding(streams=streams, lanes={m: "1" for m in engines}, engines=engines,
                           slots={m: 4 for m in engines}, drafting=frozenset({"speculative", "int8+speculative"}),
                           weights={m: "int8" if m.startswith("int8") else "fp16" for m in engines}))
        for load in (1, 2, 4):
            for stream, step in (("speculative drafting", 0.05), ("int8+speculative drafting", 0.14),
                                 ("fp16", 0.2), ("int8+speculative", 0.1)):
                costs.add_prefill(stream, 16, 0.01)
                costs.add_step(stream, load, step * load)
        return costs

    costs = model()
    assert costs.idle_by_measurement() == ["int8+speculative drafting"]
    assert costs.predictor(feats(max_tokens=8)).idle == {"int8+speculative"}
    assert model(int8_plain=True).idle_by_measurement() == ["fp16"]


def test_a_mode_on_an_idle_engine_is_chosen_only_when_no_other_is_admitted():
    """Its own time may look shorter while the faster engine is busy; it still comes after every other measured
    mode (and is not even predicted then), and serves when the gates leave nothing else (memory pressure, a full
    queue)."""
    from modeswitch.controller.costs import Prediction

    policy = policy_from(FASTEST)
    times = {"prefix_cache": 2.0, "speculative": 2.5, "int8+prefix_cache": 1.0}
    asked = []

    def predict(mode):
        asked.append(mode)
        return Prediction(times[mode], 0.0, 0.0, 0.1, 0.0) if mode in times else None

    predict.idle = frozenset({"int8+prefix_cache", "int8"})
    choice = policy.choose(feats(), {}, predict)
    assert choice.mode == "prefix_cache" and choice.prediction["runner_up"]["mode"] == "speculative"
    assert "left alone" in choice.reason and "int8+prefix_cache" in choice.reason
    assert not predict.idle & set(asked)
    full = {"prefix_cache": "queue full", "speculative": "queue full"}
    choice = policy.choose(feats(), full, predict)
    assert choice.mode == "int8+prefix_cache" and "no other mode admitted and measured" in choice.reason


def test_the_policy_picks_the_mode_predicted_first_and_says_what_the_runner_up_was():
    policy = policy_from(FASTEST)
    times = {"fp16": 2.0, "int8": 1.0, "prefix_cache": 1.5}
    from modeswitch.controller.costs import Prediction

    def predict(mode):
        return Prediction(times[mode], 0.0, 0.0, 0.1, times[mode] - 0.1) if mode in times else None

    choice = policy.choose(feats(), {}, predict)
    assert choice.mode == "int8" and choice.prediction["runner_up"]["mode"] == "prefix_cache"
    assert "predicted 1 s" in choice.reason and "runner-up prefix_cache 1.5 s" in choice.reason
    # a gate's verdict removes the fastest; nothing measured: the list's order (the reference first)
    assert policy.choose(feats(), {"int8": "quality"}, predict).mode == "prefix_cache"
    assert policy.choose(feats(), {}, lambda m: None).mode == "prefix_cache"
    # a rule still constrains: under memory pressure only the small-weight modes
    assert policy.choose(feats(memory_headroom=0.05), {}, predict).mode == "int8"
    times["int8"] = 3.0
    assert policy.choose(feats(memory_headroom=0.05), {}, predict).mode == "int8"  # the only measured one allowed
    # order: listed keeps a rule table strict
    strict = policy_from(FASTEST.replace("order: predicted", "order: listed"))
    assert strict.choose(feats(), {}, predict).mode == "prefix_cache"


def wait_measured(app, streams, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(app.service.costs.measured(s) for s in streams):
        assert time.monotonic() < deadline, app.get("/v1/modes").get_json()["costs"]
        time.sleep(0.05)


def test_a_drafting_stream_is_explored_on_a_kind_of_request_it_has_served_too_few_of_while_its_lane_is_idle(tmp_path):
    """``explore`` says where a request may go to be measured: a drafting mode whose stream has served fewer than
    the policy's count of its kind (task, prompt length, repetition), not on the fastest's stream, with nothing on
    its cores; every finished request counts for its stream, and the counts are kept with the curves."""
    costs = CostModel(tmp_path / "costs.json")
    costs.bind(Binding(streams={"plain": "e", "spec": "e drafting", "other": "o drafting"},
                       lanes={"plain": "0", "spec": "0", "other": "1"},
                       engines={"plain": "e", "spec": "e", "other": "o"},
                       slots={"plain": 4, "spec": 4, "other": 4}, drafting=frozenset({"spec", "other"}),
                       keys={"e": "k1", "e drafting": "k2", "o drafting": "k3"}))
    for stream in ("e", "e drafting", "o drafting"):
        costs.add_prefill(stream, 100, 0.1)
        costs.add_step(stream, 1, 0.01)
    copying = feats(prompt_tokens=150, prompt_repeat=0.6)
    assert costs.predictor(copying).explore("spec", "plain", 2) == (0, "general/2^8/repeat2")
    assert costs.predictor(copying).explore("plain", "spec", 2) is None  # a plain step is the same for any text
    assert costs.predictor(copying).explore("spec", "spec", 2) is None  # the fastest's own stream
    assert costs.predictor(replace(copying, in_flight_by_mode={"plain": 1})).explore("spec", "other", 2) is None
    assert costs.predictor(replace(copying, in_flight_by_mode={"other": 1})).explore("spec", "other", 2) == \
        (0, "general/2^8/repeat2")  # another core's load is not its lane's

    def served(mode, f):
        costs.observe(Completed(mode, f, "ok", 0.1, 0.01, 0.5, f.prompt_tokens, 32, 1.0, "estimated", False, False))

    served("spec", copying)
    assert costs.predictor(copying).explore("spec", "plain", 2) == (1, "general/2^8/repeat2")
    served("spec", copying)
    assert costs.predictor(copying).explore("spec", "plain", 2) is None  # measured on its kind
    assert costs.predictor(feats(prompt_tokens=40)).explore("spec", "plain", 2) == (0, "general/2^6/repeat0")
    assert costs.predictor(copying).explore("other", "plain", 2) == (0, "general/2^8/repeat2")  # its own count
    costs.install("e drafting", StreamCosts.load(costs.stream("e drafting").dump() | {"served_by_kind": {}}))
    assert costs.stream("e drafting").served == {"general/2^8/repeat2": 2}  # a calibration keeps the counts
    costs.save()
    again = CostModel(tmp_path / "costs.json")
    again.bind(costs.binding)
    assert again.stream("e drafting").served == {"general/2^8/repeat2": 2}
    assert again.describe()["streams"]["e drafting"]["served_by_kind"] == {"general/2^8/repeat2": 2}


def test_a_policy_that_explores_sends_a_request_to_a_near_runner_up_its_stream_has_not_measured_on_its_kind():
    """With ``explore``, the first mode predicted within its factor of the fastest that ``predict.explore`` names
    serves, and the reason says so (the fastest is then the runner-up); beyond the factor, or once measured, the
    fastest serves. A policy without it never explores."""
    from modeswitch.controller.costs import Prediction

    plain = "name: p\norder: predicted\nrules: []\ndefault: [speculative, int8+prefix_cache, int8+speculative]\n"
    policy = policy_from(plain + "explore: {within: 1.5, requests: 2}\n")
    assert policy.describe()["explore"] == {"within": 1.5, "requests": 2}
    times = {"speculative": 1.0, "int8+speculative": 1.4, "int8+prefix_cache": 1.2}
    served = {"int8+speculative": 0}

    def predict(mode):
        return Prediction(times[mode], 0.0, 0.0, 0.1, times[mode] - 0.1) if mode in times else None

    def explore(mode, than, under):
        assert than == "speculative" and under == 2
        n = served.get(mode)
        return (n, "general/2^8/repeat2") if n is not None and n < under else None

    predict.explore = explore
    choice = policy.choose(feats(), {}, predict)
    assert choice.mode == "int8+speculative" and choice.prediction["runner_up"]["mode"] == "speculative"
    assert "exploring" in choice.reason and "served 0 request(s) of this kind (general/2^8/repeat2)" in choice.reason
    served["int8+speculative"] = 2
    assert policy.choose(feats(), {}, predict).mode == "speculative"
    served["int8+speculative"] = 0
    times["int8+speculative"] = 1.6  # beyond 1.5x the fastest
    assert policy.choose(feats(), {}, predict).mode == "speculative"
    times["int8+speculative"] = 1.4
    assert policy_from(plain).choose(feats(), {}, predict).mode == "speculative"
    for bad, why in (("{within: 0.9, requests: 2}", "at least 1"), ("{within: 1.2}", "is required"),
                     ("{within: 1.2, requests: 0}", "at least 1"), ("{within: 1.2, requests: 2, k: 1}", "unknown")):
        with pytest.raises(ConfigError, match=why):
            policy_from(plain + f"explore: {bad}\n")


def test_the_server_measures_its_engines_and_routes_to_the_faster_then_flips_when_it_slows(make_app):
    """Two engines on one core, one 3x slower per token (int8 on an AVX2 CPU, say): calibration measures both and the default
    policy sends every request to the faster; when that engine slows down below the other, its finished requests
    say so and the routing flips within a few requests."""
    modes = ["prefix_cache", "int8+prefix_cache"]
    scripts = {"prefix_cache": Script(token_s=0.006, batch=4, cpus=(0,)),
               "int8+prefix_cache": Script(token_s=0.018, batch=4, cpus=(0,))}
    app = make_app(modes=modes, policy=FASTEST, scripts=scripts, calibrate=True, max_inflight_per_client=0)
    wait_measured(app, modes)
    costs = app.get("/v1/modes").get_json()["costs"]
    step = {s: costs["streams"][s]["step_s_by_engine_load"] for s in modes}
    assert step["int8+prefix_cache"][0][1] > 2 * step["prefix_cache"][0][1]
    assert all(n >= 1 for _, _, n in step["prefix_cache"])  # samples behind each point are shown
    assert costs["streams"]["int8+prefix_cache"]["idle_by_measurement"] is True
    served = [app.complete([65 + i, 66, 67], max_tokens=12)["modeswitch"] for i in range(3)]
    assert [s["mode"] for s in served] == ["prefix_cache"] * 3, served[0]["reason"]
    # the slower engine is left alone by measurement, not predicted: no runner-up, and the reason says why
    assert served[0]["prediction"]["chosen"]["mode"] == "prefix_cache" and "runner_up" not in served[0]["prediction"]
    assert "left alone" in served[0]["reason"] and "int8+prefix_cache" in served[0]["reason"]
    # the reference engine slows to 10x: its own finished requests correct its curve, and the routing flips
    app.backend.engines["prefix_cache"].script = replace(scripts["prefix_cache"], token_s=0.06)
    modes_served = [app.complete([70 + i, 66, 67], max_tokens=12)["modeswitch"]["mode"] for i in range(40)]
    flip = modes_served.index("int8+prefix_cache")
    assert flip <= 30 and set(modes_served[flip:]) == {"int8+prefix_cache"}, modes_served


def test_an_engine_idle_by_measurement_is_measured_again_once_its_curves_are_old_and_its_lane_quiet(make_app):
    """Its own requests never correct an idle engine's curves: a slow calibration (a disturbed start, a machine
    that changed since) would park it for good. The calibration measures it again once its curves are older than
    ``remeasure_idle_s``, never while its lane is busy; faster now, it takes requests again. (``--remeasure-idle-s
    0``: never.)"""
    from modeswitch.serving.calibrate import Calibration

    modes = ["prefix_cache", "int8+prefix_cache"]
    scripts = {"prefix_cache": Script(token_s=0.006, batch=4, cpus=(0,)),
               "int8+prefix_cache": Script(token_s=0.018, batch=4, cpus=(0,))}
    app = make_app(modes=modes, policy=FASTEST, scripts=scripts, calibrate=True, max_inflight_per_client=0,
                   remeasure_idle_s=0)
    wait_measured(app, modes)
    costs = app.service.costs
    assert costs.remeasure_idle_s == float("inf")
    assert costs.idle_by_measurement() == ["int8+prefix_cache"] and costs.needs_measuring("int8+prefix_cache") is None
    calibration = Calibration(app.service.registry, costs, app.service.rebind)
    app.backend.engines["int8+prefix_cache"].script = replace(scripts["int8+prefix_cache"], token_s=0.002)
    costs.remeasure_idle_s = 0.0
    assert costs.needs_measuring("int8+prefix_cache") == "idle" and costs.needs_measuring("prefix_cache") is None
    held = app.backend.engines["prefix_cache"]
    url = app.serve()

    with ThreadPoolExecutor(1) as pool:  # a request on the lane: nothing is measured beside it
        busy = pool.submit(requests.post, url + "/v1/completions", timeout=60,
                           json={"prompt": [90, 91], "max_tokens": 200, "temperature": 0, "mode": "prefix_cache"})
        deadline = time.monotonic() + 5
        while not held.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calibration.measure_unmeasured() == []
        assert busy.result().status_code == 200
    # measured again, int8 is now the faster: the reference engine is idle in its turn (and, with curves older
    # than 0 s, measured again too, still the slower)
    assert calibration.measure_unmeasured() == ["int8+prefix_cache", "prefix_cache"]
    assert costs.idle_by_measurement() == ["prefix_cache"]
    assert app.complete([95, 66, 67], max_tokens=12)["modeswitch"]["mode"] == "int8+prefix_cache"


def test_a_disturbed_calibration_timing_does_not_count(make_app, monkeypatch):
    """Every prompt length and load is timed twice and the faster counts: here every other timing runs 10x slow
    (another process on the core), and the curves are the engine's own."""
    import modeswitch.serving.calibrate as calibrate

    script = Script(token_s=0.002, prompt_token_s=0.0001, batch=4)
    app = make_app(modes=["prefix_cache"], scripts={"prefix_cache": script})
    engine, timings = app.backend.engines["prefix_cache"], []
    real = calibrate._run

    def disturbed(state, prompts, max_tokens):
        timings.append(slow := len(timings) % 2 == 0)
        engine.script = replace(script, token_s=0.02, prompt_token_s=0.001) if slow else script
        return real(state, prompts, max_tokens)

    monkeypatch.setattr(calibrate, "_run", disturbed)
    costs = calibrate.Calibration(app.service.registry, app.service.costs, app.service.rebind).measure(
        "prefix_cache", app.service.registry.modes["prefix_cache"])
    assert len(timings) == 2 * (len(calibrate.PROMPT_TOKENS) + 3)  # loads 1, 2, 4: its batch
    assert all(seconds < 0.006 for _, seconds, _ in costs.step.dump())
    assert costs.prefill.at(1024) < 0.5  # 1024 tokens at 0.1 ms, not 1 ms


def test_a_calibration_request_unanswered_by_its_deadline_is_cancelled_and_counted_as_timed_out(make_app, monkeypatch):
    """An engine that stops answering (wedged, say) while it is measured: each reader gives up at the deadline,
    quietly (no exception escapes its thread), and its request is cancelled and counted as timed out."""
    import threading

    import modeswitch.serving.calibrate as calibrate

    app = make_app(modes=["prefix_cache"], scripts={"prefix_cache": Script(token_s=1.0, batch=2)})
    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    monkeypatch.setattr(calibrate, "REQUEST_TIMEOUT_S", 0.2)
    timed = calibrate._run(app.service.registry.modes["prefix_cache"], [[1, 2, 3], [4, 5, 6]], 4)
    assert [t.error for t in timed] == ["timed out", "timed out"] and not escaped


def test_a_burst_spreads_over_two_lanes_whose_steps_grow_with_load(make_app):
    """Two engines equally fast alone, each on its own CPUs, each step slower by half per request beside it (as
    measured): a burst of 8 is predicted cheaper split than piled on one lane."""
    modes = ["prefix_cache", "int8+prefix_cache"]
    scripts = {m: Script(token_s=0.004, load_s=0.002, batch=8, cpus=(i,)) for i, m in enumerate(modes)}
    app = make_app(modes=modes, policy=FASTEST, scripts=scripts)
    for stream in modes:
        app.service.costs.add_prefill(stream, 16, 0.001)
        for load in (1, 2, 4, 8):
            app.service.costs.add_step(stream, load, 0.004 + 0.002 * (load - 1))
    url = app.serve()

    def one(i):
        body = {"prompt": [80 + i, 81, 82], "max_tokens": 24, "temperature": 0}
        return requests.post(url + "/v1/completions", json=body, timeout=60).json()["modeswitch"]["mode"]

    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(one, range(8)))
    assert min(served.count(m) for m in modes) >= 2, served
    assert not any(app.service.prefilling.values())  # every prompt counted while computed, none left over


def test_an_unmeasured_speculative_mode_masks_nothing(make_app):
    """A speculative mode whose drafting stream has not been measured predicts nothing: it is not served on a
    prior, and the speculation gain is the measured pair's alone."""
    modes = ["prefix_cache", "speculative", "int8+prefix_cache", "int8+speculative"]
    scripts = {m: Script(token_s=0.002, batch=4) for m in modes}
    app = make_app(modes=modes, policy=PREDICTED_ONLY, scripts=scripts)
    costs = app.service.costs
    assert set(costs.binding.pairs) == {"speculative", "int8+speculative"}
    for stream in ("prefix_cache", "int8+prefix_cache", "int8+speculative drafting"):
        costs.add_prefill(stream, 8, 0.01)
        costs.add_step(stream, 1, 0.01 if stream != "int8+speculative drafting" else 0.013)
    body = app.complete([90, 91, 92], max_tokens=12)["modeswitch"]
    assert body["mode"] in ("prefix_cache", "int8+prefix_cache") and "speculative" not in body["prediction"]["chosen"]
    f = feats(prompt_tokens=3, max_tokens=12)
    # nothing learned of this kind: a drafting step yields one token, so drafting costs 1.3x: gain 1/1.3
    assert costs.speculation_gain(f, 1.0) == pytest.approx(1 / 1.3, rel=0.05)
    assert costs.predict("speculative", f) is None and costs.speculation_gain(f, 2.6) == pytest.approx(2.0, rel=0.1)
    # no rule of the default policy tests the gain: the request's features leave it out, uncomputed
    assert body["features"]["speculation_gain"] is None


def test_the_quality_gate_comes_before_the_prediction():
    """The default policy with the shipped vLLM gate report: int8 measured fastest serves; in a report where int8
    fails the gate it never does, however fast, and the fastest of the rest serves."""
    from modeswitch.config import LoadConfig
    from modeswitch.controller.decide import Controller
    from modeswitch.controller.load import load_policy
    from modeswitch.modes import load_modes
    from modeswitch.serving.registry import ModeRegistry
    from modeswitch.weights.presets import PRESETS
    from policy_text import MODES

    pool = ModeRegistry(PRESETS["demo"], load_modes(), LoadConfig(backend="transformers", device="cpu"))
    for state in pool.modes.values():
        state.status = "available"
    costs = CostModel()
    names = list(pool.modes)
    costs.bind(Binding(streams={m: m for m in names}, lanes={}, engines={m: m for m in names},
                       slots={m: 8 for m in names}))
    for m in names:
        costs.add_prefill(m, 16, 0.01)
        costs.add_step(m, 1, 0.005 if m.startswith("int8") else 0.02 if m.startswith("gptq") else 0.01)
    controller = Controller(pool.modes, load_policy(DEFAULT_POLICY, MODES), costs=costs)
    report = shipped_run()
    controller.quality_report = report
    assert controller.decide(feats()).mode == "int8+prefix_cache"
    int8_fails = {m: report["modes"]["gptq"] for m in names if m.startswith("int8")}
    controller.quality_report = {**report, "modes": {**report["modes"], **int8_fails}}
    decision = controller.decide(feats())
    assert decision.mode == "prefix_cache" and decision.prediction["chosen"]["mode"] == "prefix_cache"
    assert decision.decision_us > 0


def test_an_engine_that_changed_keeps_its_old_curves_until_measured_again(tmp_path):
    """Compiled behind the requests, an engine's key changes: its eager curves still predict (better than none)
    until a calibration replaces them whole; the eager ones stay kept under their own key."""
    binding = Binding(streams={"fp16": "fp16"}, lanes={}, engines={}, slots={}, keys={"fp16": "eager"})
    costs = CostModel(tmp_path / "costs.json")
    costs.bind(binding)
    assert costs.needs_measuring("fp16") == "unmeasured"
    costs.add_prefill("fp16", 16, 0.1)
    costs.add_step("fp16", 1, 0.05)
    assert costs.needs_measuring("fp16") is None
    costs.bind(replace(binding, keys={"fp16": "compiled"}))
    assert costs.needs_measuring("fp16") == "stale" and costs.predict("fp16", feats(max_tokens=3)) is not None
    fresh = StreamCosts.empty()
    fresh.prefill.add(16, 0.1)
    fresh.step.add(1, 0.02)
    costs.install("fp16", fresh)
    assert costs.needs_measuring("fp16") is None
    assert costs.predict("fp16", feats(max_tokens=3)).decode_s == pytest.approx(0.04)
    costs.save()
    eager = CostModel(tmp_path / "costs.json")
    eager.bind(binding)
    assert eager.predict("fp16", feats(max_tokens=3)).decode_s == pytest.approx(0.1)


def test_the_second_engine_goes_to_the_weights_an_earlier_run_measured_fastest_here(tmp_path):
    """Mode files give int8+speculative an engine of its own (a burst spreads over two int8 engines: right where
    int8 is fast). Where an earlier run here measured the fp16 engine stepping faster than the int8 one (an AVX2
    CPU), the next start gives that engine to ``speculative`` instead; measured elsewhere, or not at all, the files
    decide. Weights the fallback's engine served there (GPTQ on transformers, stepping faster still) are not the
    vLLM engines' to follow."""
    from modeswitch.compose import follow_measurements
    from modeswitch.device import machine
    from modeswitch.modes import load_modes

    path = tmp_path / "costs.json"
    other = "cpu Other [avx2 avx512f] x2"
    for where, steps in ((machine(), {"fp16": 0.05, "int8": 0.2, "int8+speculative drafting": 0.21}),
                         (other, {"fp16": 0.05, "int8": 0.02})):
        measured = CostModel(path)  # each run merges its keys into the file
        measured.bind(Binding(streams={s: s for s in steps}, lanes={}, engines={}, slots={},
                              keys={s: stream_key(where, "demo", "vllm+transformers", s, {"cpus": [0]}) for s in steps}))
        for stream, step in steps.items():
            measured.add_prefill(stream, 16, 0.1)
            measured.add_step(stream, 1, step)
        measured.save()
    fallback = CostModel(path)
    fallback.bind(Binding(streams={"gptq": "gptq"}, lanes={}, engines={}, slots={}, keys={"gptq": stream_key(
        machine(), "demo", "vllm+transformers", "gptq", {"kernels": {"engine": "transformers:gptq"}})}))
    fallback.add_prefill("gptq", 16, 0.1)
    fallback.add_step("gptq", 1, 0.04)
    fallback.save()
    kinds = ("fp16", "int8", "gptq")
    assert list(CostModel(path).step_by_weights(machine(), "demo", "vllm", kinds)) == ["fp16", "int8"]
    assert list(CostModel(path).step_by_weights(other, "demo", "vllm", kinds)) == ["int8", "fp16"]
    # int8's first bucket moved to a mean of 1.7 requests by the requests it finished, which the curve reads flat
    # below: at one request it reads as slow as fp16's calibrated 1-request step; over the loads it is faster
    drifted = "cpu Drifted [avx2] x2"
    curves = {"fp16": {1: 0.0357, 2: 0.0404, 4: 0.0512, 8: 0.065, 16: 0.0967},
              "int8": {1.71: 0.0363, 3.65: 0.0462, 5.8: 0.0521, 11.95: 0.0716, 16: 0.0656}}
    measured = CostModel(path)
    measured.bind(Binding(streams={s: s for s in curves}, lanes={}, engines={}, slots={},
                          keys={s: stream_key(drifted, "demo", "vllm", s, {}) for s in curves}))
    for stream, steps in curves.items():
        measured.add_prefill(stream, 16, 0.1)
        for load, step in steps.items():
            measured.add_step(stream, load, step)
    measured.save()
    assert list(CostModel(path).step_by_weights(drifted, "demo", "vllm", kinds)) == ["int8", "fp16"]
    shipped = load_modes()
    said = []
    moved = {m.name: m.own_engine for m in follow_measurements(shipped, CostModel(path), "demo", said.append)}
    assert moved["speculative"] and not moved["int8+speculative"] and "speculative" in said[0]
    assert sum(moved.values()) == sum(m.own_engine for m in shipped)
    # nothing measured here yet: the first start gives each weights' speculative mode an engine of its own
    unmeasured = follow_measurements(shipped, CostModel(tmp_path / "none.json"), "demo", said.append)
    assert {m.name for m in unmeasured if m.own_engine} == {"int8+speculative", "speculative"}
    assert [replace(m, own_engine=False) for m in unmeasured] == [replace(m, own_engine=False) for m in shipped]
    assert "speculative" in said[1] and len(said) == 2


def test_a_staged_start_leads_with_the_weights_measured_fastest_only_where_the_gate_passes_them_on_those_kernels():
    """The default list names the reference weights first (nothing measured, they serve while the others load and
    measure). Where an earlier run here measured int8 stepping faster, int8's first mode in the list leads instead,
    if the shipped gate report passes it on the kernels its engine was measured with: not on kernels the report
    never scored (pending), not under tolerances it fails, not where the reference weights were never measured
    (nothing to compare), and not where int8 measured slower."""
    from modeswitch.compose import lead_by_measurement
    from modeswitch.controller.costs import Measured
    from modeswitch.controller.gates import quality_verdict
    from modeswitch.controller.quality import QualityPolicy, read_report
    from modeswitch.modes import load_modes
    from modeswitch.resources import shipped_report

    report = read_report(shipped_report("demo", "vllm"))
    scored = shipped_run(compute="float32")["kernels"]["int8+prefix_cache"]  # int8's perplexity there: +8.8 %
    specs, first = load_modes(), ("prefix_cache", "fp16", "int8+prefix_cache", "int8")

    def lead(steps: dict, card=scored, quality=QualityPolicy()) -> str:
        said: list[str] = []
        fastest_first = {k: Measured(s, card) for k, s in sorted(steps.items(), key=lambda kv: kv[1])}
        order = lead_by_measurement(first, specs, fastest_first,
                                    lambda m, c: quality_verdict(report, quality, "general", m, c) is None, said.append)
        assert sorted(order) == sorted(first) and bool(said) == (order[0] != first[0])
        return order[0]

    assert lead({"int8": 0.02, "fp16": 0.05}) == "int8+prefix_cache"
    assert lead({"int8": 0.08, "fp16": 0.05}) == "prefix_cache"
    assert lead({"int8": 0.02}) == "prefix_cache"
    assert lead({"int8": 0.02, "fp16": 0.05}, card={**scored, "kernel": "some other kernel"}) == "prefix_cache"
    assert lead({"int8": 0.02, "fp16": 0.05}, quality=QualityPolicy(max_ppl_increase_pct=5.0)) == "prefix_cache"


def test_a_staged_start_serves_first_from_the_engine_an_earlier_run_measured_fastest_where_the_policy_orders_by_it(
        make_app, tmp_path):
    """Served end to end over the fake engines: with ``order: predicted`` the int8 engine, measured faster here by
    an earlier run, is up first and serves while the reference weights load; a policy whose order is the list's
    starts with the list's first mode, measured or not."""
    from modeswitch.device import machine

    measured = CostModel(tmp_path / "costs0.json")
    steps = {"fp16": 0.05, "int8": 0.02}
    measured.bind(Binding(streams={s: s for s in steps}, lanes={}, engines={}, slots={},
                          keys={s: stream_key(machine(), "demo", "fake", s, {}) for s in steps}))
    for stream, step in steps.items():
        measured.add_prefill(stream, 16, 0.01)
        measured.add_step(stream, 1, step)
    measured.save()
    (tmp_path / "costs1.json").write_text((tmp_path / "costs0.json").read_text())
    modes = ("fp16", "prefix_cache", "int8")
    policy = "name: p\norder: {}\nrules: []\ndefault: [prefix_cache, fp16, int8]\n"
    predicted = make_app(modes=modes, policy=policy.format("predicted"), staged=True, held=("fp16", "prefix_cache"))
    assert {m: s["status"] for m, s in predicted.modes().items()} == \
        {"fp16": "loading", "prefix_cache": "loading", "int8": "available"}
    assert predicted.complete("Hello", max_tokens=4)["modeswitch"]["mode"] == "int8"
    predicted.backend.release.set()
    listed = make_app(modes=modes, policy=policy.format("listed"), staged=True, held=("int8",))
    assert {m: s["status"] for m, s in listed.modes().items()} == \
        {"fp16": "available", "prefix_cache": "available", "int8": "loading"}
    listed.backend.release.set()


def test_a_staged_start_whose_fastest_engine_comes_up_on_kernels_its_gate_never_scored_loads_the_rest_first(tmp_path):
    """The lead is chosen by the gate's verdict on the kernels its engine was measured with. Where the engine then
    comes up on other kernels (a new kernel library since), its modes are pending and could serve nothing: rather
    than refuse every request until the others are up, the server loads them before it serves."""
    import json
    import threading

    from modeswitch.compose import build_app
    from modeswitch.config import LoadConfig, ServerConfig
    from modeswitch.device import machine
    from modeswitch.testing.backend import FakeBackend

    scored = {"weights": "int8", "weight_format": "w8a8", "activations": "int8", "compute": "float32", "kernel": "old"}
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"tasks": {"copy": {"higher_is_better": True}}, "kernels": {"int8": scored},
                                  "modes": {"fp16": {"copy": {"value": 0.9}}, "int8": {"copy": {"value": 0.9}}}}))
    measured = CostModel(tmp_path / "costs.json")
    details = {"fp16": {}, "int8": {"kernels": scored}}
    measured.bind(Binding(streams={s: s for s in details}, lanes={}, engines={}, slots={},
                          keys={s: stream_key(machine(), "demo", "fake", s, d) for s, d in details.items()}))
    for stream, step in (("fp16", 0.05), ("int8", 0.02)):
        measured.add_prefill(stream, 16, 0.01)
        measured.add_step(stream, 1, step)
    measured.save()
    policy = tmp_path / "p.yaml"
    policy.write_text("name: p\norder: predicted\nrules: []\ndefault: [prefix_cache, fp16, int8]\n")

    def start(kernel: str) -> tuple[dict[str, str], list[str]]:
        said: list[str] = []
        backend = FakeBackend(held=("fp16", "prefix_cache"), kernels={"int8": {**scored, "kernel": kernel}})
        threading.Timer(1.0, backend.release.set).start()  # the reference weights' engine is up a second later
        config = ServerConfig(model="demo", modes=("fp16", "prefix_cache", "int8"), policy=policy,
                              gate_report=str(report), load=LoadConfig(staged=True), costs_file=tmp_path / "costs.json",
                              calibrate=False)
        server = build_app(config, progress=said.append, backend=backend)
        try:
            return {n: m.status for n, m in server.service.registry.modes.items()}, said
        finally:
            backend.release.set()
            server.close()

    same, said = start("old")  # as measured: int8 serves while the others load
    assert same["int8"] == "available" and same["fp16"] == "loading" and any("int8 first" in line for line in said)
    other, said = start("new")
    assert set(other.values()) == {"available"}
    assert any("no mode up passes the quality gate" in line for line in said)


def test_a_first_start_that_has_no_memory_for_an_engine_of_its_own_on_every_weights_keeps_the_mode_files_layout(
        tmp_path):
    """The engines a first start adds (an engine of its own for each weights' speculative mode, to measure which
    pays) are not worth refusing to start over: past the memory budget, the mode files' layout starts instead."""
    from modeswitch.compose import build_app
    from modeswitch.config import LoadConfig, ServerConfig
    from modeswitch.testing.backend import WEIGHTS_BYTES, FakeBackend

    class OwnEngines(FakeBackend):
        """As vLLM plans an engine of its own: the mode's weights again, held by that engine."""

        def footprint(self, spec):
            own = super().footprint(spec)
            return replace(own, weights=spec.name, weights_bytes={spec.name: WEIGHTS_BYTES}) if spec.own_engine else own

    def start(budget_mib: float) -> tuple[dict[str, bool], list[str]]:
        said: list[str] = []
        config = ServerConfig(model="demo", modes=("fp16", "speculative", "int8", "int8+speculative"),
                              gate_report="none", load=LoadConfig(staged=False, memory_budget=int(budget_mib * 2**20)),
                              costs_file=tmp_path / f"costs-{budget_mib}.json", calibrate=True)
        server = build_app(config, progress=said.append, backend=OwnEngines())
        try:
            return {name: m.spec.own_engine for name, m in server.service.registry.modes.items()}, said
        finally:
            server.close()

    # the files' layout: fp16, int8 and int8+speculative's weights (1 MiB each), 4 modes' KV (2 MiB each); hedged,
    # speculative's weights once more
    hedged, said = start(12.5)
    assert hedged["speculative"] and hedged["int8+speculative"] and "an engine of its own for speculative too" in said[0]
    files, said = start(11.5)
    assert not files["speculative"] and files["int8+speculative"]
    assert any("the mode files' after all" in line for line in said)


def test_a_drafting_engine_that_delivers_less_of_the_predicted_gain_when_busy_is_predicted_so():
    """The acceptance predicted for a request is a replay at the full drafting bound; an engine that drafts less when
    busy gets less of it there. What its requests got, over what was predicted, is learned per load and scales the
    predicted gain at that load (all of it until learned; a calibration keeps it)."""
    costs = CostModel()
    costs.bind(Binding(streams={"d": "m drafting"}, lanes={}, engines={"d": "m"}, slots={"d": 8},
                       drafting=frozenset({"d"})))
    costs.add_prefill("m drafting", 16, 0.05)
    for load in (1, 8):
        costs.add_step("m drafting", load, 0.04)

    def done(in_flight: int, steps: int) -> Completed:  # 21 tokens, predicted at 3 a step; a step still 0.04 s
        f = feats(prompt_tokens=64, in_flight_by_mode={"d": in_flight}, draft_tokens_per_step=3.0)
        tpot = 0.04 * (steps - 1) / 20
        return Completed("d", f, "ok", 0.1, tpot, 1.0, 64, 21, 1.0, "estimated", False, False, target_steps=steps,
                         loads_met={"d": in_flight + 1.0})

    request = feats(max_tokens=31, in_flight_by_mode={"d": 7})
    assert costs.predict("d", request, tokens_per_step=3.0).decode_s == pytest.approx(10 * 0.04)
    costs.observe(done(0, 11))  # alone: 20 tokens after the first in 10 steps, 2 a step: half the gain
    costs.observe(done(7, 21))  # at load 8: one a step, none of it
    assert costs.predict("d", request, tokens_per_step=3.0).decode_s == pytest.approx(30 * 0.04)
    alone = feats(max_tokens=31)
    assert costs.predict("d", alone, tokens_per_step=3.0).decode_s == pytest.approx(15 * 0.04)
    fresh = StreamCosts.empty()
    fresh.prefill.add(16, 0.05)
    fresh.step.add(1, 0.04)
    costs.install("m drafting", fresh)
    assert costs.predict("d", alone, tokens_per_step=3.0).decode_s == pytest.approx(15 * 0.04)
    assert StreamCosts.load(costs.stream("m drafting").dump()).draft_yield.at(8) == 0.0



def test_a_drafting_step_is_priced_by_the_tokens_the_request_is_predicted_to_draft():
    """Each drafted token is verified by the step, accepted or not: a drafting stream fits, per load, its finished
    requests' steps (over its curve at the load they met) against the tokens they were predicted to draft, and moves
    its curve along that slope for a request predicted to draft more or fewer. The curve as it is until a bucket
    has enough requests, or for a kind of request whose drafts are not known yet; a calibration keeps the slope (it
    is learned from live requests); a request that met more load is not read as one that drafted more."""
    costs = CostModel()
    costs.bind(Binding(streams={"d": "e drafting"}, lanes={}, engines={"d": "e"}, slots={"d": 8},
                       drafting=frozenset({"d"})))
    costs.add_prefill("e drafting", 16, 0.05)
    for _ in range(100):  # calibrated: 30 ms a step at one request, 60 ms at three
        costs.add_step("e drafting", 1, 0.030)
        costs.add_step("e drafting", 3, 0.060)

    def done(drafts: float, seconds: float, load: float = 1.0) -> Completed:  # 21 tokens in 11 steps
        f = feats(prompt_tokens=16, draft_tokens_per_step=2.0, drafts_per_step=drafts)
        return Completed("d", f, "ok", 0.05, seconds * 10 / 20, 1.0, 16, 21, 1.0, "estimated", False, False,
                         target_steps=11, loads_met={"d": load})

    decode = lambda d, **kw: costs.predict("d", feats(max_tokens=11, drafts_per_step=d, **kw)).decode_s  # noqa: E731
    for _ in range(MIN_FIT // 2 - 1):  # 4 ms more a step per token drafted, around 2.5 drafts
        costs.observe(done(0.5, 0.022))
        costs.observe(done(4.5, 0.038))
    assert decode(0.5) == decode(4.5) == pytest.approx(10 * 0.030, rel=0.01)  # too few for a slope: the curve
    costs.observe(done(0.5, 0.022))
    costs.observe(done(4.5, 0.038))
    assert decode(2.5) == pytest.approx(10 * 0.030, rel=0.01)  # the bucket's mean drafts: the curve
    assert decode(0.5) == pytest.approx(10 * 0.022, rel=0.05) and decode(5.0) == pytest.approx(10 * 0.040, rel=0.05)
    assert decode(None) == pytest.approx(10 * 0.030, rel=0.01)  # a kind whose drafts are not known yet
    shown = costs.describe()["streams"]["e drafting"]["step_s_per_draft_by_engine_load"]
    assert shown[0][0] == 1.0 and shown[0][1] == pytest.approx(0.004, rel=0.05) and shown[0][2] == MIN_FIT
    # at one request those predicted to draft 4.5 cost 4 ms over the curve; at 1.9 requests (the same bucket, where
    # the curve reads 13.5 ms more) those predicted to draft 0.5 cost 4 ms under it: 2 ms a draft. Against the
    # seconds alone the slope would be negative (read as none)
    other = CostModel()
    other.bind(costs.binding)
    other.add_prefill("e drafting", 16, 0.05)
    for _ in range(100):
        other.add_step("e drafting", 1, 0.030)
        other.add_step("e drafting", 3, 0.060)
    for _ in range(MIN_FIT):
        other.observe(done(4.5, 0.034))
        other.observe(done(0.5, 0.0435 - 0.004, load=1.9))
    slope = other.describe()["streams"]["e drafting"]["step_s_per_draft_by_engine_load"][0][1]
    assert 0.001 < slope < 0.003  # (the curve moves toward its samples too, and their residuals with it)
    # another load has a slope of its own, not measured yet
    for _ in range(3):
        costs.observe(done(1.0, 0.060, load=3.0))
    assert decode(0.5, in_flight_by_mode={"d": 2}) == pytest.approx(10 * 0.060, rel=0.01)
    assert costs.describe()["streams"]["e drafting"]["step_s_per_draft_by_engine_load"][1][1:] == [None, 3]
    # kept with the curves, read back, and kept by a calibration
    fresh = StreamCosts.empty()
    fresh.prefill.add(16, 0.05)
    fresh.step.add(1, 0.030)
    costs.install("e drafting", StreamCosts.load(costs.stream("e drafting").dump()))
    costs.install("e drafting", fresh)
    assert decode(0.5) == pytest.approx(10 * 0.022, rel=0.05)
