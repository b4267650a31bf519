"""Request generators: seeded, reproducible, and shaped like their distributions."""

import numpy as np
import pytest

from benchmarks.harness.workload import (PRESETS, WorkloadSpec, arrivals, generate, preset_lengths,
                                         read_trace, synthetic_lengths)


def test_same_seed_same_requests_other_seed_differs():
    spec = WorkloadSpec(num_requests=50, workload="sharegpt", scale=0.125, rate=4.0, seed=7)
    a, b = generate(spec), generate(spec)
    assert [(r.prompt_token_ids, r.output_len, r.arrival_s) for r in a] == \
           [(r.prompt_token_ids, r.output_len, r.arrival_s) for r in b]
    c = generate(WorkloadSpec(**{**spec.describe(), "seed": 8}))
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]


def test_lengths_do_not_depend_on_rate():
    spec = WorkloadSpec(num_requests=30, workload="sharegpt", scale=0.125, seed=1)
    slow, fast = generate(spec, rate=1.0), generate(spec, rate=10.0)
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert slow[-1].arrival_s == pytest.approx(10 * fast[-1].arrival_s)


def test_prompt_ids_have_the_length_and_vocab():
    reqs = generate(WorkloadSpec(num_requests=20, prompt_dist="uniform", prompt_min=5, prompt_max=40,
                                 vocab_size=100, seed=3))
    for r in reqs:
        assert len(r.prompt_token_ids) == r.prompt_len and 5 <= r.prompt_len <= 40
        assert all(3 <= t < 100 for t in r.prompt_token_ids)


@pytest.mark.parametrize("name,prompt_med,output_med", [("sharegpt", 1730, 415), ("arxiv", 7060, 208)])
def test_preset_medians_and_limit(name, prompt_med, output_med):
    p, o = preset_lengths(name, 20000, np.random.default_rng(0))
    assert np.median(p) == pytest.approx(prompt_med, rel=0.1)
    assert np.median(o) == pytest.approx(output_med, rel=0.1)
    assert (p + o).max() <= PRESETS[name]["max_total"]


def test_scale_shrinks_lengths_and_limit():
    p, o = preset_lengths("sharegpt", 20000, np.random.default_rng(0), scale=0.125)
    assert (p + o).max() <= 1024
    assert np.median(p) == pytest.approx(1730 / 8, rel=0.1)
    assert np.median(o) == pytest.approx(415 / 8, rel=0.1)


def test_synthetic_length_distributions():
    rng = np.random.default_rng(0)
    assert (synthetic_lengths("fixed", 10, rng, value=33) == 33).all()
    u = synthetic_lengths("uniform", 20000, rng, low=10, high=110)
    assert u.min() >= 10 and u.max() <= 110 and np.median(u) == pytest.approx(60, rel=0.05)
    z = synthetic_lengths("zipf", 20000, rng, low=1, high=1000, zipf_theta=1.2)
    assert z.min() >= 1 and z.max() <= 1000
    assert np.median(z) < np.mean(z) / 2          # heavy tail: mean far above median
    assert np.mean(z == 1) == pytest.approx(1 / sum(k ** -1.2 for k in range(1, 1001)), rel=0.1)


def test_arrival_processes():
    rng = np.random.default_rng(0)
    t = arrivals("poisson", 20001, rng, rate=5.0)
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert np.median(gaps) == pytest.approx(0.2 * np.log(2), rel=0.05)
    g = np.diff(arrivals("gamma", 20001, rng, rate=5.0, cv=3.0))
    assert np.mean(g) == pytest.approx(0.2, rel=0.1)
    assert np.std(g) / np.mean(g) == pytest.approx(3.0, rel=0.1)
    assert (arrivals("burst", 5, rng, rate=5.0) == 0).all()


def test_trace_csv(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n10.5,100,20\n10.0,50,5\n\n12,7,3\n")
    p, o, t = read_trace(f)
    assert p.tolist() == [50, 100, 7] and o.tolist() == [5, 20, 3]
    assert t.tolist() == [0.0, 0.5, 2.0]
    reqs = generate(WorkloadSpec(workload="trace", trace=str(f), num_requests=0, seed=0))
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in reqs] == [(50, 5, 0.0), (100, 20, 0.5), (7, 3, 2.0)]
    # Without arrival times (or with --rate), arrivals come from the process.
    g = tmp_path / "g.csv"
    g.write_text("prompt_tokens,output_tokens\n4,2\n8,3\n")
    p, o, t = read_trace(g)
    assert t is None and p.tolist() == [4, 8]
    reqs = generate(WorkloadSpec(workload="trace", trace=str(g), num_requests=0, rate=2.0, scale=2.0))
    assert [r.prompt_len for r in reqs] == [8, 16] and reqs[0].arrival_s == 0


