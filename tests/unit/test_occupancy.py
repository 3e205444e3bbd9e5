"""The server-wide occupancy gauges Kubernetes inference gateways scrape (vLLM's names, ``model_name`` label):
their aggregation over modes and shared KV pools, and their values on the in-process fake server while
requests wait and run."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import requests
from prometheus_client.parser import text_string_to_metric_families

from modeswitch.engines.base import KvUse, paged_tokens
from modeswitch.serving.occupancy import Occupancy, occupancy
from modeswitch.testing.engine import Script

GATEWAY_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


class StubEngine:
    def __init__(self, waiting: int, running: int, kv: KvUse | None = None) -> None:
        self.split, self.kv = (waiting, running), kv

    def waiting_running(self) -> tuple[int, int]:
        return self.split

    def kv_use(self) -> KvUse | None:
        return self.kv


def registry_of(**engines) -> SimpleNamespace:
    return SimpleNamespace(modes={name: SimpleNamespace(engine=e) for name, e in engines.items()})


def test_modes_are_summed_and_a_shared_kv_pool_is_counted_once():
    runner, pool = object(), object()
    registry = registry_of(
        a=StubEngine(2, 3, KvUse(runner, 300, 1000)),
        b=StubEngine(1, 4, KvUse(runner, 300, 1000)),  # a second front on the same runner
        c=StubEngine(0, 1, KvUse(pool, 500, 1000)),
        d=StubEngine(5, 1),  # no reserved pool
        off=None)  # an unavailable mode
    assert occupancy(registry) == Occupancy(waiting=8, running=9, kv_cache_usage=0.4,
                                            per_mode={"a": (2, 3), "b": (1, 4), "c": (0, 1), "d": (5, 1)})


def test_without_a_reserved_kv_pool_usage_reads_zero():
    assert occupancy(registry_of(a=StubEngine(0, 1))).kv_cache_usage == 0.0


def test_paged_kv_is_counted_in_whole_blocks():
    assert paged_tokens([1, 64, 65, 0], 64) == 64 + 64 + 128


def gauges(app) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(app.get("/metrics").get_data(as_text=True)):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def server_wide(samples: dict) -> tuple[float, float, float]:
    return tuple(samples[(name, (("model_name", "demo"),))] for name in GATEWAY_GAUGES)


def test_gauges_carry_the_model_name_and_read_zero_when_idle(make_app):
    app = make_app()
    app.complete("Hello", max_tokens=3)
    samples = gauges(app)
    assert server_wide(samples) == (0, 0, 0)
    assert {n for n, labels in samples if n.startswith("vllm:")} == set(GATEWAY_GAUGES)
    assert all(labels == (("model_name", "demo"),) for n, labels in samples if n.startswith("vllm:"))
    assert samples[("modeswitch_mode_waiting", (("mode", "fp16"),))] == 0


def test_held_requests_show_as_running_up_to_each_mode_batch_and_waiting_beyond(make_app):
    """fp16 generates one request at a time, prefix_cache four: three streams on fp16 and two on prefix_cache
    are 3 running (1 + 2) and 2 waiting (fp16's queue). Dropping the streams cancels them: back to zero."""
    app = make_app(scripts={"fp16": Script(token_s=0.05, batch=1), "prefix_cache": Script(token_s=0.05, batch=4)})
    url = app.serve()
    release = threading.Event()

    def hold(mode: str) -> None:
        body = {"prompt": "A long story", "max_tokens": 400, "mode": mode, "stream": True}
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
            assert resp.status_code == 200
            release.wait(timeout=10)

    clients = [threading.Thread(target=hold, args=(mode,)) for mode in ["fp16"] * 3 + ["prefix_cache"] * 2]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 3
    while (now := gauges(app)) and server_wide(now)[:2] != (2, 3) and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    for client in clients:
        client.join()
    assert server_wide(now) == (2, 3, 0)
    assert now[("modeswitch_mode_waiting", (("mode", "fp16"),))] == 2
    assert now[("modeswitch_mode_running", (("mode", "fp16"),))] == 1
    assert now[("modeswitch_mode_running", (("mode", "prefix_cache"),))] == 2
    deadline = time.monotonic() + 3
    while server_wide(gauges(app)) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server_wide(gauges(app)) == (0, 0, 0)
