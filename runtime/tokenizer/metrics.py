"""Prometheus metrics of the serving front end (names follow SGLang/vLLM conventions)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def hist(name, doc):
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(
                model_name
            )

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        self.requests = counter("specserve_requests", "finished requests")
        self.aborted = counter("specserve_aborted_requests", "aborted requests")
        self.prompt_tokens = counter("specserve_prompt_tokens", "prompt tokens processed")
        self.generation_tokens = counter("specserve_generation_tokens", "tokens generated")
        self.cached_tokens = counter("specserve_cached_tokens", "prompt tokens from the cache")
        self.ttft = hist("specserve_time_to_first_token_seconds", "time to first token")
        self.itl = hist("specserve_inter_token_latency_seconds", "time between output chunks")
        self.e2e = hist("specserve_e2e_request_latency_seconds", "request latency")
        self.running = gauge("specserve_num_running_reqs", "requests decoding")
        self.queued = gauge("specserve_num_queue_reqs", "requests waiting")
        self.kv_usage = gauge("specserve_token_usage", "fraction of KV slots in use")

    def update_from_server_info(self, info: dict) -> None:
        self.running.set(info.get("num_running_reqs", 0))
        self.queued.set(info.get("num_waiting_reqs", 0))
        self.kv_usage.set(info.get("kv_usage", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
