"""Prometheus metrics (``GET /metrics``).

Counters and histograms are updated as requests finish; per-mode state (queue depth, availability,
quarantine, the engines' own prefix-cache and speculative counters) and memory are read at scrape time
by a collector, so they are never stale and cost nothing between scrapes. Ratios (hit rates, acceptance)
are left to the query side: everything counted is a counter.

The server's occupancy is also exported under vLLM's names (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, labelled ``model_name`` as vLLM labels them):
what Kubernetes inference gateways' endpoint pickers scrape, so they route to a ModeSwitch pod unchanged
(see :mod:`modeswitch.serving.occupancy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .occupancy import occupancy

if TYPE_CHECKING:
    from ..controller.completed import Completed
    from .registry import ModeRegistry

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3)

#: engine statistic -> (metric name, help) exported as per-mode counters at scrape time
ENGINE_COUNTERS = {
    "prefix_queries": ("modeswitch_prefix_cache_queries", "Prefix-cache lookups"),
    "prefix_hits": ("modeswitch_prefix_cache_hits", "Prefix-cache lookups that reused stored KV"),
    "prefix_hit_tokens": ("modeswitch_prefix_cache_hit_tokens", "Prompt tokens whose KV was reused"),
    "spec_steps": ("modeswitch_spec_target_steps", "Target-model steps of speculative decoding"),
    "spec_tokens": ("modeswitch_spec_tokens", "Tokens produced by speculative decoding (accepted drafts + 1 per step)"),
    "engine_deaths": ("modeswitch_engine_deaths",
                      "Deaths of the engine the mode runs on (a process or worker thread of it exited, or it wedged)"),
    "engine_restarts": ("modeswitch_engine_restarts", "Times the engine the mode runs on was started again"),
    "engine_parks": ("modeswitch_engine_crash_loops",
                     "Crash loops of the engine the mode runs on (each parked it for a backoff)"),
}


class _RegistryCollector:
    """Reads per-mode state, occupancy and memory from the mode registry on every scrape."""

    def __init__(self, registry: "ModeRegistry", model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def _occupancy(self):
        """The server-wide gauges a gateway's endpoint picker reads, under vLLM's names and label (the KV
        figure is a fraction, 1 meaning full, as vLLM's is despite its name), and the per-mode split."""
        now = occupancy(self.registry)
        for name, doc, value in (
                ("vllm:num_requests_waiting", "Requests queued, not yet in a running batch (all modes)", now.waiting),
                ("vllm:num_requests_running", "Requests in a running batch (all modes)", now.running),
                ("vllm:kv_cache_usage_perc", "Fraction of the reserved KV pools running requests hold; 1 is full",
                 now.kv_cache_usage)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        waiting = GaugeMetricFamily("modeswitch_mode_waiting", "Requests queued per mode", labels=["mode"])
        running = GaugeMetricFamily("modeswitch_mode_running", "Requests in a running batch per mode", labels=["mode"])
        for mode, (w, r) in now.per_mode.items():
            waiting.add_metric([mode], w)
            running.add_metric([mode], r)
        yield from (waiting, running)

    def collect(self):
        from ..device import memory_headroom

        in_flight = GaugeMetricFamily("modeswitch_mode_in_flight", "Requests queued or running per mode", labels=["mode"])
        up = GaugeMetricFamily("modeswitch_mode_available", "1 if the mode can take requests", labels=["mode"])
        quarantined = GaugeMetricFamily("modeswitch_mode_quarantined", "1 while the mode is quarantined", labels=["mode"])
        failures = CounterMetricFamily("modeswitch_mode_failures", "Requests a mode failed", labels=["mode"])
        engine = {k: CounterMetricFamily(name, doc, labels=["mode"]) for k, (name, doc) in ENGINE_COUNTERS.items()}
        retry = GaugeMetricFamily("modeswitch_engine_next_retry_seconds", "Seconds until the engine the mode runs on "
                                  "is started again (0: starting now); absent while it is up", labels=["mode"])
        for name, state in self.registry.modes.items():
            in_flight.add_metric([name], state.in_flight)
            up.add_metric([name], 1.0 if state.available else 0.0)
            quarantined.add_metric([name], 1.0 if state.quarantine_left > 0 else 0.0)
            failures.add_metric([name], state.failures)
            stats = state.engine.stats() if state.engine is not None else {}
            for key, family in engine.items():
                if key in stats:
                    family.add_metric([name], stats[key])
            if "engine_next_retry_s" in stats:
                retry.add_metric([name], stats["engine_next_retry_s"])
        j_per_token = GaugeMetricFamily("modeswitch_mode_joules_per_token",
                                        "Running J per generated token (what the energy gate reads)",
                                        labels=["mode", "source"])
        watts = GaugeMetricFamily("modeswitch_mode_watts", "Running watts its completed requests drew "
                                  "(what order: energy prices predictions at)", labels=["mode", "source"])
        source = self.registry.energy.source
        for name, state in self.registry.modes.items():
            if state.j_per_token is not None:
                j_per_token.add_metric([name, source], state.j_per_token)
            if state.watts is not None:
                watts.add_metric([name, source], state.watts)
        totals = self.registry.energy.totals()
        idle = CounterMetricFamily("modeswitch_energy_idle_joules", "Energy while no engine step ran",
                                   labels=["source"])
        idle.add_metric([source], totals["idle_j"])
        attributed = CounterMetricFamily("modeswitch_energy_attributed_joules",
                                         "Energy split over requests (all modes, warm-up included)", labels=["source"])
        attributed.add_metric([source], totals["attributed_j"])
        free, fraction = memory_headroom()
        yield from (in_flight, up, quarantined, failures, *engine.values(), retry, j_per_token, watts, idle, attributed)
        yield from self._occupancy()
        yield GaugeMetricFamily("modeswitch_memory_free_bytes", "Free device memory", value=free)
        yield GaugeMetricFamily("modeswitch_memory_headroom", "Free fraction of device memory", value=fraction)
        weights = GaugeMetricFamily("modeswitch_weights_bytes", "Resident bytes per weights variant", labels=["weights"])
        for variant, size in self.registry.memory()["weights_bytes"].items():
            weights.add_metric([variant], size)
        yield weights


class Metrics:
    """The server's Prometheus registry. ``registry``: the modes whose state is read at scrape time, with
    ``model_name`` (the served model's name) labelling the gauges gateways read; without it, only what
    finished requests count."""

    def __init__(self, registry: "ModeRegistry | None" = None, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("modeswitch_requests", "Finished generation requests", ["mode", "outcome"], registry=r)
        self.prompt_tokens = Counter("modeswitch_prompt_tokens", "Prompt tokens served", ["mode"], registry=r)
        self.generated_tokens = Counter("modeswitch_generated_tokens", "Tokens generated", ["mode"], registry=r)
        self.latency = Histogram("modeswitch_request_seconds", "End-to-end latency", ["mode"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("modeswitch_ttft_seconds", "Time to first token", ["mode"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("modeswitch_decisions", "Controller decisions by chosen mode and rule",
                                 ["mode", "rule"], registry=r)
        self.decision_seconds = Histogram("modeswitch_decision_seconds", "Controller decision time",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.energy = Counter("modeswitch_energy_joules", "Energy attributed to finished requests",
                              ["mode", "source"], registry=r)
        self.rejected = Counter("modeswitch_rejected", "Requests refused before generation, by error code",
                                ["code"], registry=r)
        if registry is not None:
            r.register(_RegistryCollector(registry, model_name))

    def decided(self, mode: str, rule: str, seconds: float) -> None:
        self.decisions.labels(mode, rule).inc()
        self.decision_seconds.observe(seconds)

    def finished(self, c: "Completed") -> None:
        """A request ended (the controller's observer hook). ``c.outcome``: ok, error (the mode failed it), or
        cancelled (the client went away). ``c.energy_source``: measured (NVML) or estimated, kept as a label so
        the two are never summed together."""
        self.energy.labels(c.mode, c.energy_source).inc(c.energy_j)
        self.requests.labels(c.mode, c.outcome).inc()
        self.prompt_tokens.labels(c.mode).inc(c.prompt_tokens)
        self.generated_tokens.labels(c.mode).inc(c.completion_tokens)
        self.latency.labels(c.mode).observe(c.latency_s)
        if c.ttft_s is not None:
            self.ttft.labels(c.mode).observe(c.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
