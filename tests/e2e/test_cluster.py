"""The cluster end to end on a real local Ray cluster: two replicas of the demo model (transformers engine,
prefix_cache mode) behind the Serve ingress, reached over HTTP with the OpenAI client.

Marked ``cluster`` (CI runs them; ``-m 'not cluster'`` skips them locally): starting Ray and two replicas takes
about half a minute, once for the module."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from modeswitch.cluster.app import ClusterConfig, application  # noqa: E402
from modeswitch.cluster.prefixes import BLOCK_CHARS  # noqa: E402
from modeswitch.config import HttpConfig, LoadConfig, ServerConfig  # noqa: E402
from modeswitch.serving.launcher import free_port  # noqa: E402
from modeswitch.resources import POLICIES_DIR  # noqa: E402
from waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.cluster

REPLICAS = 2


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # the paper table: its default is prefix_cache, the one mode loaded (the shipped default policy's lists are not)
    server = ServerConfig(model="demo", modes=("prefix_cache",), gate_report="none", policy=POLICIES_DIR / "paper.yaml",
                          calibrate=False, load=LoadConfig(backend="transformers", staged=False), http=HttpConfig(drain_timeout=5))
    serve.run(application(ClusterConfig(server=server, replicas=REPLICAS, stats_period_s=0.5)), name="modeswitch",
              route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _replicas(url: str) -> list[str]:
    resp = requests.get(f"{url}/v1/modes", timeout=30)
    assert resp.status_code == 200, resp.text
    return [r["replica"] for r in resp.json()["replicas"] if "modes" in r]


def test_openai_client_through_the_cluster(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster}/v1", api_key="none")
    names = _replicas(cluster)
    assert len(names) == REPLICAS
    raw = client.completions.with_raw_response.create(model="demo", prompt="The capital of France is",
                                                      max_tokens=4, temperature=0)
    completion = raw.parse()
    assert completion.choices[0].text
    replica = completion.model_extra["modeswitch"]["replica"]
    assert replica in names and raw.headers["X-ModeSwitch-Replica"] == replica
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].message.content is not None
    pieces = [c.choices[0].text for c in client.completions.create(model="demo", prompt="Once upon a time",
                                                                    max_tokens=6, temperature=0, stream=True)
              if c.choices]
    assert len("".join(pieces)) > 0
    # a bad request is the single server's own 400, through the ingress
    bad = requests.post(f"{cluster}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_modes_and_metrics_cover_every_replica(cluster):
    assert requests.get(f"{cluster}/health", timeout=30).json() == {"status": "ok", "replicas": REPLICAS}
    body = requests.get(f"{cluster}/v1/modes", timeout=30).json()
    assert [m["name"] for r in body["replicas"] for m in r["modes"]] == ["prefix_cache"] * REPLICAS
    text = requests.get(f"{cluster}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["vllm:num_requests_running"].samples
    assert sorted(s.labels["replica"] for s in running) == sorted(_replicas(cluster))


def test_a_policy_change_reaches_every_replica(cluster):
    def policies() -> list[str]:
        got = requests.get(f"{cluster}/admin/policy", timeout=30)
        assert got.status_code == 200, got.text
        return [r["name"] for r in got.json()["replicas"]]

    assert policies() == ["paper"] * REPLICAS
    try:
        changed = requests.post(f"{cluster}/admin/policy", json={"path": str(POLICIES_DIR / "fp16.yaml")}, timeout=30)
        assert changed.status_code == 200 and policies() == ["fp16"] * REPLICAS
        refused = requests.post(f"{cluster}/admin/policy", json={"path": "/etc/passwd"}, timeout=30)
        assert refused.status_code == 400 and policies() == ["fp16"] * REPLICAS
    finally:
        requests.post(f"{cluster}/admin/policy", json={"path": str(POLICIES_DIR / "paper.yaml")}, timeout=30)
    assert policies() == ["paper"] * REPLICAS


def test_a_repeated_long_prefix_goes_to_the_replica_that_holds_it(cluster):
    prefix = ("Shared context for every question in this group. " * 20)[: 12 * BLOCK_CHARS]
    first = requests.post(f"{cluster}/v1/completions", json={"prompt": prefix + "Question 0?", "max_tokens": 2,
                                                             "temperature": 0}, timeout=60).json()
    holder = first["modeswitch"]["replica"]
    time.sleep(1.0)  # one stats period: the holder now publishes the prefix too
    for i in range(1, 5):
        got = requests.post(f"{cluster}/v1/completions", json={"prompt": prefix + f"Question {i}?",
                                                               "max_tokens": 2, "temperature": 0}, timeout=60).json()
        assert got["modeswitch"]["replica"] == holder
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _complete(url: str, prompt: str, max_tokens: int = 2) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}, timeout=120)


def test_a_replica_killed_mid_request_loses_nothing(cluster):
    """Four long requests in flight on both replicas; one replica is killed: the requests it held are retried
    on the other, later ones go around it, every answer is a 200."""
    victim = _replicas(cluster)[0]
    actor = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"])
    with ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(_complete, cluster, f"Story number {i}: once upon a time", 48) for i in range(4)]
        # all four go out, two to each replica (about 2 s each, one at a time): killed once it holds one
        on_victim = wait_for(lambda: sum(m["in_flight"] for v in requests.get(f"{cluster}/v1/modes", timeout=30)
                                         .json()["replicas"] if v["replica"] == victim for m in v.get("modes", ())))
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
        answers = [f.result() for f in in_flight]
    assert on_victim > 0  # the kill caught requests on the killed replica: they are among the answers below
    answers += [_complete(cluster, f"Request {i}") for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
    assert all(a.json()["modeswitch"]["replica"] != victim for a in answers)
