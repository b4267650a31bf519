"""Generation servicer: validate, accept, stream deltas, re-attach, cancel."""

from __future__ import annotations

import logging

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import generation_pb2_grpc
from router.validation import RouterError

log = logging.getLogger(__name__)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core):
        self.core = core
        self.metrics = core.metrics

    async def Generate(self, request: gpb.GenerateRequest, context):
        try:
            req = await self.core.open(request)
        except RouterError as err:
            self.metrics.rejections.labels(err.reason).inc()
            await context.abort(err.code, err.message)
        interval = request.stream_interval or self.core.config.stream_interval
        sub = req.subscribe(interval)
        sent = self.metrics.client_messages
        try:
            while True:
                sub.event.clear()
                msg, last = req.take(sub)
                if msg is not None:
                    sent.inc()
                    yield msg
                if last:
                    return
                await sub.event.wait()
        finally:
            req.unsubscribe(sub)
            # The last subscriber leaving an unfinished request cancels it.
            if not req.finished and not req.subscribers:
                self.core.spawn(self.core.cancel(req.id, "disconnect"))

    async def Cancel(self, request: gpb.CancelRequest, context) -> gpb.CancelResponse:
        cancelled = await self.core.cancel(request.request_id, "rpc")
        return gpb.CancelResponse(cancelled=cancelled)