def test_trace_csv_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("foo,bar\n1,2\n")
    with pytest.raises(ValueError, match="prompt and output"):
        read_trace(bad)
    bad.write_text("prompt_tokens,output_tokens\n1,x\n")
    with pytest.raises(ValueError, match=":2:"):
        read_trace(bad)
    bad.write_text("prompt_tokens,output_tokens\n0,3\n")
    with pytest.raises(ValueError, match="at least 1"):
        read_trace(bad)


def test_shared_prefix_groups_share_their_system_prompt_and_interleave():
    from collections import Counter

    spec = WorkloadSpec(workload="shared-prefix", groups=4, questions=5, system_len=24, prompt_len=6,
                        output_len=3, rate=10.0, vocab_size=200, seed=2)
    reqs = generate(spec)
    assert len(reqs) == 20 and Counter(r.group for r in reqs) == {g: 5 for g in range(4)}
    systems = {r.group: tuple(r.prompt_token_ids[:24]) for r in reqs}
    assert len(set(systems.values())) == 4
    for r in reqs:
        assert tuple(r.prompt_token_ids[:24]) == systems[r.group] and r.prompt_len == 30
    groups = [r.group for r in sorted(reqs, key=lambda r: r.arrival_s)]
    assert sum(a != b for a, b in zip(groups, groups[1:])) > 5, "groups should interleave"
    assert [r.prompt_token_ids for r in generate(spec, rate=1.0)] == [r.prompt_token_ids for r in reqs]
    with pytest.raises(ValueError, match="max-total"):
        generate(WorkloadSpec(**{**spec.describe(), "max_total": 31}))


def test_multi_turn_prompt_lengths_add_up_turn_by_turn():
    from benchmarks.harness.prefix_workloads import conversations, reusable_tokens

    spec = WorkloadSpec(workload="multi-turn", conversations=3, turns=3, system_len=10,
                        prompt_dist="uniform", prompt_min=4, prompt_max=9, output_len=5, rate=2.0,
                        vocab_size=100, seed=4)
    reqs = generate(spec)
    singles, chains = conversations(reqs)
    assert not singles and len(chains) == 3 and all(len(c) == 3 for c in chains)
    system = chains[0][0].prompt_token_ids[:10]
    for turns in chains:
        assert turns[0].prompt_token_ids[:10] == system   # shared by every conversation
        context = 0
        for k, r in enumerate(turns):
            message = len(r.prompt_token_ids) - (10 if k == 0 else 0)
            assert 4 <= message <= 9 and r.prompt_len == context + len(r.prompt_token_ids)
            context = r.prompt_len + r.output_len
    # Reusable: the system prompt after the first conversation, and all earlier turns.
    expected = 2 * 10 + sum(t.prompt_len - len(t.prompt_token_ids) for c in chains for t in c[1:])
    assert reusable_tokens(reqs, 10) == expected


def test_priming_sends_each_shared_system_prompt_once_and_nothing_else():
    from benchmarks.harness.prefix_workloads import priming

    shared = WorkloadSpec(workload="shared-prefix", groups=4, questions=5, system_len=24, prompt_len=6,
                          output_len=3, rate=10.0, vocab_size=200, seed=2)
    systems = {tuple(r.prompt_token_ids[:24]) for r in generate(shared)}
    primed = priming(shared)
    assert {tuple(r.prompt_token_ids[:24]) for r in primed} == systems and len(primed) == 4
    assert all(r.prompt_len == 25 == len(r.prompt_token_ids) and r.output_len == 1 for r in primed)
    chat = WorkloadSpec(workload="multi-turn", conversations=3, turns=2, system_len=10, prompt_len=4,
                        output_len=5, rate=2.0, vocab_size=100, seed=4)
    [first] = priming(chat)
    assert all(r.prompt_token_ids[:10] == first.prompt_token_ids[:10]
               for r in generate(chat) if r.turn == 0)
    assert priming(WorkloadSpec(**{**chat.describe(), "system_len": 0})) == []
