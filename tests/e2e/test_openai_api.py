"""The OpenAI HTTP front door against a real stack: router, Redis and a CPU
replica with a real engine (tiny model with a chat template), driven by the
real `openai` SDK and by httpx for raw SSE and error bodies. Greedy text is
checked against transformers' greedy tokens, logprobs against its logits."""

import asyncio
import json
import signal
import socket
import uuid

import httpx
import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from common.redis_server import free_port
from common.tokenizer import load_tokenizer
from tests.engine.hf_reference import hf_greedy
from tests.support.live_stack import LiveStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model):
    st = LiveStack(tmp_path_factory.mktemp("openai"), redis_server.url, str(tiny_model),
                   router_args=("--http-port", str(free_port()), "--redis-prefix",
                                f"oa{uuid.uuid4().hex[:6]}:", "--queue-limit", "64",
                                "--http-max-body-mib", "1", "--metrics-port", str(free_port())))
    st.http_port = int(st.router_args[1])
    st.metrics_port = int(st.router_args[-1])
    st.start_router()
    st.start_replica("r0", "--max-num-seqs", "8")
    yield st
    st.stop()


def base(st) -> str:
    return f"http://127.0.0.1:{st.http_port}"


@pytest.fixture
def sdk(stack):
    return openai.OpenAI(base_url=base(stack) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(str(tiny_model))


def model_name(stack) -> str:
    return sdk_models(stack)[0]


def sdk_models(stack):
    return [m.id for m in openai.OpenAI(base_url=base(stack) + "/v1", api_key="x").models.list()]


def greedy_text(tiny_model, tok, prompt_ids, n):
    return tok.decode(hf_greedy(str(tiny_model), [list(prompt_ids)], n)[0])


def test_models_and_health(stack, sdk):
    name = stack.model.rsplit("/", 1)[-1]
    assert sdk_models(stack) == [name]
    assert sdk.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.models.retrieve("another-model")
    assert httpx.get(base(stack) + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/embeddings", 404),
                                                  ("GET", "/v1/completions", 405)])
def test_unknown_routes_answer_in_openais_error_shape(stack, method, path, status):
    r = httpx.request(method, base(stack) + path)
    assert r.status_code == status
    assert path in r.json()["error"]["message"] and r.json()["error"]["code"] == status


def test_completion_equals_transformers_greedy(stack, sdk, tiny_model, tok):
    ids = tok.encode("The router and the replica")
    out = sdk.completions.create(model=model_name(stack), prompt="The router and the replica",
                                 max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == greedy_text(tiny_model, tok, ids, 12)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)


