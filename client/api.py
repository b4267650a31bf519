"""Builds GenerateRequests and opens channels; shared by the CLI, tests and benchmarks."""

from __future__ import annotations

import grpc

from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc

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


def aio_channel(address: str, ca_file: str = "") -> grpc.aio.Channel:
    creds = channel_credentials(ca_file)
    if creds is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, creds)


def sync_stub(address: str, ca_file: str = "") -> generation_pb2_grpc.GenerationStub:
    creds = channel_credentials(ca_file)
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    return generation_pb2_grpc.GenerationStub(channel)
