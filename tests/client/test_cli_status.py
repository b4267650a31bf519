"""The client CLI's exit status: 0 when the request finished, 1 when its stream
ended in an error (a replica that refused it, say), which scripts rely on."""

import asyncio

from client.__main__ import _print
from common.pb.quadriga.v1 import generation_pb2 as gpb


class _Stream:
    def __init__(self, *messages):
        self.messages = messages

    async def __aiter__(self):
        for m in self.messages:
            yield m


def test_an_error_ending_exits_1_and_a_finish_0(capsys):
    text = gpb.GenerateResponse(text="a")
    failed = gpb.GenerateResponse(finish_reason=gpb.FINISH_REASON_ERROR, error="cannot fit")
    done = gpb.GenerateResponse(text="b", finish_reason=gpb.FINISH_REASON_LENGTH)
    assert asyncio.run(_print(_Stream(text, failed), timings=False)) == 1
    assert "error: cannot fit" in capsys.readouterr().err
    assert asyncio.run(_print(_Stream(text, done), timings=False)) == 0
