"""benchmarks/openai_fidelity.py's checks of seeded answers, which no engine's text can be compared for: whether a
sampled token lies in the support the request's options allow, read from its raw logprobs, and what counts as the
same answer as vLLM's server's."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "openai_fidelity", Path(__file__).resolve().parents[2] / "benchmarks" / "openai_fidelity.py")
fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity)
in_support = fidelity.in_support

#: raw probabilities 0.5, 0.3, 0.15, 0.05 (the whole vocabulary)
TOP = {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.15), "d": math.log(0.05)}


def test_top_p_keeps_the_tokens_until_the_mass_above_reaches_it():
    body = {"temperature": 1.0, "top_p": 0.9}
    assert in_support("a", TOP["a"], TOP, body)
    assert in_support("c", TOP["c"], TOP, body)  # 0.8 above: kept
    assert in_support("d", TOP["d"], TOP, body) is False  # 0.95 above
    assert in_support("c", TOP["c"], TOP, {"temperature": 1.0, "top_p": 0.75}) is False


def test_a_token_beyond_the_list_is_out_only_when_the_list_already_holds_top_p():
    top = {t: TOP[t] for t in "ab"}  # 0.8 listed
    assert in_support("d", TOP["d"], top, {"temperature": 1.0, "top_p": 0.9}) is None
    assert in_support("d", TOP["d"], top, {"temperature": 1.0, "top_p": 0.7}) is False


def test_vllms_extra_entry_for_the_sampled_token_does_not_make_it_listed():
    """vLLM's completions list the sampled token beside the k most likely: it is beyond them all the same."""
    top = {**{t: TOP[t] for t in "ab"}, "d": TOP["d"]}
    assert in_support("d", TOP["d"], top, {"temperature": 1.0, "top_k": 2}, k=2) is False
    assert in_support("b", TOP["b"], top, {"temperature": 1.0, "top_k": 2}, k=2)


def test_min_p_is_relative_to_the_most_likely_token_after_temperature():
    # 0.05 / 0.5 = 0.1 of the best at temperature 1; (0.1) ** (1 / 0.5) = 0.01 at temperature 0.5
    assert in_support("d", TOP["d"], TOP, {"temperature": 1.0, "min_p": 0.09})
    assert in_support("d", TOP["d"], TOP, {"temperature": 1.0, "min_p": 0.11}) is False
    assert in_support("d", TOP["d"], TOP, {"temperature": 0.5, "min_p": 0.02}) is False


def test_top_k_counts_the_more_likely_tokens():
    assert in_support("b", TOP["b"], TOP, {"temperature": 0.8, "top_k": 2})
    assert in_support("c", TOP["c"], TOP, {"temperature": 0.8, "top_k": 2}) is False


def test_top_p_after_top_k_is_over_what_top_k_kept():
    """0.5 / (0.5 + 0.3) = 0.625 above "b" once top-k 2 left only "a" and "b"."""
    assert in_support("b", TOP["b"], TOP, {"temperature": 1.0, "top_k": 2, "top_p": 0.7})
    assert in_support("b", TOP["b"], TOP, {"temperature": 1.0, "top_k": 2, "top_p": 0.6}) is False


def test_no_option_allows_every_token():
    assert in_support("z", -20.0, TOP, {"temperature": 1.0})


def answer(text: str, logprobs: list[float] | None = None) -> dict:
    choice = {"text": text}
    if logprobs is not None:
        choice["logprobs"] = {"tokens": list(text), "token_logprobs": logprobs,
                              "top_logprobs": [{t: lp} for t, lp in zip(text, logprobs)]}
    return {"status": 200, "body": {"choices": [choice]}}


def test_the_same_answer_allows_float_noise_in_logprobs_only():
    theirs = answer("ab", [-0.5, -1.0])
    assert fidelity.matches(fidelity.compare(answer("ab", [-0.5002, -1.0]), theirs))
    assert not fidelity.matches(fidelity.compare(answer("ab", [-0.5, -1.01]), theirs))
    assert not fidelity.matches(fidelity.compare(answer("ac", [-0.5, -1.0]), theirs))


def test_an_echoed_prompts_first_token_without_a_logprob_matches_only_none():
    theirs = answer("ab", [None, -1.0])
    theirs["body"]["choices"][0]["logprobs"]["top_logprobs"][0] = None
    ours = answer("ab", [None, -1.0])
    ours["body"]["choices"][0]["logprobs"]["top_logprobs"][0] = None
    assert fidelity.matches(fidelity.compare(ours, theirs))
    assert not fidelity.matches(fidelity.compare(answer("ab", [-3.0, -1.0]), theirs))


def test_vllms_chosen_token_beyond_the_k_most_likely_is_not_an_alternative_of_its_own():
    """vLLM's server lists a chosen token that is not among the k most likely as a k + 1-th entry; ModeSwitch lists
    the k most likely (OpenAI's meaning): the same alternatives, and the chosen token's logprob still compared."""
    theirs = answer("ab", [-0.5, -3.0])
    theirs["body"]["choices"][0]["logprobs"]["top_logprobs"][1] = {"b": -3.0, "x": -0.2, "y": -1.0}
    ours = answer("ab", [-0.5, -3.0])
    ours["body"]["choices"][0]["logprobs"]["top_logprobs"][1] = {"x": -0.2, "y": -1.0}
    row = fidelity.compare(ours, theirs, 2)
    assert fidelity.matches(row) and row["vllm_extra_alternatives"] == 1
    ours["body"]["choices"][0]["logprobs"]["top_logprobs"][1] = {"x": -0.2, "z": -1.0}
    assert not fidelity.compare(ours, theirs, 2)["same_alternatives"]
    ours["body"]["choices"][0]["logprobs"]["token_logprobs"][1] = -3.1
    assert fidelity.compare(ours, theirs, 2)["max_abs_logprob_diff"] > 0.09
