"""Prefix cache hit rates of a run, from the counters the system exports,
read before and after it (so warm-up and earlier runs do not count):

- engine: the replicas' vllm:prefix_cache_hits_total over
  vllm:prefix_cache_queries_total, what the engines actually skipped;
- router: quadriga_prefix_hit_tokens_sum over
  quadriga_prefix_context_tokens_total, the hit the router saw in its view of
  the caches for each placement it made;
- oracle: quadriga_prefix_best_hit_tokens_sum over the same, the longest hit
  on any replica at each placement: what a router knowing every replica's
  cache and placing by it alone would get (the router must run with
  --prefix-metrics all for the policies that ignore the cache).
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

ROUTER = ("quadriga_prefix_hit_tokens_sum", "quadriga_prefix_best_hit_tokens_sum",
          "quadriga_prefix_context_tokens_total")
REPLICA = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def scrape(url: str, names, timeout: float = 2.0) -> dict[str, float]:
    """Sums of the named samples (over their labels); missing ones are 0."""
    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def snapshot(router_url: str | None, replica_urls: list[str]) -> dict | None:
    if not router_url and not replica_urls:
        return None
    try:
        return {"router": scrape(router_url, ROUTER) if router_url else None,
                "replicas": [scrape(u, REPLICA) for u in replica_urls]}
    except OSError:
        return None   # a metrics endpoint that does not answer: no hit rates, not a failed run


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def between(before: dict | None, after: dict | None) -> dict | None:
    """Hit rates of what happened between two snapshots."""
    if before is None or after is None:
        return None
    out: dict = {}
    if after["router"] is not None:
        d = {k: after["router"][k] - before["router"][k] for k in ROUTER}
        ctx = d["quadriga_prefix_context_tokens_total"]
        out.update(router_context_tokens=ctx,
                   router_hit_rate=_rate(d["quadriga_prefix_hit_tokens_sum"], ctx),
                   oracle_hit_rate=_rate(d["quadriga_prefix_best_hit_tokens_sum"], ctx))
    if after["replicas"]:
        queries = [a[REPLICA[0]] - b[REPLICA[0]] for a, b in zip(after["replicas"], before["replicas"])]
        hits = [a[REPLICA[1]] - b[REPLICA[1]] for a, b in zip(after["replicas"], before["replicas"])]
        out.update(engine_queried_tokens=sum(queries), engine_hit_tokens=sum(hits),
                   engine_hit_rate=_rate(sum(hits), sum(queries)),
                   engine_hit_rate_per_replica=[_rate(h, q) for h, q in zip(hits, queries)])
    return out
