"""The replica's metrics, fed by a real engine on the tiny model and read back
from the HTTP endpoint the way Prometheus scrapes it."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.redis_server import free_port
from common.tokenizer import load_tokenizer
from replica_worker.engine.core import EngineCore
from replica_worker.engine.config import engine_config
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.worker.engine_loop import EngineReport
from replica_worker.worker.metrics import ReplicaMetrics

PROMPTS = {"a": [5, 17, 230, 9], "b": list(range(40, 71))}
MAX_TOKENS = {"a": 6, "b": 9}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run_to_completion(engine: EngineCore, metrics: ReplicaMetrics, *, observe_load_midway=None) -> None:
    while engine.has_unfinished():
        result = engine.step()
        metrics.observe(EngineReport(result, engine.admission_capacity(), engine.load(),
                                     tuple(engine.request_ids())))
        if observe_load_midway is not None:
            observe_load_midway()
            observe_load_midway = None


@pytest.fixture(scope="module")
def engine(tiny_model):
    return EngineCore(engine_config(str(tiny_model), max_num_seqs=1), load_tokenizer(str(tiny_model)))


def test_vllm_names_count_tokens_and_latencies_with_the_model_label(engine):
    metrics = ReplicaMetrics("tiny")
    port = free_port()
    metrics.serve(port)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rid],
                                                       ignore_eos=True))
    label = (("model_name", "tiny"),)
    seen_midway = {}
    # max_num_seqs=1: after the first step one request runs and one waits.
    run_to_completion(engine, metrics, observe_load_midway=lambda: seen_midway.update(scrape(port)))
    assert seen_midway[("vllm:num_requests_running", label)] == 1
    assert seen_midway[("vllm:num_requests_waiting", label)] == 1
    assert 0 < seen_midway[("vllm:kv_cache_usage_perc", label)] < 1
    got = scrape(port)
    assert got[("vllm:prompt_tokens_total", label)] == sum(map(len, PROMPTS.values()))
    assert got[("vllm:generation_tokens_total", label)] == sum(MAX_TOKENS.values())
    assert got[("vllm:time_to_first_token_seconds_count", label)] == len(PROMPTS)
    assert got[("vllm:time_to_first_token_seconds_sum", label)] > 0
    assert got[("vllm:inter_token_latency_seconds_count", label)] == sum(n - 1 for n in MAX_TOKENS.values())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert got[(name, label)] == 0
    # The project's own names are still there.
    assert got[("quadriga_replica_requests_finished_total", (("reason", "length"),))] == len(PROMPTS)


def test_a_resumed_request_counts_its_context_as_prompt_and_no_first_token(engine):
    metrics = ReplicaMetrics("tiny")
    port = free_port()
    metrics.serve(port)
    resumed = [11, 12, 13]
    engine.add_request("r", PROMPTS["a"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       resume_token_ids=resumed)
    run_to_completion(engine, metrics)
    got = scrape(port)
    label = (("model_name", "tiny"),)
    assert got[("vllm:prompt_tokens_total", label)] == len(PROMPTS["a"]) + len(resumed)
    assert got[("vllm:generation_tokens_total", label)] == 8 - len(resumed)
    assert got[("vllm:time_to_first_token_seconds_count", label)] == 0
    # Its first token here follows a token made elsewhere: no gap is measured for it.
    assert got[("vllm:inter_token_latency_seconds_count", label)] == 8 - len(resumed) - 1


def test_prefix_cache_counters_follow_the_engine(tiny_model):
    """vLLM's prefix cache counters, in tokens: two requests sharing 32 tokens
    (two blocks of 16), one after the other; the second finds both blocks."""
    engine = EngineCore(engine_config(str(tiny_model), max_num_seqs=1), load_tokenizer(str(tiny_model)))
    metrics = ReplicaMetrics("tiny")
    port = free_port()
    metrics.serve(port)
    shared = list(range(100, 132))
    for rid, tail in (("first", [7, 8, 9]), ("second", [4, 5])):
        engine.add_request(rid, shared + tail, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            result = engine.step()
            metrics.observe(EngineReport(result, engine.admission_capacity(), engine.load(),
                                         tuple(engine.request_ids()),
                                         prefix_stats=engine.prefix_cache_stats()))
    got = scrape(port)
    label = (("model_name", "tiny"),)
    assert got[("vllm:prefix_cache_queries_total", label)] == 35 + 34
    assert got[("vllm:prefix_cache_hits_total", label)] == 32
