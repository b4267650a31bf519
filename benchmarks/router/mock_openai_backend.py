"""An OpenAI-shaped backend that answers at once: the stand-in model server
behind the peer routers in benchmarks/router/peers.py.

A bare ASGI app (no framework) served by uvicorn, which uses httptools and
uvloop when installed. `POST /v1/completions` answers a non-streaming
completion of `max_tokens` tokens' worth of text (token i written "<i>", as
the scripted replica writes its tokens) with a usage block; bodies are built
once per max_tokens. It also answers what the routers ask of a worker before
they send it traffic: health, the model list and the server/model info
endpoints. Any other path gets 404 and is logged once, so a router asking for
something new shows up in the log.

    python -m benchmarks.router.mock_openai_backend --port 8100 [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache

MODEL = "mock"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_JSON = [(b"content-type", b"application/json")]
_MODELS = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "mock", "max_model_len": 4096}]}).encode()
_MODEL_INFO = json.dumps({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}).encode()
_SERVER_INFO = json.dumps({"model_path": MODEL, "served_model_name": MODEL, "dp_size": 1,
                           "max_total_num_tokens": 1 << 20}).encode()
_GETS = {"/health": b"{}", "/health_generate": b"{}", "/v1/models": _MODELS,
         "/get_model_info": _MODEL_INFO, "/model_info": _MODEL_INFO,
         "/get_server_info": _SERVER_INFO, "/server_info": _SERVER_INFO,
         "/get_load": b'{"load":0}', "/version": b'{"version":"mock"}'}
_unknown_seen: set[str] = set()


@lru_cache(maxsize=1024)
def completion_body(max_tokens: int, prompt_tokens: int) -> bytes:
    text = "".join(f"<{i}>" for i in range(max_tokens))
    return json.dumps({
        "id": "cmpl-mock", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                  "total_tokens": prompt_tokens + max_tokens},
    }, separators=(",", ":")).encode()


def _answer_completion(raw: bytes) -> tuple[int, bytes]:
    try:
        body = json.loads(raw)
        max_tokens = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        prompt = body.get("prompt", "")
    except (ValueError, TypeError, AttributeError):
        return 400, b'{"error":{"message":"the request body is not a JSON object","code":400}}'
    # A whitespace word count stands in for a tokenizer: usage only has to be plausible.
    prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
    return 200, completion_body(max(1, max_tokens), prompt_tokens)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return  # lifespan: nothing to set up
    path, method = scope["path"], scope["method"]
    if method == "POST" and path == "/v1/completions":
        status, body = _answer_completion(await _read_body(receive))
    elif method == "GET" and path in _GETS:
        status, body = 200, _GETS[path]
    else:
        if method == "POST":
            await _read_body(receive)
        if path not in _unknown_seen:
            _unknown_seen.add(path)
            print(f"mock backend: no {method} {path} (404)", file=sys.stderr, flush=True)
        status, body = 404, b'{"error":{"message":"not found","code":404}}'
    await send({"type": "http.response.start", "status": status,
                "headers": _JSON + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(argv=None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    a = p.parse_args(argv)
    uvicorn.run("benchmarks.router.mock_openai_backend:app", host=a.host, port=a.port,
                workers=a.workers, access_log=False, log_level="warning", lifespan="off",
                backlog=4096)
    return 0


if __name__ == "__main__":
    sys.exit(main())
