"""GET /metrics: Prometheus text with vLLM's metric names (api-protocols §7.3), so existing
Grafana dashboards work. Every metric has the label model_name.

Read from the engine at scrape time (`AsyncEngine.stats()`, plain numbers):
  vllm:num_requests_running / vllm:num_requests_waiting      gauges
  vllm:kv_cache_usage_perc                                   gauge, 0..1 (used blocks / blocks)
  vllm:prompt_tokens_total / vllm:generation_tokens_total    counters
  vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   counters (tokens)
  vllm:num_preemptions_total                                 counter
  backfit:num_free_blocks / backfit:num_blocks / backfit:num_free_slots   gauges (pool counters)
Observed by the bridge per request (monotonic clock):
  vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds (alias
  vllm:inter_token_latency_seconds), vllm:e2e_request_latency_seconds   histograms
  vllm:request_success_total{finished_reason}, backfit:requests_rejected_total{reason},
  backfit:client_disconnects_total   counters
One CollectorRegistry per app (tests run several servers in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters read from stats() when scraped."""

    GAUGES = (("vllm:num_requests_running", "num_requests_running", "Requests running."),
              ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting."),
              ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache block usage, 0-1."),
              ("backfit:num_blocks", "num_blocks", "Cache blocks in the pool."),
              ("backfit:num_free_blocks", "num_free_blocks", "Free (or evictable) blocks."),
              ("backfit:num_free_slots", "num_free_slots", "Free sequence slots."))
    COUNTERS = (("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens admitted."),
                ("vllm:generation_tokens", "generation_tokens", "Tokens generated."),
                ("vllm:prefix_cache_queries", "prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache."),
                ("vllm:prefix_cache_hits", "prefix_cache_hits",
                 "Prompt tokens served by the prefix cache."),
                ("vllm:num_preemptions", "num_preemptions", "Preemptions (by recompute)."),
                ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts",
                 "Verify passes of a request (speculative decoding)."),
                ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
                 "Drafted tokens verified."),
                ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
                 "Drafted tokens accepted."))

    def __init__(self, stats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        s = self.stats() or {}
        for name, key, doc in self.GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(s.get(key, 0)))
            yield g
        for name, key, doc in self.COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(s.get(key, 0)))
            yield c
        per_pos = s.get("spec_decode_num_accepted_tokens_per_pos") or []
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Drafted tokens accepted, by draft position (0 = the first).",
                                labels=["model_name", "position"])
        for pos, n in enumerate(per_pos):
            c.add_metric([self.model_name, str(pos)], float(n))
        yield c


class Metrics:
    def __init__(self, model_name: str, stats):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(stats, model_name))
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_TTFT, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token "
                              "after the first.", lab, buckets=_TPOT, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency (the "
                             "mean per request).", lab, buckets=_TPOT, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, admission "
                             "to last token.", lab, buckets=_E2E, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.",
                               lab + ["finished_reason"], registry=r)
        self.rejects = Counter("backfit:requests_rejected", "Requests rejected before running.",
                               lab + ["reason"], registry=r)
        self.disconnects = Counter("backfit:client_disconnects", "Requests whose client left "
                                   "(aborted).", lab, registry=r)

    def request_done(self, t0: float, t_first: float | None, t_end: float, n_out: int,
                     reason: str | None, disconnected: bool = False) -> None:
        m = self.model_name
        if t_first is not None:
            self.ttft.labels(m).observe(t_first - t0)
            if n_out > 1:
                per = (t_end - t_first) / (n_out - 1)
                self.tpot.labels(m).observe(per)
                self.itl.labels(m).observe(per)
        self.e2e.labels(m).observe(t_end - t0)
        if disconnected:
            self.disconnects.labels(m).inc()
        else:
            self.success.labels(m, reason or "stop").inc()

    def rejected(self, reason: str) -> None:
        self.rejects.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
