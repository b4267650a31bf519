"""The bound pull affinity keeps against strict queue order, checked over many
random queues, caches, priorities and pulls (the policy on its own, with a
real index and a clock moved by hand):

- a Pull takes only from the W oldest poppable requests;
- once a request has waited max_wait, nothing behind it in the queue is
  taken before it;
- nothing of a lower priority is taken while one of a higher priority is
  left in the window (for a replica pulling alone);
- seats and token credit hold as in the Lua pop (the last may overrun)."""

import random

import pytest

from common.block_hash import BlockHasher
from router.prefix.index import PrefixIndex
from router.prefix.matcher import PrefixMatcher
from router.scheduling.policies import PolicySettings, make_policy
from router.scheduling.policies import pull as pull_policy

H4 = BlockHasher(4)
W, MAX_WAIT = 5, 10.0


class Req:
    def __init__(self, rid, prompt, priority, arrival):
        self.id, self.prompt_ids, self.priority, self.arrival = rid, prompt, priority, arrival
        self.tokens, self.block_hashes, self.block_hasher = [], [], None
        self.order = (-priority, arrival)

    @property
    def context_len(self):
        return len(self.prompt_ids)


class Context:
    def __init__(self, prefix):
        self.prefix, self.queue = prefix, []

    def oldest(self, queue, n):
        return sorted(self.queue, key=lambda r: r.order)[:n]


class Replica:
    def __init__(self, rid, prefill_tokens_per_s):
        self.id, self.prefill_tokens_per_s = rid, prefill_tokens_per_s


@pytest.mark.parametrize("seed", range(40))
def test_pull_affinity_never_breaks_its_bound(seed, monkeypatch):
    rng = random.Random(seed)
    now = [1000.0]
    monkeypatch.setattr(pull_policy, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
    index = PrefixIndex(10_000)
    prefixes = [[rng.randrange(50) for _ in range(4 * rng.randint(1, 4))] for _ in range(4)]
    replicas = [Replica(f"r{i}", rng.choice([None, 500.0, 5000.0])) for i in range(3)]
    for r in replicas:
        index.replace(r.id, H4, [h for p in rng.sample(prefixes, 2) for h in H4.hashes(p)])
    ctx = Context(PrefixMatcher(index))
    policy = make_policy("pull", ctx, PolicySettings(affinity_window=W, affinity_max_wait=MAX_WAIT,
                                                     affinity_wait_weight=rng.choice([0, 0.001, 0.01])))
    n = 0
    for _ in range(60):
        for _ in range(rng.randint(0, 3)):
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            ctx.queue.append(Req(f"q{n}", prompt, rng.choice([0, 0, 0, 1]), now[0]))
            n += 1
        now[0] += rng.uniform(0, 4)
        if not ctx.queue:
            continue
        puller = rng.choice(replicas)
        others = [r.id for r in rng.sample(replicas, rng.randint(0, 2)) if r is not puller]
        seats, tokens = rng.randint(1, 3), rng.choice([None, 5, 30])
        ordered = sorted(ctx.queue, key=lambda r: r.order)
        choice = policy.choose(puller, "pending", seats, tokens, others)
        taken = [r for r, _ in choice.picks]
        assert len(taken) <= seats
        assert all(r in ordered[:W] for r in taken), "took from outside the window"
        if tokens is not None:
            assert sum(r.context_len for r in taken[:-1]) < tokens or len(taken) <= 1
        position = {r.id: i for i, r in enumerate(ordered)}
        for i, r in enumerate(taken):
            behind_taken_first = [t for t in taken[:i] if position[t.id] > position[r.id]]
            overdue_ahead = [o for o in ordered[:position[r.id]]
                             if now[0] - o.arrival >= MAX_WAIT and o not in taken[:i]]
            assert not overdue_ahead, f"{r.id} taken before overdue {overdue_ahead[0].id}"
            if now[0] - r.arrival >= MAX_WAIT:
                assert not behind_taken_first, f"overdue {r.id} taken after {behind_taken_first}"
            if not others:
                higher = [o for o in ordered[:W] if o.priority > r.priority and o not in taken[:i]]
                assert not higher, f"{r.id} taken before higher-priority {higher[0].id}"
        ctx.queue = [r for r in ctx.queue if r not in taken]
