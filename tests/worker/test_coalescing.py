"""Streaming coalescing at the replica: the Assignment's stream_interval."""

import asyncio

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as pb
from replica_worker.worker.coalescing import DeltaCoalescer
from tests.worker.fakes import FakeEngine, Wired, assignment, make_worker
from tests.worker.test_worker import assign, deltas_of, run


def delta(rid, offset, tokens, **kw):
    return pb.RequestDelta(request_id=rid, output_offset=offset, token_ids=tokens,
                           text="".join(f"<{t}>" for t in tokens), **kw)


def test_first_goes_at_once_then_interval_tokens_at_a_time():
    c = DeltaCoalescer()
    c.assigned("a", 3)
    sent = [c.offer(delta("a", i, [i])) for i in range(8)]
    out = [d for d in sent if d is not None]
    assert [list(d.token_ids) for d in out] == [[0], [1, 2, 3], [4, 5, 6]]
    assert [d.output_offset for d in out] == [0, 1, 4]
    assert out[1].text == "<1><2><3>"
    # The finish goes at once with what is held.
    last = c.offer(delta("a", 8, [8], finish_reason=gpb.FINISH_REASON_LENGTH))
    assert (list(last.token_ids), last.output_offset, last.finish_reason) == ([7, 8], 7, gpb.FINISH_REASON_LENGTH)
    # Finished: forgotten, so a later delta of the same id would pass through.
    assert c.offer(delta("a", 9, [9])) is not None


def test_merge_keeps_logprobs_errors_and_the_first_scheduled_stamp():
    c = DeltaCoalescer()
    c.assigned("a", 4)
    assert c.offer(delta("a", 0, [5], first_scheduled_at=12.5, cached_tokens=16)) is not None
    lp = [gpb.TokenLogprobs(logprob=-0.5, top_token_ids=[6], top_logprobs=[-0.5])]
    assert c.offer(delta("a", 1, [6], logprobs=lp, preemptions=1)) is None
    out = c.offer(pb.RequestDelta(request_id="a", output_offset=2, error="engine failed",
                                  finish_reason=gpb.FINISH_REASON_ERROR, preemptions=2))
    assert list(out.token_ids) == [6] and out.output_offset == 1
    assert [e.logprob for e in out.logprobs] == [-0.5]
    assert out.error == "engine failed" and out.preemptions == 2


def test_interval_one_or_unset_passes_every_delta():
    c = DeltaCoalescer()
    c.assigned("a", 1)
    c.assigned("b", 0)
    assert c.offer(delta("a", 0, [1])) is not None and c.offer(delta("a", 1, [2])) is not None
    assert c.offer(delta("b", 0, [1])) is not None and c.offer(delta("b", 1, [2])) is not None
    assert c.offer(delta("never-assigned", 0, [1])) is not None


def test_release_and_retain():
    c = DeltaCoalescer()
    c.assigned("a", 8)
    c.assigned("b", 8)
    for rid in "ab":
        c.offer(delta(rid, 0, [1]))
        assert c.offer(delta(rid, 1, [2])) is None
    assert [list(d.token_ids) for d in c.release(["a"])] == [[2]]
    c.retain(live={})   # "b" was cancelled: its held tokens are dropped
    assert c.release(["a", "b"]) == []


def test_worker_sends_coalesced_deltas_with_contiguous_offsets():
    async def main():
        engine = FakeEngine(seats=4, length=11)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            a = assignment("a", max_tokens=11)
            a.stream_interval = 4
            assign(worker, a, assignment("b", max_tokens=11))
            got = {"a": [], "b": []}
            while not all(ds and ds[-1].HasField("finish_reason") for ds in got.values()):
                for d in deltas_of([await w.next("step")]):
                    got[d.request_id].append(d)
            sizes = {rid: [len(d.token_ids) for d in ds] for rid, ds in got.items()}
            assert sizes == {"a": [1, 4, 4, 2], "b": [1] * 11}
            offsets = [d.output_offset for d in got["a"]]
            assert offsets == [0, 1, 5, 9]
            assert not worker.book.live
    run(main())


def test_hand_back_sends_the_held_tokens_first():
    """Tokens the client has not yet been sent are sent before the request goes
    back, so the router resumes after them instead of recomputing them."""
    async def main():
        engine = FakeEngine(seats=4, length=10**9)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            engine.hold = True
            a = assignment("a", max_tokens=100)
            a.stream_interval = 10**6   # nothing after the first token goes until it ends
            assign(worker, a)
            await asyncio.sleep(0.1)
            engine.hold = False
            worker.engine_loop.request_report()
            first = [d for d in deltas_of([await w.next("step")]) if d.request_id == "a"]
            assert [len(d.token_ids) for d in first] == [1]
            await asyncio.sleep(0.05)
            engine.hold = True   # some tokens are now held
            await w.settle()
            made = engine.reqs["a"]
            assert made > 1
            engine.fail_steps = 1
            engine.hold = False
            worker.engine_loop.request_report()
            msgs = []
            while not any(m.WhichOneof("kind") == "hand_back" for m in msgs):
                msgs.append(await w.next())
            sent = [d for d in deltas_of(msgs) if d.request_id == "a"]
            assert len(sent) == 1 and sent[0].output_offset == 1
            assert len(sent[0].token_ids) == made - 1
            kinds = [m.WhichOneof("kind") for m in msgs if m is not None]
            assert kinds.index("step") < kinds.index("hand_back")
    run(main())
