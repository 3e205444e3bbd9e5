"""The gate's verdict intervals: a paired bootstrap over the documents a mode and the reference both scored; a
verdict whose interval is wider than its tolerance is marked uncertain, with the documents it would need."""

from __future__ import annotations

import pytest

from modeswitch.evals.gate import mark, render
from modeswitch.evals.intervals import documents_needed, paired_interval, per_document, uncertain


def accuracy(n: int, wrong: set[int], lost: set[int] = frozenset()) -> dict[str, float]:
    """``n`` documents, wrong on ``wrong``; ``lost``: further documents this one gets wrong."""
    return {str(d): 0.0 if d in wrong | lost else 1.0 for d in range(n)}


def test_lm_eval_samples_become_per_document_scores():
    samples = [{"doc_id": 0, "filter": "first_word", "exact_match": 1.0},
               {"doc_id": 0, "filter": "none", "exact_match": 0.0},
               {"doc_id": 1, "filter": "first_word", "exact_match": 0.0}]
    assert per_document(samples, "exact_match,first_word") == {"0": 1.0, "1": 0.0}
    rolling = [{"doc_id": 3, "word_perplexity": [-120.5, 40]}]
    assert per_document(rolling, "word_perplexity,none") == {"3": (-120.5, 40.0)}


def test_the_interval_is_paired_and_narrows_as_documents_grow():
    """Two scorers wrong on the same documents differ by nothing, however many they get wrong (unpaired standard
    errors would say +-6 pp); a mode losing 1 in 50 documents has a -2 pp change inside its interval, which shrinks
    by about sqrt(4) with 4x the documents."""
    same = accuracy(100, set(range(0, 100, 3)))
    assert paired_interval(same, dict(same), higher_is_better=True)[:2] == (0.0, 0.0)
    widths = []
    for n in (200, 800):
        ref = accuracy(n, set(range(0, n, 4)))
        mode = accuracy(n, set(range(0, n, 4)), lost=set(range(1, n, 50)))
        lo, hi, docs = paired_interval(mode, ref, higher_is_better=True)
        assert docs == n and lo < -2.0 < hi < 0
        widths.append(hi - lo)
    assert 1.6 < widths[0] / widths[1] < 2.5
    # only documents both scored count
    assert paired_interval({"0": 1.0, "1": 0.0, "7": 1.0}, {"0": 1.0, "1": 1.0}, True)[2] == 2


def test_perplexity_intervals_resample_log_likelihoods_and_words():
    ref = {str(d): (-100.0, 25.0) for d in range(60)}
    mode = {str(d): (-100.0 - (2.0 if d % 2 else 0.0), 25.0) for d in range(60)}  # +1 nat per 25 words on average
    lo, hi, _ = paired_interval(mode, ref, higher_is_better=False)
    expected = ((2.71828 ** (101 / 25)) / (2.71828 ** (100 / 25)) - 1) * 100  # exp(1/25) - 1: +4.1 %
    assert lo < expected < hi and lo > 0


def test_documents_needed_scales_with_the_square_of_the_half_width():
    assert documents_needed(4.0, 100, 1.0) == 1600
    assert documents_needed(0.5, 100, 1.0) == 100


def gate_report(n: int, lost: int) -> dict:
    """A report of two modes over ``n`` cloze documents: the reference wrong on a quarter, ``close`` on ``lost``
    more, its per-document scores kept (as run_gate keeps them)."""
    ref = accuracy(n, set(range(0, n, 4)))
    mode = accuracy(n, set(range(0, n, 4)), lost=set(range(1, 1 + 4 * lost, 4)))

    def row(scores: dict) -> dict:
        return {"cloze": {"metric": "acc,none", "value": sum(scores.values()) / n, "stderr": 0.04}}

    return {"model": "demo", "date": "today", "limit": n, "seconds": 1.0,
            "tolerance": {"max_drop_pp": 1.0, "max_ppl_increase_pct": 10.0},
            "tasks": {"cloze": {"metric": "acc,none", "higher_is_better": True}},
            "modes": {"fp16": row(ref), "close": row(mode)}, "unavailable": {},
            "documents": {"fp16": {"cloze": ref}, "close": {"cloze": mode}}}


@pytest.mark.parametrize("n, lost, uncertain, passes",
                         [(100, 1, True, True), (20000, 20, False, True), (100, 20, False, False)])
def test_a_verdict_whose_interval_straddles_its_tolerance_is_uncertain_and_says_how_many_documents_it_needs(
        n, lost, uncertain, passes):
    """100 documents, one lost: -1.0 pp passes a 1 pp tolerance as a point estimate, but its interval reaches past
    -1 pp; 20,000 documents with a tenth of that rate pin a pass down; 20 of 100 lost is a failure however wide its
    interval."""
    report = gate_report(n, lost)
    mark(report)
    entry = report["modes"]["close"]["cloze"]
    assert entry["pass"] is passes and entry["uncertain"] is uncertain and "ci" not in report["modes"]["fp16"]["cloze"]
    lo, hi = entry["ci"]
    assert lo <= entry["delta_pp"] <= hi
    row = next(line for line in render(report).splitlines() if line.startswith("| close |"))
    assert (f"| {'pass' if passes else 'fail'} (uncertain) |" in row) is uncertain
    if uncertain:
        assert entry["documents_needed"] > n and f"needs ~{entry['documents_needed']} documents" in row


def test_uncertain_means_the_interval_holds_a_pass_and_a_fail():
    assert uncertain(-3.0, 0.0, 1.0, higher_is_better=True) and not uncertain(-0.9, 5.0, 1.0, True)
    assert not uncertain(-92.0, -42.0, 1.0, True)
    assert uncertain(8.0, 12.0, 10.0, higher_is_better=False) and not uncertain(11.0, 40.0, 10.0, False)
