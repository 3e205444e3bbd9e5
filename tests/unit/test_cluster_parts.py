"""The cluster's parts that need no Ray cluster: prefix summaries, routing text, merged metrics, and a replica
answering forwarded requests (the single server's app over the fake backend) and scoring its gate-pending modes
behind them."""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve")

from modeswitch.cluster.ingress import merge_metrics  # noqa: E402
from modeswitch.cluster.prefixes import BLOCK_CHARS, PrefixLog, block_hashes, matched_blocks  # noqa: E402
from modeswitch.cluster.replica import ReplicaServer  # noqa: E402
from modeswitch.cluster.wire import Answer, Forwarded, routing_text  # noqa: E402
from modeswitch.config import LoadConfig, ServerConfig  # noqa: E402
from modeswitch.controller.quality import runs  # noqa: E402
from modeswitch.evals.behind import QUIET_S  # noqa: E402
from modeswitch.testing.backend import FakeBackend  # noqa: E402
from modeswitch.testing.engine import Script  # noqa: E402
from test_gate_kernels import FP32, INT8_FP32  # noqa: E402


def test_block_hashes_match_shared_prefixes_to_the_block():
    shared = "s" * (3 * BLOCK_CHARS)
    a, b = block_hashes(shared + "x" * BLOCK_CHARS), block_hashes(shared + "y" * BLOCK_CHARS)
    assert len(a) == len(b) == 4
    assert a[:3] == b[:3] and a[3] != b[3]
    assert matched_blocks(b, set(a).__contains__) == 3
    assert block_hashes("z" * (BLOCK_CHARS - 1)) == []  # no whole block, nothing an engine could reuse
    # chained: the same block text after a different prefix is a different block
    assert block_hashes("p" * BLOCK_CHARS + "q" * BLOCK_CHARS)[1] != block_hashes("r" * BLOCK_CHARS + "q" * BLOCK_CHARS)[1]


def test_prefix_log_keeps_what_a_cache_of_its_size_keeps():
    log = PrefixLog(capacity_tokens=100)
    old, new, other = "o" * (3 * BLOCK_CHARS), "n" * (3 * BLOCK_CHARS), "p" * (3 * BLOCK_CHARS)
    log.record(old, 60)
    log.record(new, 30)
    log.record(old + "!", 40)  # 130 tokens: the least recently used prompt goes, whole...
    held = set(log.summary())
    assert matched_blocks(block_hashes(old), held.__contains__) == 3  # ...but its blocks stay: a newer prompt shares them
    assert matched_blocks(block_hashes(new), held.__contains__) == 3
    log.record(other, 50)
    held = set(log.summary())
    assert matched_blocks(block_hashes(new), held.__contains__) == 0
    assert matched_blocks(block_hashes(other), held.__contains__) == 3
    log.record("x" * BLOCK_CHARS, 101)  # larger than the cache: never held
    assert matched_blocks(block_hashes("x" * BLOCK_CHARS), set(log.summary()).__contains__) == 0


def test_routing_text_of_completions_and_chat():
    assert routing_text("/v1/completions", b'{"prompt": "abc", "stream": true}') == ("abc", True)
    assert routing_text("/v1/completions", b'{"prompt": ["first", "second"]}') == ("first", False)
    assert routing_text("/v1/completions", b'{"prompt": [17, 4, 9]}') == ("17|4|9|", False)
    assert routing_text("/v1/completions", b'{"prompt": [[17, 4], [5]]}') == ("17|4|", False)
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    text, stream = routing_text("/v1/chat/completions", json.dumps(chat).encode())
    assert text == "<system>be brief<user>hi" and not stream
    # what cannot be read still goes through (the replica answers the error); other routes carry no prompt
    assert routing_text("/v1/completions", b"{not json") == ("", False)
    assert routing_text("/v1/completions", b"[1, 2]") == ("", False)
    assert routing_text("/v1/models", b'{"prompt": "abc"}') == ("", False)


