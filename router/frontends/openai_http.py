"""The OpenAI-compatible HTTP front door: FastAPI on the router's own event loop
(uvicorn, as vLLM serves it), beside gRPC, over the same request path.

  POST /v1/completions   POST /v1/chat/completions   GET /v1/models[/{id}]   GET /health

Streaming is server-sent events ending with `data: [DONE]`. Errors use
OpenAI's JSON shape and the status the gRPC code maps to (400, 401, 404, 409,
429, 503). A client-chosen `X-Request-Id` makes a call idempotent: calling
again with it, after a router restart say, replays the output. A client
that disconnects cancels its request; the router ending a stream at shutdown
does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.datastructures import Headers
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.generation_config import sampling_defaults
from router.auth import key_matches
from router.frontends import openai_render as render
from router.frontends.openai_models import ChatCompletionRequest, CompletionRequest
from router.requests.request import ERROR
from router.requests.spec import Sampling
from router.validation import RouterError, check_sampling, invalid

log = logging.getLogger(__name__)

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "unavailable_error", 500: "internal_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": status}}


class JSONAnswer(JSONResponse):
    """A JSON response rendered by render.json_bytes (pydantic's serializer)."""

    def render(self, content) -> bytes:
        return render.json_bytes(content)


def error_response(status: int, message: str, headers=None) -> JSONAnswer:
    return JSONAnswer(error_body(status, message), status_code=status, headers=headers)


def describe_validation_error(err: RequestValidationError) -> str:
    """The first problem, named by its field: 'messages.0.role: Field required'."""
    errors = err.errors()
    if not errors:
        return "the request body is not valid"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    # Union members show up as type names in the path (prompt.str, prompt.list[int]).
    path = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_name(x)]
    field = ".".join(path) or "body"
    union = [e for e in errors if e.get("loc", ())[:2] == first.get("loc", ())[:2]]
    if len(union) > 1:
        return f"{field}: not a valid value ({len(union)} accepted forms, none matched)"
    return f"{field}: {first.get('msg', 'invalid value')}"


def _is_type_name(part) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


class _RequireApiKey:
    """401 for a /v1/ call without a valid `Authorization: Bearer KEY`.

    Plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware runs
    every request in its own task group and relays the body and the client's
    receive through memory streams, a large share of a short request's cost."""

    def __init__(self, app, keys: frozenset[str], on_reject):
        self.app = app
        self.keys = keys
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = Headers(scope=scope).get("authorization", "")
            key = header[7:].strip() if header.lower().startswith("bearer ") else ""
            if not key or not key_matches(key, self.keys):
                self.on_reject()
                message = "missing API key (Authorization: Bearer <key>)" if not key else "invalid API key"
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _HotRoutes:
    """ASGI: a POST to one of the two hot endpoints goes straight to its handler
    (a Starlette Request in, a Response out); everything else to the FastAPI app.

    FastAPI's stack around a route (server-error, exception and exit-stack
    middleware, routing, the request/response wrapper) ran on every call, a
    share of a short call's router CPU (benchmarks/router/NOTES.md). What
    that stack gave these two routes is kept here: a refusal (RouterError, a
    body too large or not valid) answered by the same handler as on every other
    route, and anything unexpected logged and answered 500 in OpenAI's shape,
    or the connection closed if the response had already started."""

    def __init__(self, app, routes: dict, refused):
        self.app = app
        self.routes = routes
        self.refused = refused

    async def __call__(self, scope, receive, send):
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except (RouterError, BodyTooLarge, RequestValidationError) as err:
            response = await self.refused(request, err)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            response = error_response(500, "internal error in the router")
        started = False

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await response(scope, receive, sending)
        except Exception:
            if started:   # uvicorn logs it and closes the connection: the client sees it cut short
                raise
            log.exception("%s %s: answering failed", scope["method"], scope["path"])
            await error_response(500, "internal error in the router")(scope, receive, send)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the router owns SIGTERM and SIGINT: its stop ends this server too


