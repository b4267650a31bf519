"""A real instruct model through the whole system: router, Redis and one CPU
replica serving SmolLM2-135M-Instruct answer a chat-templated question, token
for token as transformers' greedy generation, and the replica's metrics count it."""

from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from client.api import make_request, sync_stub
from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.redis_server import free_port
from common.tokenizer import load_tokenizer
from stack.demo import chat_prompt
from tests.support.live_stack import LiveStack

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


def transformers_greedy(model_dir: str, prompt_ids: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def vllm_samples(port: int) -> dict[str, tuple[dict, float]]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("vllm:")}


def test_smollm2_answers_through_the_stack_as_transformers_does(tmp_path, redis_url, smollm2_model):
    model = str(smollm2_model)
    prompt = chat_prompt(load_tokenizer(model), QUESTION)
    prompt_ids = load_tokenizer(model).encode(prompt)  # as the router tokenizes it
    expected = transformers_greedy(model, prompt_ids, MAX_TOKENS)
    stack = LiveStack(tmp_path, redis_url, model)
    try:
        stack.start_router()
        metrics_port = free_port()
        stack.start_replica("r0", "--metrics-port", str(metrics_port))
        tokens, text, last = [], "", None
        for msg in sync_stub(stack.address).Generate(
                make_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0), timeout=120):
            tokens.extend(msg.token_ids)
            text += msg.text
            last = msg
        samples = vllm_samples(metrics_port)
        # max_tokens left out is the length the prompt leaves (8,192 in all): the
        # replica's default cache holds such a request, so it runs to its EOS.
        unbounded = list(sync_stub(stack.address).Generate(make_request(prompt, temperature=0.0),
                                                           timeout=120))
    finally:
        stack.stop()
    assert "Paris" in text, text
    assert tokens == expected
    assert unbounded[-1].finish_reason == gpb.FINISH_REASON_STOP, unbounded[-1]
    assert [t for m in unbounded for t in m.token_ids][:MAX_TOKENS] == expected
    assert last.timings.replica_id == "r0"
    # One request: its prompt, its tokens, one first token and a gap between each later one.
    value = {name: v for name, (_, v) in samples.items()}
    assert value["vllm:prompt_tokens_total"] == len(prompt_ids)
    assert value["vllm:generation_tokens_total"] == len(tokens)
    assert value["vllm:time_to_first_token_seconds_count"] == 1
    assert value["vllm:inter_token_latency_seconds_count"] == len(tokens) - 1
    assert value["vllm:num_requests_running"] == value["vllm:num_requests_waiting"] == 0
    assert value["vllm:kv_cache_usage_perc"] == 0
    served = Path(model).name  # the replica's default model name: the folder's
    assert {labels.get("model_name") for labels, _ in samples.values()} == {served}