def test_merged_metrics_label_each_replica_and_keep_families_whole():
    text_a = ('# HELP reqs_total Requests\n# TYPE reqs_total counter\nreqs_total{mode="fp16"} 3.0\n'
              '# HELP up Up\n# TYPE up gauge\nup 1.0\n')
    text_b = '# HELP reqs_total Requests\n# TYPE reqs_total counter\nreqs_total{mode="fp16"} 5.0\n'
    merged = merge_metrics({"a": text_a, "b": text_b})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    reqs = {s.labels["replica"]: s.value for s in families["reqs"].samples}
    assert reqs == {"a": 3.0, "b": 5.0}
    assert [s.labels for s in families["up"].samples] == [{"replica": "a"}]
    assert merged.count("# TYPE reqs_total counter") == 1


@pytest.fixture
def replica(tmp_path):
    backend = FakeBackend(default=Script(prefix_cache=True))
    config = ServerConfig(model="demo", modes=("fp16", "prefix_cache"), gate_report="none", calibrate=False,
                          costs_file=tmp_path / "costs.json", load=LoadConfig(backend="transformers", staged=False))
    core = ReplicaServer(config, "r1", backend=backend)
    yield core
    core.close()


def _completion(prompt: str, **fields) -> Forwarded:
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}).encode()
    text, stream = routing_text("/v1/completions", body)
    return Forwarded("POST", "/v1/completions", headers=[("Content-Type", "application/json")], body=body,
                     client="10.0.0.9", prompt=text, stream=stream)


def test_replica_answers_with_the_single_servers_api_and_names_itself(replica):
    got = replica.answer(_completion("Hello there"))
    assert got.status == 200
    body = json.loads(got.body)
    assert body["modeswitch"]["replica"] == "r1"
    assert dict(got.headers)["X-ModeSwitch-Replica"] == "r1"
    bad = replica.answer(Forwarded("POST", "/v1/completions", headers=[("Content-Type", "application/json")],
                                   body=b'{"prompt": "x", "max_tokens": -1}'))
    assert bad.status == 400 and json.loads(bad.body)["error"]["param"] == "max_tokens"


def test_replica_streams_its_head_with_the_first_token_then_the_rest(replica):
    parts = list(replica.stream(_completion("Hello there", stream=True)))
    head, frames = parts[0], b"".join(parts[1:]).decode()
    assert isinstance(head, Answer) and head.status == 200
    assert dict(head.headers)["Content-Type"].startswith("text/event-stream")
    # the head waits for the first token: the role frame and the first text frame come together
    first, token = [json.loads(f[6:]) for f in head.body.decode().split("\n\n") if f.startswith("data: ")]
    assert first["modeswitch"]["replica"] == "r1" and token["choices"][0]["text"]
    assert frames.rstrip().endswith("data: [DONE]")


def test_replica_stats_report_modes_load_and_the_prompts_it_took(replica):
    prompt = "q" * (2 * BLOCK_CHARS + 5)
    replica.answer(_completion(prompt))
    stats = replica.routing_stats()
    assert stats["replica"] == "r1" and sorted(stats["modes"]) == ["fp16", "prefix_cache"]
    assert stats["waiting"] == 0 and stats["running"] == 0
    assert matched_blocks(block_hashes(prompt), set(stats["prefix_blocks"]).__contains__) == 2


# ---------------------------------------------------------------------------------------------- the gate, scored here
#: kernels no run of the shipped vLLM report was scored on: a machine that report's rows do not hold for
NEW_KERNELS = {"fp16": {**FP32, "kernel": "a kernel no shipped run names"},
               "int8": {**INT8_FP32, "kernel": "a kernel no shipped run names"}}


def replica_on_new_kernels(tmp_path: Path, name: str) -> tuple[ReplicaServer, FakeBackend]:
    """A replica enforcing the shipped vLLM report (as a replica of ``--backend vllm`` does) on engines whose
    kernels it has no run on: int8 is gate pending, and the replica may score it (its cache is the test's)."""
    backend = FakeBackend(kernels=NEW_KERNELS, gate_key="vllm")
    config = ServerConfig(model="demo", modes=("fp16", "int8"), calibrate=False, costs_file=tmp_path / f"{name}.json",
                          load=LoadConfig(backend="transformers", staged=False))
    return ReplicaServer(config, name, backend=backend), backend


