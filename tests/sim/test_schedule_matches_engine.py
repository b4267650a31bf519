"""A simulated engine schedules exactly as the real EngineCore on the tiny model does,
given the same requests and KV budget: same chunks every step, same preemptions,
admission capacity, load, prefix cache counters and KV event counts. Only the
tokens differ: the simulated ones follow the rule."""

from __future__ import annotations

import random

import pytest
import torch

from replica_worker.engine.core import EngineCore
from replica_worker.engine.config import engine_config
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers import SCHEDULERS
from replica_worker.sim.cost_model import load_profile
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.runner import chunk_signature
from tests.support.scripted_replica import expected_tokens

# Small enough that the on-demand schedulers preempt, large enough for the longest request.
SETTINGS = dict(chunk_size=48, max_num_batched_tokens=256, max_num_seqs=6, num_blocks=36, block_size=8)


def workload(seed: int = 0):
    """Prompts with shared prefixes (prefix cache hits), a resumed request, and one
    request per step arriving for the first steps."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(40)]
    out = []
    for i in range(16):
        tail = [rng.randrange(1, 500) for _ in range(rng.randint(3, 90))]
        prompt = system + tail if i % 3 == 0 else tail
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        resume = [7, 8, 9] if i == 5 else []
        out.append((f"r{i}", prompt, params, resume))
    return out


def drive(engine, requests, observe):
    """Adds request i before step i (the rest after), steps to the end; observe(step) after each."""
    pending = list(requests)
    deltas = []
    while pending or engine.has_unfinished():
        if pending:
            rid, prompt, params, resume = pending.pop(0)
            engine.add_request(rid, prompt, params, resume_token_ids=resume)
        result = engine.step()
        deltas.extend(result.deltas)
        observe(engine, result)
    return deltas


def trace(engine, requests, schedule_of):
    rows = []

    def observe(e, result):
        events = e.take_kv_events()
        rows.append((result.batch_size, result.num_tokens, result.num_preempted, e.admission_capacity(),
                     e.load(), e.prefix_cache_stats(), len(events.stored), len(events.evicted),
                     tuple(e.request_ids())))

    deltas = drive(engine, requests, observe)
    return schedule_of(), rows, deltas


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_the_simulated_engine_schedules_as_the_real_one(scheduler, tiny_model):
    torch.set_num_threads(1)
    requests = workload()
    real = EngineCore(engine_config(str(tiny_model), scheduler, **SETTINGS))
    real_schedule = []
    launch = real.runner.launch

    def recording_launch(chunks, previous=None):
        real_schedule.append(chunk_signature(chunks))
        return launch(chunks, previous)

    real.runner.launch = recording_launch
    sim = SimulatedEngine.from_profile(load_profile("cpu-tiny"), scheduler, time_scale=0, record=True,
                                       vocab_size=real.vocab_size, max_model_len=real.max_model_len,
                                       **SETTINGS)
    real_run = trace(real, requests, lambda: real_schedule)
    sim_run = trace(sim, requests, lambda: [s.chunks for s in sim.runner.steps])

    assert sim_run[0] == real_run[0]  # chunk by chunk, step by step
    assert sim_run[1] == real_run[1]  # capacity, load, cache counters, KV events, requests
    assert len(real_run[0]) > len(requests)
    if scheduler in ("sarathi", "simple_chunking", "vllm"):
        assert sum(row[2] for row in real_run[1]) > 0, "the KV budget should force preemptions"
    assert real.prefix_cache_stats().hits > 0

    # The simulated tokens follow the rule, resumed tokens counted, and stop at max_tokens.
    got = {}
    for d in sim_run[2]:
        got.setdefault(d.request_id, []).extend(d.new_token_ids)
    for rid, prompt, params, resume in requests:
        n = params.max_tokens
        assert got[rid] == expected_tokens(prompt, n, sim.vocab_size)[len(resume):], rid
