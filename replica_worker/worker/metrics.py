"""The replica's Prometheus metrics (quadriga_replica_* names), updated once per engine step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from replica_worker.worker.engine_loop import EngineReport

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ReplicaMetrics:
    def __init__(self) -> None:
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
        if load.total_kv_blocks:
            self.kv_utilisation.set(1 - load.free_kv_blocks / load.total_kv_blocks)
        self.running.set(load.running)
        self.waiting.set(load.waiting)
