"""Prometheus metrics of the router, prefix quadriga_. One registry per router,
so several routers can live in one process (tests). Counters and histograms are
the loop's own (router/loop_metrics.py: no lock an update); every update runs
on the router's event loop."""

from __future__ import annotations

import gc

from common.pb.quadriga.v1 import generation_pb2 as gpb
from prometheus_client import CollectorRegistry, Gauge, GCCollector, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily

from router.loop_metrics import LoopCounter, LoopHistogram

_LATENCY = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TBT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_PREFIX_TOKENS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.replicas = Gauge("quadriga_replicas_connected", "Connected replicas", registry=r)
        self.queue_wait = LoopHistogram("quadriga_queue_wait_seconds", "Accepted to assigned",
                                        buckets=_LATENCY, registry=r)
        self.ttft = LoopHistogram("quadriga_ttft_seconds", "Accepted to first token",
                                  buckets=_LATENCY, registry=r)
        self.tbt = LoopHistogram("quadriga_tbt_seconds",
                                 "Gap between token deliveries per request, over the tokens delivered",
                                 buckets=_TBT, registry=r)
        self.e2e = LoopHistogram("quadriga_e2e_seconds", "Accepted to finished",
                                 buckets=_LATENCY, registry=r)
        self.requests = LoopCounter("quadriga_requests_total", "Finished requests by finish reason",
                                    ["reason"], registry=r)
        self.accepted = LoopCounter("quadriga_requests_accepted_total", "Accepted requests", registry=r)
        self.prompt_tokens = LoopCounter("quadriga_prompt_tokens_total",
                                         "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = LoopCounter("quadriga_generation_tokens_total",
                                             "Output tokens received from replicas", registry=r)
        self.requeues = LoopCounter("quadriga_requeues_total", "Requests moved back to a queue",
                                    ["reason"], registry=r)
        self.cancellations = LoopCounter("quadriga_cancellations_total", "Cancelled requests",
                                         ["source"], registry=r)
        self.rejections = LoopCounter("quadriga_rejections_total", "Rejected requests by reason",
                                      ["reason"], registry=r)
        self.replica_faults = LoopCounter("quadriga_replica_faults_total",
                                          "Replica streams dropped for a protocol violation", registry=r)
        self.messages_in = LoopCounter("quadriga_messages_in_total", "Messages from replicas",
                                       ["kind"], registry=r)
        self.messages_out = LoopCounter("quadriga_messages_out_total", "Messages to replicas",
                                        ["kind"], registry=r)
        self.client_messages = LoopCounter("quadriga_client_messages_total",
                                           "GenerateResponse messages sent to clients", registry=r)
        self.redis_round_trips = LoopCounter("quadriga_redis_round_trips_total",
                                             "Redis round trips", registry=r)
        self.redis_pending = Gauge("quadriga_redis_pending_writes",
                                   "Writes queued for Redis, not yet durable", registry=r)
        self.lost_writes = LoopCounter(
            "quadriga_redis_lost_writes_total",
            "Requests of which Redis lost writes it had acknowledged (a restart or failover): "
            "output and submits written again from memory, records gone (the request failed)",
            ["kind"], registry=r)
        self.redis_stalled = Gauge("quadriga_redis_stalled",
                                   "1 while Redis is slower than the stall threshold", registry=r)
        self.prefix_hit = LoopHistogram("quadriga_prefix_hit_tokens",
                                        "Cached prefix tokens on the replica a request was placed on",
                                        buckets=_PREFIX_TOKENS, registry=r)
        self.prefix_best_hit = LoopHistogram("quadriga_prefix_best_hit_tokens",
                                             "Longest cached prefix of a request on any live replica",
                                             buckets=_PREFIX_TOKENS, registry=r)
        self.prefix_context = LoopCounter("quadriga_prefix_context_tokens_total",
                                          "Context tokens of the placements the two above count",
                                          registry=r)
        self.prefix_entries = Gauge("quadriga_prefix_index_entries",
                                    "Block hashes in the router's view of the replicas' caches",
                                    registry=r)
        self.prefix_evictions = LoopCounter("quadriga_prefix_index_evictions_total",
                                            "Entries dropped from the view for its memory bound",
                                            registry=r)
        self.pull_picks = LoopCounter("quadriga_pull_picks_total",
                                      "Requests a Pull took: in queue order, ahead of older ones "
                                      "for their cached prefix, past the wait bound, or as they "
                                      "arrived (nothing else waiting)",
                                      ["reason"], registry=r)
        self.prefill_rate = Gauge("quadriga_replica_prefill_tokens_per_second",
                                  "A replica's prefill speed from its prefill-heavy steps "
                                  "(what pull affinity weighs a cached token with)",
                                  ["replica"], registry=r)
        self._last_round_trips = 0
        self._last_evictions = 0
        # labels() builds a key on every call: children are cached.
        self._finished: dict[int, object] = {}
        self._out: dict[str, object] = {}
        self._picks: dict[str, object] = {}
        self._prefill_rates: dict[str, object] = {}

    def watch_table(self, table) -> None:
        """Queue depth and in-flight requests per replica, read from the request
        table when scraped: nothing to update on the hot path, and a replica's
        series goes when the table forgets the replica."""
        self.registry.register(_TableGauges(table))

    def watch_process(self) -> None:
        """The series of the process itself, for a router that owns its process
        (router/server.py serve()): prometheus_client's process_* (CPU, memory)
        and python_gc_* (collections by generation), and the objects frozen out
        of the collector's view. Routers built inside a test process leave the
        process to it, as they leave its heap."""
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_HeapGauges())

    def forget_replica(self, replica_id: str) -> None:
        """A replica left for good: its labelled series go too (bounded memory)."""
        if self._prefill_rates.pop(replica_id, None) is not None:
            self.prefill_rate.remove(replica_id)

    def prefill_rate_of(self, replica_id: str):
        child = self._prefill_rates.get(replica_id)
        if child is None:
            child = self._prefill_rates[replica_id] = self.prefill_rate.labels(replica_id)
        return child

    def finished_with(self, reason: int):
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = self.requests.labels(gpb.FinishReason.Name(reason))
        return child

    def pull_pick(self, reason: str):
        child = self._picks.get(reason)
        if child is None:
            child = self._picks[reason] = self.pull_picks.labels(reason)
        return child

    def sent_to_replica(self, kind: str):
        child = self._out.get(kind)
        if child is None:
            child = self._out[kind] = self.messages_out.labels(kind)
        return child

    def sync_round_trips(self, total: int) -> None:
        self.redis_round_trips.inc(total - self._last_round_trips)
        self._last_round_trips = total

    def sync_prefix_index(self, entries: int, evictions: int) -> None:
        self.prefix_entries.set(entries)
        self.prefix_evictions.inc(evictions - self._last_evictions)
        self._last_evictions = evictions

    def serve(self, port: int, addr: str = "0.0.0.0"):
        return start_http_server(port, addr=addr, registry=self.registry)


class _TableGauges:
    """A collector of the gauges the request table's indexes already hold.
    Scrapes run on the metrics server's thread: the table's reads used here
    copy its dicts in one C call each, which the loop cannot interleave."""

    def __init__(self, table):
        self.table = table

    def describe(self):
        return []

    def collect(self):
        depth = GaugeMetricFamily("quadriga_queue_depth", "Requests queued, not yet assigned")
        depth.add_metric([], self.table.queued_total)
        inflight = GaugeMetricFamily("quadriga_inflight_requests", "Requests running per replica",
                                     labels=["replica"])
        for replica_id, count in self.table.owned_counts():
            inflight.add_metric([replica_id], count)
        yield depth
        yield inflight


class _HeapGauges:
    """What the garbage collector is spared: the router freezes its heap once
    started and after each tokenizer load (router/server.py freeze_heap)."""

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("quadriga_router_heap_frozen_objects",
                                "Objects taken out of the garbage collector's view (gc.freeze)",
                                value=gc.get_freeze_count())
