"""Prometheus metrics of the serving front end (names follow SGLang/vLLM conventions)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        self.requests = counter("specserve_requests", "finished requests")
        self.aborted = counter("specserve_aborted_requests", "aborted requests")
        self.rejected = counter("specserve_rejected_requests",
                                "requests refused because the queue was full (503)")
        self.prompt_tokens = counter("specserve_prompt_tokens", "prompt tokens processed")
        self.generation_tokens = counter("specserve_generation_tokens", "tokens generated")
        self.cached_tokens = counter("specserve_cached_tokens", "prompt tokens from the cache")
        self.ttft = hist("specserve_time_to_first_token_seconds", "time to first token")
        self.itl = hist("specserve_inter_token_latency_seconds", "time between output chunks")
        self.e2e = hist("specserve_e2e_request_latency_seconds", "request latency")
        self.running = gauge("specserve_num_running_reqs", "requests decoding")
        self.queued = gauge("specserve_num_queue_reqs", "requests waiting")
        self.kv_usage = gauge("specserve_token_usage", "fraction of KV slots in use")
        # per-request state (all 0 when no request is live)
        self.held = {
            "open_requests": gauge("specserve_open_requests",
                                   "requests the front end tracks (streams, waiting results)"),
            "runner_requests": gauge("specserve_runner_requests",
                                     "requests the model runner keeps records for"),
            "grammar_matchers": gauge("specserve_grammar_matchers",
                                      "grammar matchers the model runner keeps"),
            "drafter_requests": gauge("specserve_drafter_requests",
                                      "requests the drafter keeps state for"),
        }
        self.grammar_compile_s = hist("specserve_grammar_compile_seconds",
                                      "time to compile a grammar (cache misses)", COMPILE_BUCKETS)

        self._info: dict = {}
        self.registry.register(_SpecCollector(self, model_name))
        self._model_name = model_name

    def watch_grammars(self, compiler) -> None:
        """Expose a GrammarCompiler's cache counters (read at scrape time)."""
        if compiler is not None:
            self.registry.register(_GrammarCollector(compiler, self._model_name))

    def update_from_server_info(self, info: dict) -> None:
        self._info = info
        self.running.set(info.get("num_running_reqs", 0))
        self.queued.set(info.get("num_waiting_reqs", 0))
        self.kv_usage.set(info.get("kv_usage", 0.0))
        for key, g in self.held.items():
            g.set(info.get(key, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecCollector:
    """Speculative counters (vLLM names) from the scheduler's totals, read at scrape time."""

    def __init__(self, metrics: ServingMetrics, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def collect(self):
        info = self.metrics._info
        if "spec_verify_steps" not in info:
            return
        for name, key, doc in (
            ("specserve_spec_decode_num_drafts", "spec_verify_steps", "verify steps"),
            ("specserve_spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
             "draft tokens proposed"),
            ("specserve_spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
             "draft tokens accepted"),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], info[key])
            yield fam
        fam = CounterMetricFamily("specserve_spec_decode_num_accepted_tokens_per_pos",
                                  "verify steps accepting a draft at this position",
                                  labels=["model_name", "position"])
        for pos, count in enumerate(info.get("spec_decode_num_accepted_tokens_per_pos", [])):
            fam.add_metric([self.model_name, str(pos)], count)
        yield fam


class _GrammarCollector:
    """The grammar compiler's cache counters, read at scrape time."""

    def __init__(self, compiler, model_name: str) -> None:
        self.compiler = compiler
        self.model_name = model_name

    def collect(self):
        stats = self.compiler.stats
        for name, key, doc in (
            ("specserve_grammar_cache_hits", "cache_hits",
             "grammar requests served from the compiled-grammar cache"),
            ("specserve_grammar_cache_misses", "cache_misses", "grammar requests compiled"),
            ("specserve_grammar_compile_errors", "compile_errors",
             "grammars that did not compile (HTTP 400)"),
            ("specserve_grammar_compile_timeouts", "compile_timeouts",
             "grammars that did not compile within --grammar-compile-timeout (HTTP 400)"),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], stats[key])
            yield fam
