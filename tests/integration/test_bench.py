"""The benchmark harness: workloads of real text, the streaming client against the real server, the oracle,
regret, the comparison table and the plots."""

from __future__ import annotations

import pytest

from modeswitch.bench import report
from modeswitch.bench.client import send
from modeswitch.bench.workloads import (REFERENCE, Shape, TextSource, arrivals, prefix_reuse, rotated,
                                        rotated_rounds, trace)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from modeswitch.weights.presets import local_or_hub, resolve_preset

    return AutoTokenizer.from_pretrained(local_or_hub(resolve_preset("demo").fp16, "tokenizer"))


@pytest.fixture(scope="module")
def source(tokenizer):
    return TextSource(tokenizer)


def test_traces_have_the_same_shapes_in_every_run_but_their_own_text(source):
    shapes = [s.scaled(0.05) for s in REFERENCE]
    assert shapes[4] == Shape("shared_prefix", 51, 6, 38)
    a, b = trace(source, shapes, 12, run=1), trace(source, shapes, 12, run=2)
    assert [s.workload for s in a] == [s.workload for s in b]
    assert all(len(x.prompt_ids) == len(y.prompt_ids) and x.max_tokens == y.max_tokens for x, y in zip(a, b))
    assert all(x.prompt_ids[:8] != y.prompt_ids[:8] for x, y in zip(a, b))  # no prefix carries across runs
    shared = [s.prompt_ids[:38] for s in a if s.workload == "shared_prefix"]
    assert len(shared) >= 2 and all(p == shared[0] for p in shared)
    firsts = [s.prompt_ids[:8] for s in a if s.workload != "shared_prefix"]
    assert len({tuple(p) for p in firsts}) == len(firsts)  # every other prompt starts differently


def test_the_changing_workload_has_its_phases_and_copying_prompts(tokenizer):
    """Each phase at its concurrency; the lulls alternate prompts to copy with prose; the shared-prefix questions
    share one document; a run's text is its own and the same for every server."""
    from modeswitch.bench.phases import phases
    from modeswitch.controller.speculation import ngram_replay

    lull, burst, shared, lull2 = phases(tokenizer, run=0)
    assert [p.name for p in (lull, burst, shared, lull2)] == ["lull", "burst", "shared_prefix", "lull2"]
    assert (lull.concurrency, burst.concurrency, shared.concurrency) == (1, 12, 4)
    assert [s.workload for s in lull.slots] == ["lull:copy", "lull:prose"] * 3
    # a faithful answer to a copying prompt is drafted several tokens a step from the prompt itself
    quote = tokenizer.decode(lull.slots[0].prompt_ids).split("nothing:\n\n")[1].split("<|im_end|>")[0]
    answer = tokenizer(quote).input_ids
    assert len(answer) / ngram_replay(lull.slots[0].prompt_ids, answer).steps > 3
    assert all(len(s.prompt_ids) == 256 for s in burst.slots)
    document = [s.prompt_ids[:500] for s in shared.slots]
    assert all(d == document[0] for d in document) and len({tuple(s.prompt_ids) for s in shared.slots}) == 12
    again = phases(tokenizer, run=0)
    assert [s.prompt_ids for s in again[0].slots] == [s.prompt_ids for s in lull.slots]
    assert phases(tokenizer, run=1)[1].slots[0].prompt_ids != burst.slots[0].prompt_ids


def test_a_salted_run_has_the_same_text_behind_another_opening(tokenizer):
    """``salt``: every prompt of the run opens with a marker of its own, within its first 48 tokens, so nothing
    of it is found in a prefix cache that holds the unsalted run; behind the marker the text is the run's own
    (the same document, the same text to copy), and a burst window keeps its length."""
    from modeswitch.bench.phases import phases

    plain, salted = phases(tokenizer, run=0), phases(tokenizer, run=0, salt=3)
    for a, b in zip(plain, salted):
        assert (a.name, a.concurrency, len(a.slots)) == (b.name, b.concurrency, len(b.slots))
        for x, y in zip(a.slots, b.slots):
            cut = next(i for i, (p, q) in enumerate(zip(x.prompt_ids, y.prompt_ids)) if p != q)
            assert cut < 48 and x.max_tokens == y.max_tokens and x.workload == y.workload
            if a.name == "burst":
                assert len(y.prompt_ids) == len(x.prompt_ids) and tokenizer.decode(y.prompt_ids).startswith("[3] ")
                k = len(tokenizer.encode("[3] ", add_special_tokens=False))
                assert y.prompt_ids[k:] == x.prompt_ids[:-k]
            else:
                assert "[3] " in tokenizer.decode(y.prompt_ids) and "[3] " not in tokenizer.decode(x.prompt_ids)
                assert tokenizer.decode(y.prompt_ids).replace("[3] ", "", 1) == tokenizer.decode(x.prompt_ids)


def test_prefix_reuse_and_arrival_patterns(source):
    slots = prefix_reuse(source, 12, run=3, prompt_tokens=40, max_tokens=4, prefix_fraction=0.5, prefixes=3)
    assert len({tuple(s.prompt_ids[:20]) for s in slots}) <= 3 and all(len(s.prompt_ids) == 40 for s in slots)
    poisson = [s.at for s in arrivals(slots, "poisson", rate=2.0)]
    assert poisson == sorted(poisson) and 1.0 < poisson[-1] < 20.0
    assert [s.at for s in arrivals(slots, "burst", rate=2.0, burst=4)][:8] == [0, 0, 0, 0, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="unknown arrival"):
        arrivals(slots, "tidal")


