"""Builds GenerateRequests, opens channels, and follows a request across a
list of routers (FailoverStream); shared by the CLI, tests and benchmarks."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import grpc

from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc
from common.router_health import RouterHealth

FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


def make_request(
    prompt: str | list[int],
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    priority: int = 0,
    stream_interval: int = 0,
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(ignore_eos=ignore_eos, stop=stop or [], stop_token_ids=stop_token_ids or [])
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling, priority=priority,
                             stream_interval=stream_interval)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    return req


def channel_credentials(ca_file: str = "") -> grpc.ChannelCredentials | None:
    if not ca_file:
        return None
    with open(ca_file, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def metadata(api_key: str = "") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def aio_channel(address: str, ca_file: str = "", options=()) -> grpc.aio.Channel:
    creds = channel_credentials(ca_file)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, creds, options=list(options))


def sync_stub(address: str, ca_file: str = "") -> generation_pb2_grpc.GenerationStub:
    creds = channel_credentials(ca_file)
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    return generation_pb2_grpc.GenerationStub(channel)


# A router that froze (its process stopped, the network gone without a reset)
# ends the stream within about 8 s, so the client moves on instead of waiting
# for TCP to give up. gRPC core times a ping out after ping_timeout_ms (one
# minute by default; keepalive_timeout alone does not end the stream while
# another ping is outstanding). The router accepts pings this often.
KEEPALIVE_OPTIONS = (("grpc.keepalive_time_ms", 3_000), ("grpc.keepalive_timeout_ms", 5_000),
                     ("grpc.http2.ping_timeout_ms", 5_000),
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.max_pings_without_data", 0))
# A stream that ends with one of these is taken up again at the next router.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.DEADLINE_EXCEEDED})


def parse_routers(value: str) -> list[str]:
    """'host:port[,host:port...]' -> the addresses, in order."""
    routers = [r.strip() for r in value.split(",") if r.strip()]
    if not routers or any(":" not in r for r in routers):
        raise ValueError(f"routers must be HOST:PORT[,HOST:PORT...], got {value!r}")
    return routers


class FailoverStream:
    """Streams one request from a list of routers: when a stream breaks
    (its router stopped, died or froze) it calls another router with the same
    request_id, which re-attaches and replays the output from token 0; what
    was delivered already is checked against the replay and skipped, so the
    caller sees every token once, in order, with output_offset continuing (a
    replay that differs from what was delivered raises ReplayMismatch: the
    router broke its promise, and hiding it would hide the fault). A request
    without a request_id gets one.

    The first attempt goes to the first router in the list, or, when that one
    is known to be down, to one drawn at random from the others not known to
    be down; so does each attempt after a break. The streams of a router that
    died, and the new requests meant for it, spread over all the others (in
    list order they would all land on the next one, doubling its load).
    Only when every router is down does it wait retry_delay between attempts.

        async for msg in FailoverStream(["a:50051", "b:50051"], request): ...
    """

    def __init__(self, routers: list[str], request: pb.GenerateRequest, *, ca_file: str = "",
                 metadata=(), attempt_timeout: float | None = None, max_attempts: int = 100,
                 retry_delay: float = 0.2, channels: dict | None = None,
                 health: RouterHealth | None = None):
        """channels: address -> open channel, and health, shared by many
        streams (a load generator); without them each attempt opens and closes
        its own channel, and the stream alone learns which routers failed."""
        self.routers = list(routers)
        self.request = pb.GenerateRequest()
        self.request.CopyFrom(request)
        if not self.request.request_id:
            self.request.request_id = uuid.uuid4().hex
        self.ca_file, self.metadata = ca_file, tuple(metadata)
        self.attempt_timeout, self.max_attempts, self.retry_delay = attempt_timeout, max_attempts, retry_delay
        self.channels = channels
        self.health = health if health is not None else RouterHealth()
        self.tokens = 0          # tokens delivered to the caller
        self.chars = 0           # characters of text delivered
        self._ids: list[int] = []      # the tokens delivered, to check replays against
        self._text: list[str] = []     # the text delivered, in pieces
        self.replayed = 0        # tokens a router sent again after a re-attach, checked and skipped
        self.broken: list[str] = []   # how each attempt that broke ended (status names)
        self.attempts: list[tuple[str, float, float, str]] = []   # each that broke: address, start, end, status
        self._rng = random.Random(self.request.request_id)

    async def __aiter__(self):
        address = self.health.first(self.routers, self._rng)
        while True:
            started = time.perf_counter()
            try:
                async for msg in self._attempt(address):
                    yield msg
                    if msg.HasField("finish_reason"):
                        return
                code = grpc.StatusCode.UNAVAILABLE   # ended without a finish
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                code = exc.code()
            self.broken.append(code.name)
            self.attempts.append((address, started, time.perf_counter(), code.name))
            self.health.failed(address)
            if len(self.broken) >= self.max_attempts:
                raise RuntimeError(f"request {self.request.request_id}: {len(self.broken)} attempts "
                                   f"broke ({', '.join(self.broken[-3:])})")
            address, wait = self.health.after(self.routers, address, self._rng)
            if wait:
                await asyncio.sleep(self.retry_delay)

    async def _attempt(self, address: str):
        first = True
        async for msg in self._at(address):
            if first:   # it answers: no longer passed over
                self.health.served(address)
                first = False
            yield msg

    async def _at(self, address: str):
        if self.channels is None:
            async with aio_channel(address, self.ca_file, options=KEEPALIVE_OPTIONS) as channel:
                async for msg in self._follow(channel):
                    yield msg
            return
        if address not in self.channels:
            self.channels[address] = aio_channel(address, self.ca_file, options=KEEPALIVE_OPTIONS)
        async for msg in self._follow(self.channels[address]):
            yield msg

    async def _follow(self, channel):
        seen_tokens = seen_chars = 0     # what this attempt's stream has carried
        stub = generation_pb2_grpc.GenerationStub(channel)
        async for msg in stub.Generate(self.request, metadata=self.metadata,
                                       timeout=self.attempt_timeout):
            skip_tokens = max(0, self.tokens - msg.output_offset)
            skip_chars = max(0, self.chars - seen_chars)
            if skip_tokens or skip_chars:
                self._check_replay(msg, skip_tokens, seen_chars, skip_chars)
            seen_tokens, seen_chars = msg.output_offset + len(msg.token_ids), seen_chars + len(msg.text)
            out = pb.GenerateResponse()
            out.CopyFrom(msg)
            del out.token_ids[:skip_tokens]
            del out.logprobs[:skip_tokens]
            out.text = msg.text[skip_chars:]
            out.output_offset = msg.output_offset + min(skip_tokens, len(msg.token_ids))
            if not out.token_ids and not out.text and not msg.HasField("finish_reason"):
                continue
            self.tokens = max(self.tokens, seen_tokens)
            self.chars = max(self.chars, seen_chars)
            self._ids.extend(out.token_ids)
            if out.text:
                self._text.append(out.text)
            yield out

    def _check_replay(self, msg, skip_tokens: int, at_char: int, skip_chars: int) -> None:
        again = list(msg.token_ids[:skip_tokens])
        had = self._ids[msg.output_offset:msg.output_offset + len(again)]
        text_again = msg.text[:skip_chars]
        if len(self._text) > 1:   # joined once a replay, not once a message
            self._text[:] = ["".join(self._text)]
        text_had = (self._text[0] if self._text else "")[at_char:at_char + len(text_again)]
        if again != had or text_again != text_had:
            raise ReplayMismatch(
                f"request {self.request.request_id}: the replay after a re-attach differs from "
                f"what was delivered (tokens at {msg.output_offset}: {again[:8]} against {had[:8]}; "
                f"text at {at_char}: {text_again[:40]!r} against {text_had[:40]!r})")
        self.replayed += len(again)


class ReplayMismatch(RuntimeError):
    """A router replayed output that differs from what the stream already delivered."""