def locked(path: Path) -> bool:
    """Whether another open file holds the lock on ``path`` (a scorer's turn on the report)."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def test_replicas_sharing_a_cache_score_a_pending_mode_once_behind_their_requests(tmp_path, monkeypatch):
    """Two replicas on one machine: the first to take the report's lock scores int8 and the reference between the
    requests forwarded to it (one held open keeps it waiting), keeps the run in the shared cache and advertises
    int8 to the router once it passes; the second waits for the lock, reads that run and scores nothing."""
    monkeypatch.setenv("MODESWITCH_CACHE", str(tmp_path / "cache"))
    first, first_engines = replica_on_new_kernels(tmp_path, "r1")
    try:
        assert first.server.service.controller.quality_verdicts()["int8"].status == "pending"
        assert first.routing_stats()["modes"] == ["fp16"]  # a pending mode is not offered to the router
        held = first.stream(_completion("Hello there", stream=True))
        assert next(held).status == 200  # answered in part, its ticket not returned: a request in flight
        assert first.server.admission.idle_s() == 0
        lock = tmp_path / "cache" / "gate" / "demo-vllm.json.lock"
        deadline = time.monotonic() + 10
        while not (lock.exists() and locked(lock)):
            assert time.monotonic() < deadline, "the first replica's scorer never took its turn"
            time.sleep(0.05)
        second, second_engines = replica_on_new_kernels(tmp_path, "r2")
        try:
            before = {m: (first_engines.engines[m].submitted, second_engines.engines[m].submitted) for m in NEW_KERNELS}
            time.sleep(QUIET_S + 1)  # the first scorer has its tasks loaded (~2 s); the held request holds it back
            assert {m: (first_engines.engines[m].submitted, second_engines.engines[m].submitted)
                    for m in NEW_KERNELS} == before
            ended = time.monotonic()  # before the request's end: the quiet it counts from starts after this
            held.close()  # the request is answered; the replica's admission counts QUIET_S of quiet from here
            while sum(first_engines.engines[m].submitted for m in NEW_KERNELS) == sum(b[0] for b in before.values()):
                assert time.monotonic() - ended < 30, "the first replica never scored"
                time.sleep(0.01)
            assert time.monotonic() - ended >= QUIET_S
            for replica in (first, second):
                replica.scorer.thread.join(60)
                assert not replica.scorer.thread.is_alive()
                assert replica.server.service.controller.quality_verdicts()["int8"].status == "pass"
            assert first_engines.engines["int8"].submitted > before["int8"][0] + 100  # scored on the first
            assert second_engines.engines["int8"].submitted == before["int8"][1]  # and only there
            assert sorted(first.routing_stats()["modes"]) == ["fp16", "int8"]
            kept = json.loads((tmp_path / "cache" / "gate" / "demo-vllm.json").read_text())
            assert [r["kernels"]["int8"]["kernel"] for r in runs(kept)] == ["a kernel no shipped run names"]
        finally:
            second.close()
    finally:
        first.close()


def test_a_replica_that_closes_stops_its_scorer(tmp_path, monkeypatch, caplog):
    """Closed while a request holds its scoring back, the replica's scorer sends nothing more and ends quietly
    (a scorer left running would go on against the closed engines once the request ends, and fail)."""
    monkeypatch.setenv("MODESWITCH_CACHE", str(tmp_path / "cache"))
    replica, engines = replica_on_new_kernels(tmp_path, "r1")
    held = replica.stream(_completion("Hello there", stream=True))
    next(held)
    submitted = {m: engines.engines[m].submitted for m in NEW_KERNELS}
    replica.close()
    held.close()
    replica.scorer.thread.join(30)
    assert not replica.scorer.thread.is_alive()
    assert {m: engines.engines[m].submitted for m in NEW_KERNELS} == submitted
    assert not [r for r in caplog.records if r.name == "modeswitch.evals.behind"]
    assert not (tmp_path / "cache" / "gate" / "demo-vllm.json").exists()
