"""Late binding (the default): one shared queue; a request is bound to a replica
only when that replica pulls, with room for it.

With affinity (the default; `--pull-affinity-window 0` turns it off), a Pull
chooses among the oldest W poppable requests of the queue's head priority
instead of taking the head. Cached tokens and waiting are weighed in one
unit: a second of waiting is worth `rate` tokens, where rate is the
puller's prefill speed as its own steps show it (router/replicas/
prefill_rate.py) times `--pull-affinity-wait-weight`. So a request scores
the tokens of its context the puller holds plus its wait times rate, and
the highest scores are taken.

A request that another live replica holds more of is left to that one
(whether it is pulling now or not) while its lead, in tokens, exceeds the
request's wait times rate: taking it here would cost the puller that many
tokens of prefill the holder would not spend. Once it has waited that long
the puller may take it, so a busy holder's work spills over, and its prefix
is then cached in both places. A Pull that leaves work for this reason asks
to be tried again when the first such request may be taken (Choice.retry_in).
A request that has waited past `max_wait` is taken first, whatever the
cache, in queue order.

A holder much busier than the puller is not waited for, when the balance
term is on (`--pull-affinity-balance-abs` > 0): outstanding tokens over the
puller's by more than `balance_abs` and more than `balance_rel` times them,
as cache_aware's rule reads. Without it a holder with free seats keeps every
request it leads for, however many it runs, so at low load one replica can
run everything while another idles (docs/router.md, "Placement at low load").

The bound on reordering, against strict queue order (docs/router.md):
a Pull only ever takes from the W oldest, and once a request has waited
`max_wait` nothing behind it in the queue is taken before it. Nothing is
hashed, and the head is popped as without affinity, while no replica holds
any cached block.

With several routers on one Redis the window holds only the requests this
router holds in memory (its own arrivals waiting in the queue), and the
caches it weighs are its own replicas': other routers' requests are not
seen, and the bound holds among this router's requests. They are not
starved: the scheduler pops the head when this router holds none of the
queue, and the named pop takes the picks only while the queue's first
request is one this router holds, then from the head
(router/persistence/lua.py, POP_IDS).
"""

from __future__ import annotations

import time

from router.scheduling.policies.base import AFFINITY, FIFO, OVERDUE, Choice, Policy

# Tokens a second assumed for a replica that has reported no prefill-heavy step yet.
UNMEASURED_PREFILL_TOKENS_PER_S = 10_000.0


class PullPolicy(Policy):
    name = "pull"
    per_replica_queues = False

    @property
    def uses_prefix_cache(self) -> bool:
        return self.settings.affinity_window > 0

    def choose(self, replica, queue, seats, token_limit, others):
        s, prefix = self.settings, self.context.prefix
        if not s.affinity_window or seats <= 0 or not prefix.active:
            return None
        if not prefix.holds_any(replica.id) and not any(prefix.holds_any(o) for o in others):
            return None
        window = self.context.oldest(queue, s.affinity_window)
        if not window:
            return None
        now = time.time()
        rate = s.affinity_wait_weight * (replica.prefill_tokens_per_s or UNMEASURED_PREFILL_TOKENS_PER_S)
        waited_for = [replica.id, *self._not_too_busy(replica.id, others)]
        picks, retry_in = [], None
        # Priorities stay strict: each priority's requests are ranked among themselves.
        for start, end in _priority_runs(window):
            run = window[start:end]
            overdue = [r for r in run if now - r.arrival >= s.affinity_max_wait]
            scored = []
            for position, req in enumerate(run):
                wait = now - req.arrival
                if wait >= s.affinity_max_wait:
                    continue
                hits = prefix.cached_tokens(req, waited_for)
                mine = hits[replica.id]
                lead = max(hits.values()) - mine
                if lead > wait * rate:   # the holder's: it saves more than the request has waited
                    takeable_at = min(lead / rate, s.affinity_max_wait) if rate else s.affinity_max_wait
                    ready = takeable_at - wait
                    retry_in = ready if retry_in is None else min(retry_in, ready)
                    continue
                scored.append((-(mine + wait * rate), position, req))
            scored.sort(key=lambda item: item[:2])
            picks += overdue + [req for _, _, req in scored]
        taken = _within_credit(picks, seats, token_limit)
        return Choice(_reasons(window, taken, now, s.affinity_max_wait), retry_in if not taken else None)

    def take_at_arrival(self, work, pullers, others):
        """As `choose` would rank `work` alone at no wait: the first puller that
        holds as much of it as any replica it would wait for; none such (a busy
        holder leads): queued, for that holder's Pull or for the wait to pass."""
        prefix = self.context.prefix
        if not self.settings.affinity_window or not prefix.active:
            return super().take_at_arrival(work, pullers, others)
        everyone = [r.id for r in (*pullers, *others)]
        if not any(prefix.holds_any(r) for r in everyone):
            return super().take_at_arrival(work, pullers, others)
        for puller in pullers:
            waited_for = [puller.id, *self._not_too_busy(puller.id, [r for r in everyone
                                                                     if r != puller.id])]
            hits = prefix.cached_tokens(work, waited_for)
            if hits[puller.id] >= max(hits.values()):
                return puller
        return None

    def _not_too_busy(self, puller: str, others):
        """The other replicas a request may be left to: all of them, or with the
        balance term on, those not too far ahead of the puller in outstanding tokens."""
        s = self.settings
        if not s.affinity_balance_abs:
            return list(others)
        load = self.context.load_of
        own = load(puller)
        return [o for o in others
                if not (load(o) - own > s.affinity_balance_abs and load(o) > s.affinity_balance_rel * own)]


def _priority_runs(window):
    """(start, end) of each run of one priority in the (queue-ordered) window."""
    start = 0
    for i in range(1, len(window) + 1):
        if i == len(window) or window[i].priority != window[start].priority:
            yield start, i
            start = i


def _within_credit(picks, seats: int, token_limit: int | None):
    """As the Lua pop does: up to `seats`, while token credit is left (the last may overrun)."""
    taken = []
    budget = token_limit
    for req in picks:
        if len(taken) >= seats or (budget is not None and budget <= 0):
            break
        taken.append(req)
        if budget is not None:
            budget -= req.context_len
    return taken


def _reasons(window, taken, now: float, max_wait: float):
    """Why each was taken: past the wait bound, or in queue order (everything
    ahead of it taken first), or ahead of an older request for its cache."""
    position = {r.id: i for i, r in enumerate(window)}
    done: set[int] = set()
    out = []
    for req in taken:
        if now - req.arrival >= max_wait:
            why = OVERDUE
        else:
            why = FIFO if done >= set(range(position[req.id])) else AFFINITY
        done.add(position[req.id])
        out.append((req, why))
    return out