def test_runs_against_the_server_the_oracle_and_the_report(server, source, tmp_path):
    shapes = [Shape("short", 12, 4), Shape("long", 60, 4)]
    runs = {}
    for i, mode in enumerate(["fp16", "prefix_cache"]):
        runs[f"mode:{mode}"] = send(server.url, trace(source, shapes, 4, run=10 + i), mode)
    runs["paper"] = send(server.url, arrivals(trace(source, shapes, 4, run=12), "poisson", rate=20.0))
    # several servers take the slots in turn (round robin): here the second refuses every connection
    turns = send([server.url, "http://127.0.0.1:9"], trace(source, shapes, 4, run=13))
    assert [r["ok"] for r in turns] == [True, False, True, False]
    for records in runs.values():
        assert [r["slot"] for r in records] == [0, 1, 2, 3] and all(r["ok"] for r in records)
        assert all(1 <= r["tokens"] <= 4 and r["ttft_s"] <= r["latency_s"] and r["energy_j"] > 0 for r in records)
    assert {r["mode"] for r in runs["mode:prefix_cache"]} == {"prefix_cache"}
    best = report.oracle({"fp16": runs["mode:fp16"], "prefix_cache": runs["mode:prefix_cache"]},
                         allowed=["fp16", "prefix_cache"])
    for r in best:
        assert r["latency_s"] == min(runs[k][r["slot"]]["latency_s"] for k in ("mode:fp16", "mode:prefix_cache"))
    assert report.oracle({"fp16": runs["mode:fp16"]}, allowed=["prefix_cache"]) == []
    assert report.regret(best, best) == [0.0] * 4 and min(report.regret(runs["paper"], best)) > -60
    runs["oracle"] = best
    rows = {r["run"]: r for r in report.compare(runs)}
    assert rows["mode:fp16"]["speedup_mean"] == 1.0 and rows["oracle"]["speedup_mean"] >= 1.0
    assert rows["paper"]["energy_source"] == "estimated" and rows["paper"]["j_per_token"] > 0
    share = report.oracle_gain_share(runs, "oracle")
    assert share is None or share == pytest.approx(1.0)
    table = report.markdown(report.compare(runs), {"paper": "all modes pass"})
    assert table.count("\n") == 5 and "| paper |" in table and "all modes pass" in table
    pngs = report.plots(tmp_path, "t", runs, "paper", best)
    assert {p.name for p in pngs} == {"t_latency_cdf.png", "t_j_per_token.png", "t_mode_mix.png", "t_regret.png"}
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_rotated_rounds_run_every_contender_once_a_round_in_a_rotated_order():
    order = rotated_rounds(["a", "b", "c"], 4)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"] and rotated([], 2) == []


def test_a_paused_server_takes_no_cpu_answers_nothing_and_resumes(tmp_path):
    """``Server.pause`` stops every process of a server (its own and its children) until ``resume``; ``stop``
    ends a paused one all the same."""
    import subprocess
    import sys
    import time

    import psutil
    import requests

    from modeswitch.bench.servers import Server
    from modeswitch.serving.launcher import free_port

    (tmp_path / "health").write_text("ok")
    port = free_port()
    # a parent that serves /health and a child that spins: what an idle vLLM server and its engine core do
    code = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
            f"import http.server, functools; http.server.ThreadingHTTPServer(('127.0.0.1', {port}), "
            f"functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(tmp_path)!r})).serve_forever()")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    server = Server("probe", proc=proc, url=f"http://127.0.0.1:{port}")
    processes = []
    try:
        for _ in range(100):  # up
            try:
                requests.get(server.url + "/health", timeout=5)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        processes = server.processes()
        assert len(processes) == 2
        server.pause()
        assert {p.status() for p in processes} == {psutil.STATUS_STOPPED}
        spent = server.cpu_seconds()
        with pytest.raises(requests.Timeout):
            requests.get(server.url + "/health", timeout=0.5)
        assert server.cpu_seconds() == spent  # the spinning child too
        server.resume()
        assert not server.paused and requests.get(server.url + "/health", timeout=5).status_code == 200
        assert psutil.STATUS_STOPPED not in {p.status() for p in processes}
        server.pause()
    finally:
        server.stop()
        for p in processes[1:]:  # the spinning child, which its parent's end leaves running
            p.kill()
    assert proc.poll() is not None and not server.paused


def test_a_server_keeps_the_cpu_its_ended_engines_used():
    """An engine process that ended (replaced by its compiled one, or restarted) still counts in the server's CPU
    seconds: a phase's engine CPU is never below 0."""
    import subprocess
    import sys
    import time

    import psutil

    from modeswitch.bench.servers import cpu_seconds

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.run([sys.executable, '-c', {spin!r}]); time.sleep(30)"])
    try:
        server, deadline = psutil.Process(parent.pid), time.monotonic() + 20
        while not server.children():  # the engine starts
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while server.children():  # it spins, then ends
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cpu_seconds(parent.pid)[1] >= 0.4
    finally:
        parent.kill()
        parent.wait()
