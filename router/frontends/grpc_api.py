"""Generation servicer: the gRPC front door. Builds a plain RequestSpec,
streams deltas, re-attaches, cancels; knows nothing of Redis."""

from __future__ import annotations

import logging

import grpc

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import generation_pb2_grpc
from router.malformed import Malformed
from router.requests.spec import RequestSpec, Sampling, bias_pairs
from router.validation import RouterError

log = logging.getLogger(__name__)
GENERATE_METHOD = "/quadriga.v1.Generation/Generate"

_REPEATED = frozenset({"stop", "stop_token_ids"})


def _field(name: str, value):
    if name in _REPEATED:
        return tuple(value)
    return bias_pairs(value) if name == "logit_bias" else value


def spec_from_pb(msg: gpb.GenerateRequest) -> RequestSpec:
    # ListFields: only what the client set (optional fields by presence), in one call.
    sampling = Sampling(**{fd.name: _field(fd.name, v) for fd, v in msg.sampling.ListFields()})
    return RequestSpec(request_id=msg.request_id, prompt=msg.prompt,
                       prompt_token_ids=tuple(msg.prompt_token_ids), sampling=sampling,
                       priority=msg.priority, stream_interval=msg.stream_interval)


def _logprobs(entries) -> list[gpb.TokenLogprobs]:
    return [gpb.TokenLogprobs(logprob=lp, top_token_ids=[t for t, _ in top],
                              top_logprobs=[v for _, v in top]) for lp, top in entries]


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, admission, table, config, metrics):
        self.admission = admission
        self.table = table
        self.config = config
        self.metrics = metrics

    async def Generate(self, request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        try:
            req = await self.admission.open(spec_from_pb(request))
        except RouterError as err:
            self.metrics.rejections.labels(err.reason).inc()
            await context.abort(err.code, err.message)
        sub = self.table.subscribe(req, request.stream_interval or self.config.stream_interval)
        sent = self.metrics.client_messages
        try:
            while True:
                sub.event.clear()
                if sub.detached:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, sub.detached)
                out = req.take(sub)
                if out is not None:
                    tokens, text, offset, last = out
                    msg = gpb.GenerateResponse(request_id=req.id, output_offset=offset,
                                               token_ids=tokens, text=text)
                    if req.logprobs_k is not None:
                        msg.logprobs.extend(_logprobs(req.logprobs[offset:offset + len(tokens)]))
                    if last:
                        msg.finish_reason = req.finish_reason
                        msg.error = req.error
                        msg.timings.CopyFrom(gpb.RequestTimings(**req.timings()))
                    sent.inc()
                    yield msg
                    if last:
                        return
                await sub.event.wait()
        finally:
            self.table.unsubscribe(req, sub)

    async def Cancel(self, request, context) -> gpb.CancelResponse:
        return gpb.CancelResponse(cancelled=self.admission.cancel(request.request_id, "rpc"))
