"""How many of a request's tokens each replica holds in its prefix cache, and
what each placement achieved against the best available.

A request's block hashes are computed with the replicas' own BlockHasher, the
first time a policy asks, and kept on the request (`block_hashes`): tokens
are only ever appended, so hashes once computed stay valid, and a requeued
request only hashes the output it brought. Only blocks the engine would
reuse count: never the one holding the context's last token, which the
engine always computes (docs/engine.md, "Admission").

Nothing is hashed while no replica reports a cache, or for a policy that
does not use the cache unless `--prefix-metrics all` asks for the metrics.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from router.prefix.index import PrefixIndex


class Work(Protocol):
    """A request as placement sees it (RequestState, or an arrival not yet admitted)."""

    prompt_ids: list[int]
    tokens: list[int]                 # output so far (a requeued request brings it)
    block_hashes: list[int]           # filled here on first use
    block_hasher: object


def context_hashes(work: Work, hasher) -> list[int]:
    """Hashes of the blocks the engine could reuse for `work`: every full block of
    its context (prompt, then output so far) except one holding its last token."""
    if work.block_hasher is not hasher:
        work.block_hashes, work.block_hasher = [], hasher
    known = work.block_hashes
    size = hasher.block_size
    reusable = (len(work.prompt_ids) + len(work.tokens) - 1) // size
    if len(known) < reusable:
        start, end = len(known) * size, reusable * size
        context = work.prompt_ids if end <= len(work.prompt_ids) else work.prompt_ids + work.tokens
        known.extend(hasher.hashes(context[start:end], parent=known[-1] if known else None))
    return known[:reusable]


class PrefixMatcher:
    def __init__(self, index: PrefixIndex, metrics=None, record_all: bool = False) -> None:
        self.index = index
        self.metrics = metrics
        self.record_all = record_all   # metrics for policies that do not use the cache too

    @property
    def active(self) -> bool:
        """Some replica reports a cache: matching can find anything."""
        return self.index.hasher is not None and len(self.index) > 0

    def holds_any(self, replica_id: str) -> bool:
        return self.index.size_of(replica_id) > 0

    def cached_tokens(self, work: Work, replica_ids: Iterable[str]) -> dict[str, int]:
        """Tokens of `work`'s context each replica would find cached (0 for none)."""
        replica_ids = list(replica_ids)
        hasher = self.index.hasher
        if not self.active:
            return dict.fromkeys(replica_ids, 0)
        blocks = self.index.matched_blocks(context_hashes(work, hasher), replica_ids)
        return {rid: n * hasher.block_size for rid, n in blocks.items()}

    def recording(self, uses_cache: bool) -> bool:
        """Whether record() records anything (callers skip gathering its arguments)."""
        return self.metrics is not None and (uses_cache or self.record_all) and self.active

    def record(self, work: Work, chosen: str, live_ids: Iterable[str], uses_cache: bool) -> None:
        """Metrics of one placement: the hit on the chosen replica and the best hit
        on any live one (what a router knowing every view would get)."""
        if not self.recording(uses_cache):
            return
        hits = self.cached_tokens(work, {chosen, *live_ids})
        self.observe(len(work.prompt_ids) + len(work.tokens), hits[chosen], max(hits.values()))

    def observe(self, context: int, hit: int, best: int) -> None:
        m = self.metrics
        m.prefix_hit.observe(hit)
        m.prefix_best_hit.observe(best)
        m.prefix_context.inc(context)
