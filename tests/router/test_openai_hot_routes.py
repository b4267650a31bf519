"""The hot-route dispatch in front of the FastAPI app (openai_http._HotRoutes):
a POST to a hot path reaches its handler, anything else the app behind it, and a
handler's failure is answered in OpenAI's shape. The whole front door against a
real router is tests/e2e/test_openai_api.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
from starlette.responses import JSONResponse, PlainTextResponse

from router.frontends.openai_http import JSONAnswer, _HotRoutes, error_response
from router.frontends.openai_render import json_bytes, sse
from router.validation import RouterError


async def fallback(scope, receive, send):
    await PlainTextResponse("app behind", status_code=405)(scope, receive, send)


async def refused(_request, err):
    return error_response(429, f"refused: {err.message}")


def call(routes, method: str, path: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=_HotRoutes(fallback, routes, refused))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            return await http.request(method, path, json={"prompt": "x"})
    return asyncio.run(go())


def test_post_reaches_the_handler_and_other_calls_the_app_behind():
    async def handler(request):
        return JSONResponse({"echo": (await request.json())["prompt"]})

    routes = {"/v1/completions": handler}
    assert call(routes, "POST", "/v1/completions").json() == {"echo": "x"}
    for method, path in (("GET", "/v1/completions"), ("POST", "/v1/other")):
        answer = call(routes, method, path)
        assert (answer.status_code, answer.text) == (405, "app behind")


def test_a_refusal_goes_to_the_refusal_handler():
    async def handler(_request):
        raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full")

    answer = call({"/v1/completions": handler}, "POST", "/v1/completions")
    assert answer.status_code == 429
    assert answer.json()["error"]["message"] == "refused: queue full"


def test_an_unexpected_failure_is_a_500_in_openai_shape():
    async def handler(_request):
        raise RuntimeError("boom")

    answer = call({"/v1/completions": handler}, "POST", "/v1/completions")
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["code"] == 500 and error["message"] == "internal error in the router"


def test_an_answer_that_fails_before_it_starts_is_a_500_in_openai_shape():
    class Unsendable(JSONResponse):
        async def __call__(self, scope, receive, send):
            raise RuntimeError("cannot send")

    async def handler(_request):
        return Unsendable({"never": "sent"})

    answer = call({"/v1/completions": handler}, "POST", "/v1/completions")
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "internal error in the router"


def test_a_json_answer_carries_what_json_would_and_writes_a_non_finite_number_null():
    async def handler(_request):
        return JSONAnswer({"text": "café ✓", "logprob": float("-inf"), "n": [1, 2.5, None]})

    answer = call({"/v1/completions": handler}, "POST", "/v1/completions")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"text": "café ✓", "logprob": None, "n": [1, 2.5, None]}
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert json.loads(json_bytes({"x": 0.1, "y": 10**20})) == {"x": 0.1, "y": 10**20}
