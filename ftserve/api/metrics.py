"""Prometheus metrics: engine gauges/counters read at scrape time, latency histograms.

Each app owns its CollectorRegistry (plus a process collector), so two servers in one
process, as in the tests, do not collide on metric names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _EngineCollector(Collector):
    """Reads engine.stats() once per scrape; nothing to keep in sync between scrapes."""

    def __init__(self, get_stats: Callable[[], Any | None]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        stats = self._get_stats()
        if stats is None:  # engine still loading
            return
        total = max(int(stats.kv_pages_total), 1)
        gauges = (
            ("ftserve_num_requests_running", "Requests in the running batch.", stats.running),
            ("ftserve_num_requests_waiting", "Requests queued for admission.", stats.waiting),
            ("ftserve_kv_cache_usage_ratio", "KV pages held by live requests / all KV pages.",
             stats.kv_pages_used / total),
            ("ftserve_kv_pages_used", "KV pages held by live requests.", stats.kv_pages_used),
            ("ftserve_kv_pages_cached", "KV pages held only by the prefix cache.",
             stats.kv_pages_cached),
            ("ftserve_kv_host_pages_total", "Pages of the KV host tier (0: none).",
             getattr(stats, "kv_host_pages_total", 0)),
            ("ftserve_kv_host_pages_cached", "Host-tier pages holding evicted prefix-cache KV.",
             getattr(stats, "kv_host_pages_cached", 0)),
            ("ftserve_state_checkpoints_cached", "Hybrid models: recurrent-state checkpoints the "
             "prefix cache holds on the device.", getattr(stats, "state_checkpoints_cached", 0)),
            ("ftserve_state_checkpoints_host_cached", "Hybrid models: state checkpoints in the KV "
             "host tier.", getattr(stats, "state_checkpoints_host_cached", 0)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = (
            ("ftserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             stats.prefix_hit_tokens_total),
            ("ftserve_kv_host_hit_tokens", "Prompt tokens restored from the KV host tier.",
             getattr(stats, "kv_host_hit_tokens_total", 0)),
            ("ftserve_prefix_published_pages",
             "Prompt pages given to the prefix cache when a prefill ended (shared with "
             "requests arriving meanwhile).", getattr(stats, "prefix_published_pages_total", 0)),
            ("ftserve_prompt_tokens", "Prompt tokens received.", stats.prompt_tokens_total),
            ("ftserve_generation_tokens", "Tokens generated.", stats.generation_tokens_total),
            ("ftserve_num_preemptions", "Requests preempted to free KV pages.",
             stats.preemptions_total),
            ("ftserve_state_checkpoints_saved", "Hybrid models: state checkpoints a prefill saved.",
             getattr(stats, "state_checkpoints_saved_total", 0)),
            ("ftserve_state_checkpoints_skipped", "Hybrid models: checkpoint boundaries passed "
             "without a free slot (raise --state-checkpoints).",
             getattr(stats, "state_checkpoints_skipped_total", 0)),
            ("ftserve_spec_verifies", "Speculative drafts verified (one per request per verify "
             "step).", getattr(stats, "spec_verifies_total", 0)),
            ("ftserve_spec_proposed_tokens", "Speculative draft tokens proposed.",
             getattr(stats, "spec_proposed_tokens_total", 0)),
            ("ftserve_spec_accepted_tokens", "Speculative draft tokens kept (each saves a step).",
             getattr(stats, "spec_accepted_tokens_total", 0)),
            ("ftserve_spec_gated_steps", "Decode steps in which the speculation gate held drafting "
             "off (it measured plain decoding faster at that batch size).",
             getattr(stats, "spec_gated_steps_total", 0)),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=float(value))
        rates = getattr(stats, "spec_gate_rates", ())
        if rates:
            fam = GaugeMetricFamily(
                "ftserve_spec_gate_tokens_per_second", "The speculation gate's last measured "
                "tokens/s by batch size, with speculation on and off.", labels=["batch", "speculation"])
            for name, on, off in rates:
                for mode, value in (("on", on), ("off", off)):
                    if value is not None:
                        fam.add_metric([name, mode], float(value))
            yield fam
        lengths = getattr(stats, "spec_accept_lengths", ())
        if lengths:  # speculation on: draft tokens kept per verify, 0 .. k
            cumulative = [sum(lengths[:a + 1]) for a in range(len(lengths))]
            buckets = [(str(float(a)), float(c)) for a, c in enumerate(cumulative)]
            yield HistogramMetricFamily(
                "ftserve_spec_accept_length", "Draft tokens kept per speculative verify.",
                buckets=[*buckets, ("+Inf", float(cumulative[-1]))],
                sum_value=float(sum(a * n for a, n in enumerate(lengths))))


class Metrics:
    def __init__(self, get_stats: Callable[[], Any | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self.registry.register(_EngineCollector(get_stats))
        self.ttft = Histogram(
            "ftserve_time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "ftserve_inter_token_latency_seconds", "Time between consecutive output tokens.",
            buckets=_ITL_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "ftserve_e2e_request_latency_seconds", "Arrival to finish.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        # One count per finished choice; reason: stop | length | abort (client gone,
        # drain timeout) | error (the engine could not run it).
        self.finished = Counter(
            "ftserve_requests_finished", "Finished requests (one per choice), by finish reason.",
            ["reason"], registry=self.registry,
        )
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)  # present at 0 from the start, as scrapers expect
        self.queue_time = Histogram(
            "ftserve_request_queue_time_seconds", "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