def test_logit_bias_steers_the_answer_as_transformers_sequence_bias_does(stack, sdk, tiny_model, tok):
    """logit_bias travels router -> Redis -> replica -> sampler: the text equals
    transformers' greedy text under the same one-token sequence biases."""
    prompt = [5, 17, 230]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)

    def greedy(**kw):
        return hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0, **kw)[0, len(prompt):].tolist()

    plain = greedy()
    bias = {plain[0]: -100.0, 11: 1.5}
    want = greedy(sequence_bias={(t,): b for t, b in bias.items()})
    out = sdk.completions.create(model=model_name(stack), prompt=prompt, max_tokens=8, temperature=0,
                                 logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
    assert want[0] != plain[0]
    assert out.choices[0].text == tok.decode(want)


def test_completion_of_token_ids_and_several_prompts(stack, sdk, tiny_model, tok):
    prompts = [[5, 17, 230], [9, 44, 61, 62]]
    out = sdk.completions.create(model=model_name(stack), prompt=prompts, max_tokens=6,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    for c, p in zip(out.choices, prompts):
        assert c.text == greedy_text(tiny_model, tok, p, 6)
    assert out.usage.prompt_tokens == 7


def test_chat_streaming_and_not(stack, sdk, tiny_model, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    expected = greedy_text(tiny_model, tok, ids, 10)
    whole = sdk.chat.completions.create(model=model_name(stack), messages=messages, max_tokens=10,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids)
    stream = sdk.chat.completions.create(model=model_name(stack), messages=messages, max_tokens=10,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def router_sample(stack, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_call_answered_whole_reaches_the_router_in_two_deliveries(stack, sdk, tiny_model, tok):
    """stream: false asks the replica to hold every token after the first until the
    finish; a stream gets one delivery a token. quadriga_tbt_seconds counts one gap
    per delivery after a request's first."""
    prompt, n = [7, 8, 9], 24
    expected = greedy_text(tiny_model, tok, prompt, n)
    gaps = router_sample(stack, "quadriga_tbt_seconds_count")
    whole = sdk.completions.create(model=model_name(stack), prompt=prompt, max_tokens=n,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.usage.completion_tokens == n
    whole_gaps = router_sample(stack, "quadriga_tbt_seconds_count") - gaps
    streamed = sdk.completions.create(model=model_name(stack), prompt=prompt, max_tokens=n,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    stream_gaps = router_sample(stack, "quadriga_tbt_seconds_count") - gaps - whole_gaps
    assert whole_gaps == 1
    assert stream_gaps == n - 1


def test_raw_sse_ends_with_done(stack):
    with httpx.stream("POST", base(stack) + "/v1/completions", timeout=30,
                      json={"prompt": [3, 4, 5], "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert bodies[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_completions_share_the_prompt_and_seeds_reproduce(stack, sdk):
    def call(seed):
        return sdk.completions.create(model=model_name(stack), prompt=[7, 8, 9], max_tokens=8,
                                      n=3, temperature=1.0, seed=seed,
                                      extra_body={"ignore_eos": True})
    a, b, c = call(11), call(11), call(12)
    texts = [x.text for x in a.choices]
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert texts == [x.text for x in b.choices], "the same seed must give the same answers"
    assert len(set(texts)) > 1, "completions of one call must differ"
    assert texts != [x.text for x in c.choices]
    assert a.usage.prompt_tokens == 3 and a.usage.completion_tokens == 24


def test_logprobs_against_transformers(stack, sdk, tiny_model, tok):
    from transformers import AutoModelForCausalLM

    prompt = [11, 12, 13, 14]
    out = sdk.completions.create(model=model_name(stack), prompt=prompt, max_tokens=5,
                                 temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    greedy = hf_greedy(str(tiny_model), [prompt], 5)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, tok_id in enumerate(greedy):
        assert lp.tokens[i] == tok.decode([tok_id])
        assert abs(lp.token_logprobs[i] - ref[i, tok_id].item()) < 1e-3
        assert len(lp.top_logprobs[i]) <= 3
    chat = sdk.chat.completions.create(model=model_name(stack), max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2,
                                       messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_what_vllm_clients_send_is_read_as_vllm_reads_it(stack, sdk):
    """Nulls for nullable fields, a signed seed, and a completion's top_logprobs
    holding the sampled token even where it is not among the top k."""
    body = {"model": model_name(stack), "prompt": [7, 8], "max_tokens": 2, "n": None,
            "stream": None, "echo": None, "ignore_eos": None, "priority": None,
            "stream_options": None, "logprobs": None}
    r = httpx.post(base(stack) + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    chat = httpx.post(base(stack) + "/v1/chat/completions", timeout=60, json={
        "model": model_name(stack), "max_tokens": 2, "logprobs": None, "n": None,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]})
    assert chat.status_code == 200, chat.text

    def sampled(seed):
        return sdk.completions.create(model=model_name(stack), prompt=[7, 8, 9], max_tokens=8,
                                      temperature=1.5, seed=seed, logprobs=1,
                                      extra_body={"ignore_eos": True}).choices[0]
    a, b, c = sampled(-5), sampled(-5), sampled(2 ** 64 - 5)
    assert a.text == b.text == c.text
    lp = a.logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and len(top) <= 2


def test_stop_strings_end_the_text(stack, sdk, tiny_model, tok):
    ids = [21, 22, 23]
    full = greedy_text(tiny_model, tok, ids, 16)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip()
    out = sdk.completions.create(model=model_name(stack), prompt=ids, max_tokens=16, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and full.startswith(out.choices[0].text)


BAD = [
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1] * 2000}, 400, "leaving no room"),
    ({"prompt": ""}, 400, "empty prompt"),
    ({"prompt": [99999]}, 400, "vocabulary"),
    ({"prompt": "x", "n": 0}, 400, "n 0"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": 5}, 400, "prompt must be"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens is -1"),
    # defined by the API, not implemented: refused, never silently ignored
    ({"prompt": "x", "echo": True}, 400, "echo is not supported"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of above n"),
    ({"prompt": "x", "logit_bias": {"five": 10}}, 400, "logit_bias keys are token ids"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias[5] = 101.0 must lie in [-100, 100]"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias token 99999 is not in the vocabulary"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    # past what the replica protocol carries: refused at admission, never a stuck request
    ({"prompt": "x", "top_k": 2 ** 40}, 400, "top_k 1099511627776"),
    ({"prompt": "x", "min_tokens": 2 ** 33}, 400, "min_tokens 8589934592"),
    ({"prompt": "x", "priority": 2 ** 40}, 400, "priority"),
    ({"prompt": "x", "temperature": 1e300}, 400, "too large for a 32-bit float"),
    ({"prompt": "x", "seed": -2 ** 64}, 400, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options is only allowed"),
]


@pytest.mark.parametrize("body, status, words", BAD, ids=[b[2] for b in BAD])
def test_bad_input_gets_openai_errors(stack, body, status, words):
    r = httpx.post(base(stack) + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status and err["type"]


def test_bad_chat_and_bad_json(stack):
    r = httpx.post(base(stack) + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and "messages is empty" in r.json()["error"]["message"]
    r = httpx.post(base(stack) + "/v1/chat/completions", json={"messages": [{"content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(base(stack) + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and "messages[0] (user) has no content" in r.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = httpx.post(base(stack) + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert r.status_code == 400 and "function calling" in r.json()["error"]["message"]
    r = httpx.post(base(stack) + "/v1/chat/completions", timeout=60,   # tools offered, none to be called
                   json={"messages": [{"role": "user", "content": "x"}], "tools": tools,
                         "tool_choice": "none", "max_tokens": 2, "best_of": 1})
    assert r.status_code == 200, r.text
    r = httpx.post(base(stack) + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_a_body_past_the_bound_gets_413_and_disturbs_no_one(stack, sdk):
    """--http-max-body-mib 1 here: refused from Content-Length before a byte of the
    body is sent, and a chunked body without one is cut off once it passes the
    bound; the router serves on."""
    with socket.create_connection(("127.0.0.1", stack.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2097152\r\n\r\n")
        answer = b""
        while b'"code":413}}' not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"--http-max-body-mib" in answer, answer

    def chunks():
        # 1 MiB + 64 KiB of JSON whitespace: past the bound, not a body; what the router
        # leaves unread when it answers fits a loopback socket's buffers, so the
        # client sees the 413 rather than a reset
        for _ in range(17):
            yield b" " * 65536
    r = httpx.post(base(stack) + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--http-max-body-mib" in r.json()["error"]["message"], r.text
    out = sdk.completions.create(model=model_name(stack), prompt="still serving", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_a_client_disconnect_cancels_the_request(stack):
    async def scenario():
        async with httpx.AsyncClient(base_url=base(stack), timeout=30) as c:
            async with c.stream("POST", "/v1/completions", headers={"X-Request-Id": "walks-away"},
                                json={"prompt": [4, 5], "max_tokens": 800, "stream": True,
                                      "ignore_eos": True}) as r:
                async for _ in r.aiter_lines():
                    break
        await asyncio.sleep(1.0)
        # Re-attaching replays what it had: cancelled, far short of 800 tokens.
        async with httpx.AsyncClient(base_url=base(stack), timeout=30) as c:
            r = await c.post("/v1/completions", headers={"X-Request-Id": "walks-away"},
                             json={"prompt": [4, 5], "max_tokens": 800, "ignore_eos": True})
            return r.json()

    body = asyncio.run(scenario())
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 800


def test_a_client_disconnect_cancels_a_request_that_does_not_stream(stack):
    async def scenario():
        async with httpx.AsyncClient(base_url=base(stack), timeout=30) as c:
            with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes
                await c.post("/v1/completions", headers={"X-Request-Id": "gives-up"}, timeout=0.3,
                             json={"prompt": [4, 5], "max_tokens": 800, "ignore_eos": True})
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient(base_url=base(stack), timeout=30) as c:
            r = await c.post("/v1/completions", headers={"X-Request-Id": "gives-up"},
                             json={"prompt": [4, 5], "max_tokens": 800, "ignore_eos": True})
            return r.json()

    body = asyncio.run(scenario())
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 800


def test_api_keys_guard_the_http_api(tmp_path, redis_url, tiny_model):
    port = free_port()
    st = LiveStack(tmp_path, redis_url, str(tiny_model),
                   router_args=("--http-port", str(port), "--api-keys", "k1,k2"))
    try:
        st.start_router()
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x"},
                         headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["message"] == "invalid API key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url + "/v1", api_key="k2").models.list().data
        assert httpx.get(url + "/health").status_code == 200  # probes need no key
    finally:
        st.stop()


@pytest.mark.parametrize("named_by", ["client", "router"])
def test_reattach_by_request_id_after_a_router_sigkill(tmp_path, redis_url, tiny_model, tok, named_by):
    """With the client's X-Request-Id, or the one the router sent back when the
    client gave none: either names the request, so a call cut off by the
    router's death re-attaches with it and gets the whole output."""
    port, metrics_port = free_port(), free_port()
    st = LiveStack(tmp_path, redis_url, str(tiny_model),
                   router_args=("--http-port", str(port), "--lease-ttl", "20",
                                "--metrics-port", str(metrics_port)))
    st.metrics_port = metrics_port
    prompt = [31, 32, 33]
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"X-Request-Id": "survives"} if named_by == "client" else {}
    try:
        st.start_router()
        st.start_replica("r0")
        url = f"http://127.0.0.1:{port}"
        got = []
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                              timeout=30) as r:
                rid = r.headers["x-request-id"]
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got.append(json.loads(line[6:])["choices"][0]["text"])
                    if len(got) == 5:
                        st.router.proc.send_signal(signal.SIGKILL)
        assert rid == "survives" if named_by == "client" else len(rid) == 32
        st.router.proc.wait()
        st.start_router()
        text, finish = "", None
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                          timeout=60) as r:
            assert r.headers["x-request-id"] == rid
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        assert text == tok.decode(hf_greedy(str(tiny_model), [prompt], 300)[0])
        assert text.startswith("".join(got)) and finish == "length"
        # re-attached, not asked afresh (greedy would give the same text either way)
        assert router_sample(st, "quadriga_requests_accepted_total") == 0
    finally:
        st.stop()
