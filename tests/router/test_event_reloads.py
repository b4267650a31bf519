"""A front's reads back from Redis (a request whose events it missed, the queued
requests after an outage) go on until Redis answers: one that gave up left the
request stale, or a queued request Redis lost never stored again."""

import asyncio

from router import events
from router.events import EventReader


class _Table:
    def __init__(self):
        self.refreshed, self.resubmitted = [], []

    def refresh(self, rid, rec):
        self.refreshed.append((rid, rec))

    def stored_queued_ids(self):
        return ["q1", "q2"]

    def resubmit_lost(self, missing):
        self.resubmitted.append(missing)


class _FlakyStore:
    """Fails its first `failures` reads, as Redis away for a while does."""

    def __init__(self, failures: int):
        self.failures = failures
        self.reads = 0

    async def _read(self, result):
        self.reads += 1
        if self.reads <= self.failures:
            raise ConnectionError("Redis away")
        return result

    async def load_requests(self, ids):
        return await self._read([{"id": ids[0]}])

    async def missing(self, ids):
        return await self._read(ids[:1])


def test_reads_back_go_on_until_redis_answers(monkeypatch):
    real_sleep = asyncio.sleep
    monkeypatch.setattr(events.asyncio, "sleep", lambda _s: real_sleep(0))   # the backoff, not its length

    async def scenario():
        table, store = _Table(), _FlakyStore(failures=60)
        reader = EventReader(store, table, scheduler=None, router_id="r", timeout=1.0)
        reader.reload("a")
        await asyncio.wait_for(asyncio.gather(*reader._reloads), 10)
        assert table.refreshed == [("a", {"id": "a"})] and store.reads == 61
        store.failures, store.reads = 30, 0
        reader.check_after_outage()
        await asyncio.wait_for(asyncio.gather(*reader._reloads), 10)
        assert table.resubmitted == [["q1"]]

    asyncio.run(scenario())
