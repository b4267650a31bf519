"""Router-side protobuf of the replica protocol: a request as the Assignment a
replica runs. The rest of the router never touches these messages."""

from __future__ import annotations

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb
from router.requests.spec import Sampling

def sampling_pb(s: Sampling, max_tokens: int) -> gpb.SamplingParams:
    # The set fields, in one constructor call; max_tokens explicit, so the
    # replica and the router agree on when the request ends. logit_bias's
    # pairs become the wire's map.
    fields = {**s.set_fields, "max_tokens": max_tokens}
    if s.logit_bias:
        fields["logit_bias"] = dict(s.logit_bias)
    return gpb.SamplingParams(**fields)


def assignment(req) -> rpb.Assignment:
    a = rpb.Assignment(request_id=req.id, prompt_token_ids=req.prompt_ids,
                       sampling=sampling_pb(req.spec.sampling, req.max_tokens),
                       arrival_time=req.arrival, stream_interval=req.stream_interval)
    if req.tokens:
        a.resume_token_ids.extend(req.tokens)
        # Characters (code points) delivered; only requeued requests pay for the sum.
        a.resume_text_len = sum(map(len, req.parts))
    return a


def assign(requests) -> rpb.Assign:
    return rpb.Assign(assignments=[assignment(r) for r in requests])
