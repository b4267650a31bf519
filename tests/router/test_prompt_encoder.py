"""The router encodes text prompts with the fast tokenizer alone (tokenizer.json):
the same ids as transformers' tokenizer, without loading transformers, whose
import holds the GIL for seconds and starved a restarted router's loop."""

import asyncio
import json
import shutil

import pytest
from transformers import AutoTokenizer

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.redis_server import free_port
from common.tokenizer import encode_prompt, load_encoder
from tests.support.router_harness import (Replicas, client, collect, make_config, running_router,
                                          tokens_of)

TEXTS = ["the model", " a leading space", "héllo wörld ✓ 数字", "a\nb\tc  d", "<s> literal", ""]


def transformers_ids(folder, text):
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return encode_prompt(tok, text)


@pytest.mark.parametrize("model", ["tiny_model", "smollm2_model"])
def test_the_fast_encoder_gives_transformers_ids(request, model):
    folder = request.getfixturevalue(model)
    encoder = load_encoder(str(folder))
    assert encoder is not None
    for text in TEXTS:
        assert encode_prompt(encoder, text) == transformers_ids(folder, text), text


def test_a_config_that_transformers_applies_to_the_tokenizer_keeps_transformers(tiny_model,
                                                                               tmp_path):
    folder = tmp_path / "bos"
    shutil.copytree(tiny_model, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True
    config_path.write_text(json.dumps(config))
    assert load_encoder(str(folder)) is None


def test_a_text_prompt_is_served_without_loading_transformers_tokenizer(redis_url, tiny_model,
                                                                        arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0")
            async with client(app.address) as stub:
                msgs = await collect(stub, gpb.GenerateRequest(
                    prompt="the model", sampling=gpb.SamplingParams(max_tokens=3)))
            assert len(tokens_of(msgs)) == 3
            assert not app.admission.tokenizer_requested
            first = reps["r0"].rec.assignments[0]
            assert list(first.prompt_token_ids) == transformers_ids(tiny_model, "the model")
            await reps.close()

    arun(scenario())


@pytest.mark.parametrize("http", [False, True])
def test_the_openai_door_loads_the_chat_template_at_start(redis_url, tiny_model, arun, http):
    """Chat needs transformers' tokenizer: with the HTTP door open it loads at start,
    in the background, not on the first chat call; gRPC alone never loads it."""
    async def scenario():
        config = make_config(redis_url, tiny_model, http_port=0 if not http else free_port())
        async with running_router(config) as app:
            assert app.admission.tokenizer_requested == http
            if http:
                tokenizer = await asyncio.wait_for(app.admission.tokenizer(), 60)
                assert tokenizer.chat_template

    arun(scenario(), timeout=90)


def test_a_call_whose_tokenizer_fails_after_admission_leaves_no_request_behind(redis_url, tiny_model, arun):
    """Logprobs need transformers' tokenizer after the call's requests are admitted:
    if it fails, the call is answered with the error and its requests are cancelled,
    not left running with no client."""
    import grpc
    import httpx

    from router.validation import RouterError

    async def scenario():
        port = free_port()
        async with running_router(make_config(redis_url, tiny_model, http_port=port)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0", hold_on_finish=True)   # the requests would run on and on

            async def broken():
                raise RouterError(grpc.StatusCode.INTERNAL, "tokenizer failed to load", "tokenizer")
            app.admission.tokenizer = broken
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                r = await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4,
                                                              "logprobs": 1, "n": 2})
            assert r.status_code == 500 and "tokenizer failed" in r.json()["error"]["message"], r.text
            assert len(reps["r0"].rec.assignments) == 2   # both were admitted and running
            assert not [req for req in app.table.requests.values() if req.live]
            await reps.close()

    arun(scenario(), timeout=90)