class OpenAIFrontend:
    def __init__(self, admission, table, config, metrics, limits):
        self.admission = admission
        self.table = table
        self.config = config
        self.metrics = metrics
        self.limits = limits
        self.keys = config.api_key_set
        self.max_body = int(config.http_max_body_mib * 2**20)
        self.sampling_defaults = model_sampling_defaults(config, limits)
        self.app = self._build()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    # ---- serving ----
    async def start(self, host: str, port: int) -> int:
        # No proxy-header rewriting: the router never reads a client's address, and
        # that middleware ran on every request.
        cfg = uvicorn.Config(self.app, host=host, port=port, lifespan="off", access_log=False,
                             log_level="warning", timeout_graceful_shutdown=2, proxy_headers=False)
        self._server = _Server(cfg)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(), name="openai-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- the app ----
    def _build(self):
        """The ASGI app served: the API key check (when keys are set) around the
        hot routes, around FastAPI for the rest."""
        # telemetry off: the router exports Prometheus metrics, and FastAPI's
        # OpenTelemetry hooks looked their providers up in the environment on every
        # request. The body bound is _read_body's, not max_body_size's: that one
        # answers a too-large Content-Length in plain text, and every error here
        # takes OpenAI's JSON shape.
        app = FastAPI(title="Quadriga", openapi_url=None, docs_url=None, redoc_url=None,
                      telemetry={"tracing": False, "metrics": False, "logs": False})

        for kind in (RouterError, BodyTooLarge, RequestValidationError):
            app.add_exception_handler(kind, self._refused)

        @app.exception_handler(StarletteHTTPException)
        async def framework_error(request, err: StarletteHTTPException):
            # An unknown path (404) or method (405): the framework's own answers, in
            # OpenAI's shape like every other error here, so SDKs can read them.
            return error_response(err.status_code, f"{request.method} {request.url.path}: "
                                  f"{err.detail}", headers=err.headers)

        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        hot = {"/v1/completions": self.completions, "/v1/chat/completions": self.chat_completions}
        for path, handler in hot.items():   # reached only by other methods: a 405 from here
            app.router.add_route(path, handler, methods=["POST"])
        served = _HotRoutes(app, hot, self._refused)
        if self.keys:
            served = _RequireApiKey(served, self.keys, self.metrics.rejections.labels("client_auth").inc)
        return served

    async def _refused(self, _request, err: Exception) -> JSONAnswer:
        """A call refused with a reason the client can act on, in OpenAI's shape."""
        if isinstance(err, RouterError):
            self.metrics.rejections.labels(err.reason).inc()
            return error_response(STATUS.get(err.code, 500), err.message)
        if isinstance(err, BodyTooLarge):
            self.metrics.rejections.labels("body_too_large").inc()
            return error_response(413, str(err))
        assert isinstance(err, RequestValidationError), err
        self.metrics.rejections.labels("invalid_argument").inc()
        return error_response(400, describe_validation_error(err))

    async def health(self):
        if self.admission.stopping:
            return error_response(503, "the router is shutting down")
        return {"status": "ok"}

    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str):
        """GET /v1/models/{id}: the SDK's models.retrieve."""
        self._check_model(model_id)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.config.served_model_name, "object": "model", "created": 0,
                "owned_by": "quadriga", "max_model_len": self.limits.max_model_len}

    def _check_model(self, model: str | None) -> None:
        served = self.config.served_model_name
        if model and model != served:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model {model!r} does not exist; this router serves {served!r}",
                              "unknown_model")

    async def completions(self, request: Request):
        body = await _parse(request, CompletionRequest, self.max_body)
        self._check_model(body.model)
        rid = self._request_id(request)
        specs = body.specs(rid or "", self.sampling_defaults)
        return await self._serve(request, body, specs, rid, chat=False)

    async def chat_completions(self, request: Request):
        body = await _parse(request, ChatCompletionRequest, self.max_body)
        self._check_model(body.model)
        rid = self._request_id(request)
        messages = body.rendered_messages()
        body.chat_sampling(self.sampling_defaults)  # bad sampling is reported before the template runs
        prompt_ids = await self.admission.render_chat(messages)
        return await self._serve(request, body, body.specs(rid or "", prompt_ids, self.sampling_defaults),
                                 rid, chat=True)

    @staticmethod
    def _request_id(request: Request) -> str | None:
        rid = request.headers.get("x-request-id")
        if rid is not None and not rid:
            raise invalid("X-Request-Id is empty")
        return rid

    # ---- one call: admit its requests, then stream or answer ----
    async def _serve(self, request: Request, body, specs, rid: str | None, chat: bool):
        # Without a client's X-Request-Id the router names the call, and its requests
        # after it as a client's id would name them (ID, or ID-index of several): the
        # header sent back is then a real id, and a client cut off mid-call may
        # re-attach with it. They stay ids the router made (poppable at once).
        made = None if rid else os.urandom(16).hex()
        reqs = await self._open_all(specs, made)
        call_id = rid or made
        meta = render.CallMeta(id=("chatcmpl-" if chat else "cmpl-") + call_id,
                               model=self.config.served_model_name, created=int(time.time()),
                               chat=chat, n=body.n, include_usage=body.include_usage)
        headers = {"X-Request-Id": call_id}
        try:
            tokenizer = await self.admission.tokenizer() if specs[0].sampling.logprobs is not None else None
        except BaseException:   # admitted, but no stream will ever follow them: end them here
            for r in reqs:
                self.table.cancel(r.id, "call_refused")
            raise
        if body.stream:
            return StreamingResponse(self._stream(reqs, meta, tokenizer), headers=headers,
                                     media_type="text/event-stream")
        return await self._answer(request, reqs, meta, tokenizer, headers)

    async def _open_all(self, specs, made: str | None):
        if len(specs) == 1:  # the common call: no gather, no task per request
            return [await self.admission.open(specs[0], made)]
        names = [f"{made}-{i}" if made else None for i in range(len(specs))]
        results = await asyncio.gather(*(self.admission.open(s, name) for s, name in zip(specs, names)),
                                       return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return results
        for r in results:  # all or nothing: the accepted ones of a refused call are cancelled
            if not isinstance(r, BaseException):
                self.table.cancel(r.id, "call_refused")
        raise failure

    def _subscribe(self, reqs):
        event = asyncio.Event()
        interval = self.config.stream_interval
        return event, [self.table.subscribe(r, interval, event) for r in reqs]

    async def _stream(self, reqs, meta, tokenizer):
        event, subs = self._subscribe(reqs)
        chunks = render.StreamRenderer(meta, reqs, tokenizer)
        done = [False] * len(reqs)
        try:
            yield chunks.opening()
            while not all(done):
                event.clear()
                for i, (req, sub) in enumerate(zip(reqs, subs)):
                    if done[i]:
                        continue
                    if sub.detached:
                        yield render.sse(error_body(503, sub.detached))
                        return
                    out = req.take(sub)
                    if out is None:
                        continue
                    tokens, text, offset, last = out
                    if last and req.finish_reason == ERROR:
                        yield render.sse(error_body(500, req.error or "the request failed"))
                        return
                    yield chunks.delta(i, req, tokens, text, offset, last)
                    done[i] = last
                if not all(done):
                    await event.wait()
            yield chunks.closing()
        finally:
            for req, sub in zip(reqs, subs):
                self.table.unsubscribe(req, sub)

    async def _answer(self, request: Request, reqs, meta, tokenizer, headers):
        event, subs = self._subscribe(reqs)
        disconnected = []

        async def watch_disconnect():
            await _disconnected(request)
            disconnected.append(True)
            event.set()

        # One watcher task a call, which wakes the same event the tokens do.
        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            while True:
                event.clear()
                for req, sub in zip(reqs, subs):
                    if sub.detached:
                        return error_response(503, sub.detached)
                if all(r.finish_visible for r in reqs):
                    break
                if disconnected:
                    return error_response(499, "client disconnected")
                await event.wait()
            failed = next((r for r in reqs if r.finish_reason == ERROR), None)
            if failed is not None:
                return error_response(500, failed.error or "the request failed")
            return JSONAnswer(render.full_response(meta, reqs, tokenizer), headers=headers)
        finally:
            watcher.cancel()
            for req, sub in zip(reqs, subs):
                self.table.unsubscribe(req, sub)


def model_sampling_defaults(config, limits) -> dict:
    """The model's sampling defaults for fields a request leaves unset, with
    --generation-config auto (vLLM's default); {} with none, or where the
    folder's values would be refused (logged)."""
    if config.generation_config == "none":
        return {}
    defaults = sampling_defaults(config.model)
    if not defaults:
        return {}
    try:
        check_sampling(Sampling(**defaults), limits)
    except RouterError as err:
        log.warning("the model's generation_config.json is not used for defaults: %s", err.message)
        return {}
    log.info("sampling fields a request leaves unset take the model's generation_config.json "
             "values: %s (--generation-config none: OpenAI's defaults)", defaults)
    return defaults


class BodyTooLarge(Exception):
    """A request body past --http-max-body-mib: answered 413, the rest never read."""


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or BodyTooLarge as soon as it is known to pass `limit` bytes: from
    Content-Length before a byte is read, else while it streams in, so a huge or
    endless body never sits in the router's memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body ({int(declared)} bytes) is larger than the router takes "
                           f"({limit} bytes, --http-max-body-mib)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is larger than the router takes ({limit} bytes, "
                               "--http-max-body-mib)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[BaseModel], limit: int):
    """The body through pydantic's own JSON validator. The two hot endpoints take
    the raw request rather than a typed body parameter: FastAPI's body path
    (content-type dispatch, json.loads, then validation of the dict) cost more
    router CPU per request than the rest of the handler. Errors take the same
    400 path and messages as FastAPI's own."""
    try:
        return model.model_validate_json(await _read_body(request, limit))
    except ValidationError as err:
        raise RequestValidationError(err.errors(include_url=False)) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
