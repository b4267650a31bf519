"""The replica's Prometheus metrics, updated once per engine step.

Two sets of names. quadriga_replica_* are this project's own. vllm:* are the
names that llm-d's endpoint picker, KEDA scalers and vLLM's dashboards read,
each with a model_name label, with vLLM's meaning: gauges of the engine's
queues and KV use (0..1), counters of prompt and generated tokens, and
histograms of time to first token and of the gap between tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from replica_worker.engine.outputs import RequestDelta
from replica_worker.worker.engine_loop import EngineReport

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.75, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.4, 0.75, 1.5, 3.0, 6.0)


class ReplicaMetrics:
    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.step_time = Histogram("quadriga_replica_step_seconds", "Engine step time",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("quadriga_replica_batch_size", "Sequences per step",
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.step_tokens = Histogram("quadriga_replica_step_tokens", "Tokens computed per step",
                                     buckets=_SIZE_BUCKETS, registry=r)
        self.kv_utilisation = Gauge("quadriga_replica_kv_utilisation", "Share of KV blocks in use",
                                    registry=r)
        self.running = Gauge("quadriga_replica_running", "Running sequences", registry=r)
        self.waiting = Gauge("quadriga_replica_waiting", "Waiting sequences", registry=r)
        self.preemptions = Counter("quadriga_replica_preemptions_total",
                                   "Sequences preempted by recompute", registry=r)
        self.finished = Counter("quadriga_replica_requests_finished_total",
                                "Requests finished here, by reason", ["reason"], registry=r)
        self.vllm = _VllmNames(r, model_name)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def observe(self, report: EngineReport) -> None:
        res, load = report.result, report.load
        if res.batch_size:
            self.step_time.observe(res.step_time)
            self.batch_size.observe(res.batch_size)
            self.step_tokens.observe(res.num_tokens)
        if res.num_preempted:
            self.preemptions.inc(res.num_preempted)
        for delta in res.deltas:
            if delta.finish_reason:
                self.finished.labels(delta.finish_reason).inc()
            self.vllm.observe_delta(delta)
        kv_used = 1 - load.free_kv_blocks / load.total_kv_blocks if load.total_kv_blocks else 0.0
        self.kv_utilisation.set(kv_used)
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.vllm.observe_load(load.running, load.waiting, kv_used)
        if report.prefix_stats is not None:
            self.vllm.observe_prefix_cache(report.prefix_stats)


class _VllmNames:
    """The vllm:* series of one model. Label children are made once: labels()
    takes a lock and builds a key on every call."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        def one(kind, name, doc, **kw):
            return kind(name, doc, ["model_name"], registry=r, **kw).labels(model_name)

        self.running = one(Gauge, "vllm:num_requests_running", "Requests in the running batch")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = one(Gauge, "vllm:kv_cache_usage_perc", "KV cache blocks in use, 0 to 1")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens_total", "Prefilled prompt tokens")
        self.generation_tokens = one(Counter, "vllm:generation_tokens_total", "Generated tokens")
        # A request's arrival time is when the router accepted it, so this
        # counts its wait in the router's queue, as vLLM counts its own queue.
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds",
                        "Request arrival to first token", buckets=_TTFT_BUCKETS)
        self.itl = one(Histogram, "vllm:inter_token_latency_seconds",
                       "Gap between consecutive tokens of a request", buckets=_ITL_BUCKETS)
        # The engine counts cumulatively; these follow it by the difference.
        self.prefix_queries = one(Counter, "vllm:prefix_cache_queries_total",
                                  "Tokens looked up in the prefix cache at admission")
        self.prefix_hits = one(Counter, "vllm:prefix_cache_hits_total",
                               "Tokens found in the prefix cache at admission")
        self._prefix_seen = (0, 0)

    def observe_prefix_cache(self, stats) -> None:
        queries, hits = self._prefix_seen
        if stats.queries > queries:
            self.prefix_queries.inc(stats.queries - queries)
        if stats.hits > hits:
            self.prefix_hits.inc(stats.hits - hits)
        self._prefix_seen = (stats.queries, stats.hits)

    def observe_load(self, running: int, waiting: int, kv_used: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_used)

    def observe_delta(self, delta: RequestDelta) -> None:
        stats, n = delta.stats, len(delta.new_token_ids)
        if stats is None or not n:
            return
        self.generation_tokens.inc(n)
        if delta.output_offset == stats.num_resumed_tokens:
            # The request's first token here. One resumed from another replica
            # prefilled its earlier output as context; its first token came from
            # the replica before.
            self.prompt_tokens.inc(stats.num_prompt_tokens + stats.num_resumed_tokens)
            if not stats.num_resumed_tokens:
                self.ttft.observe(stats.token_times[0] - stats.arrival)
        times = stats.token_times
        if stats.previous_token_time is not None:
            times = (stats.previous_token_time, *times)
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
