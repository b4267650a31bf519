"""Workloads whose prompts share prefixes, for cache-affine scheduling.

shared-prefix: G groups, each a system prompt of S random tokens and Q
  questions after it (question lengths from --prompt-*, answers from
  --output-*); the G x Q requests arrive in a random order, so the groups
  interleave, at Poisson (or --arrival) times.
multi-turn: C conversations of T turns. A conversation starts at a Poisson
  time; each turn's prompt is the previous turn's prompt, then its answer
  (the tokens the server returned), then a new message (lengths from
  --prompt-*; --system-len tokens shared by every conversation come first);
  the next turn is sent --think-s after the previous answer ends. Prompt
  lengths are known in advance because answers have exact lengths
  (ignore_eos, max_tokens); the token ids of a later turn are built by the
  load generator as the answers arrive.
"""

from __future__ import annotations

from benchmarks.harness.workload import Request, arrivals, generate, synthetic_lengths


def _lengths(spec, which: str, n: int, rng):
    p = lambda name: getattr(spec, f"{which}_{name}")  # noqa: E731
    return synthetic_lengths(p("dist"), n, rng, value=p("len"), low=p("min"), high=p("max"),
                             zipf_theta=spec.zipf_theta)


def _tokens(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, int(n)).tolist()


def _check_limit(spec, prompt_len: int, output_len: int, what: str) -> None:
    if spec.max_total is not None and prompt_len + output_len > spec.max_total:
        raise ValueError(f"{what} needs {prompt_len} + {output_len} tokens, over --max-total "
                         f"{spec.max_total}; shorten the system prompt, messages or turns")


def shared_prefix(spec, rate, rng_len, rng_arr, rng_tok) -> list[Request]:
    g, q = spec.groups, spec.questions
    if g < 1 or q < 1 or spec.system_len < 0:
        raise ValueError("shared-prefix needs --groups and --questions of at least 1")
    n = g * q
    systems = [_tokens(rng_tok, spec.system_len, spec.vocab_size) for _ in range(g)]
    questions, outputs = _lengths(spec, "prompt", n, rng_len), _lengths(spec, "output", n, rng_len)
    order = rng_len.permutation(n)          # which (group, question) arrives i-th
    times = arrivals(spec.arrival, n, rng_arr, rate, spec.cv)
    reqs = []
    for i, k in enumerate(order):
        prompt = systems[k // q] + _tokens(rng_tok, questions[k], spec.vocab_size)
        _check_limit(spec, len(prompt), int(outputs[k]), "a request")
        reqs.append(Request(i, float(times[i]), len(prompt), int(outputs[k]), prompt, group=int(k // q)))
    return reqs


def multi_turn(spec, rate, rng_len, rng_arr, rng_tok) -> list[Request]:
    c, t = spec.conversations, spec.turns
    if c < 1 or t < 1:
        raise ValueError("multi-turn needs --conversations and --turns of at least 1")
    system = _tokens(rng_tok, spec.system_len, spec.vocab_size)
    messages = _lengths(spec, "prompt", c * t, rng_len).reshape(c, t)
    outputs = _lengths(spec, "output", c * t, rng_len).reshape(c, t)
    starts = arrivals(spec.arrival, c, rng_arr, rate, spec.cv)
    reqs = []
    for conv in range(c):
        context = len(system)
        for turn in range(t):
            message = _tokens(rng_tok, messages[conv, turn], spec.vocab_size)
            ids = system + message if turn == 0 else message
            prompt_len = context + len(message)
            _check_limit(spec, prompt_len, int(outputs[conv, turn]), f"turn {turn + 1}")
            reqs.append(Request(len(reqs), float(starts[conv]), prompt_len, int(outputs[conv, turn]),
                                ids, conversation=conv, turn=turn, think_s=spec.think_s))
            context = prompt_len + int(outputs[conv, turn])
    reqs.sort(key=lambda r: (r.turn, r.arrival_s, r.conversation))
    for i, r in enumerate(reqs):
        r.index = i
    return reqs


def priming(spec) -> list[Request]:
    """One request per shared prefix of the workload (each group's system prompt, or
    the system prompt every conversation starts with) and one more token, for one
    output token: sent once before measuring, it leaves the replicas' caches as
    warm as a probe after the first finds them (the probes of a search offer the
    same prompts). Questions and conversation turns are not sent, so their own
    tokens are not cached. The prefixes are read off the workload itself."""
    n = spec.system_len
    if n <= 0:
        return []
    systems = dict.fromkeys(tuple(r.prompt_token_ids[:n]) for r in generate(spec) if r.turn == 0)
    return [Request(i, 0.0, n + 1, 1, [*system, 3]) for i, system in enumerate(systems)]


def conversations(requests) -> tuple[list, list[list]]:
    """(single requests, conversations as lists of turns in order)."""
    singles, chains = [], {}
    for r in requests:
        if r.conversation < 0:
            singles.append(r)
        else:
            chains.setdefault(r.conversation, []).append(r)
    return singles, [sorted(turns, key=lambda r: r.turn) for _, turns in sorted(chains.items())]


def reusable_tokens(requests, system_len: int) -> int:
    """Prompt tokens an ideal cache would hold when each request arrives: its
    group's system prompt after the group's first request, the shared system
    prompt after the first conversation, and every earlier turn of its own."""
    seen_groups, first_turn_seen, total = set(), False, 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.turn)):
        if r.group >= 0:
            total += system_len if r.group in seen_groups else 0
            seen_groups.add(r.group)
        elif r.turn > 0:
            total += r.prompt_len - len(r.prompt_token_ids)
        elif r.conversation >= 0:
            total += system_len if first_turn_seen else 0
            first_turn_seen = True
    return total
