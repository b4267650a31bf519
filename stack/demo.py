"""The local stack's demo: a few questions to the served model, answers printed as they stream.

run_demo holds the questions and the printing; how a question reaches the
router is the asker's business: the openai SDK against the router's OpenAI
API (the main job), or gRPC Generate with the chat template applied here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "What is 2 + 2?",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about the sea.",
)
MAX_TOKENS = 64


@dataclass(frozen=True)
class AnswerEnd:
    """What an asker yields after an answer's last piece of text."""

    finish_reason: str
    output_tokens: int
    ttft_s: float
    replica_id: str


Asker = Callable[[str], Iterator["str | AnswerEnd"]]


def run_demo(ask: Asker) -> bool:
    """Asks each demo question; True when every answer ended without an error."""
    ok = True
    for question in DEMO_QUESTIONS:
        print(f"\n> {question}\n", end="", flush=True)
        for piece in ask(question):
            if isinstance(piece, AnswerEnd):
                print(f"\n  [{piece.finish_reason}; {piece.output_tokens} tokens; "
                      f"TTFT {piece.ttft_s * 1000:.0f} ms; {piece.replica_id}]")
                ok &= piece.finish_reason != "error"
            else:
                print(piece, end="", flush=True)
    return ok


def chat_prompt(tokenizer, question: str) -> str:
    """The question as one user turn of the model's chat template; a model
    without a template (the tiny random ones) gets the question as it is."""
    if not getattr(tokenizer, "chat_template", None):
        return question
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def grpc_asker(address: str, model: str) -> Asker:
    """Asks through the router's gRPC Generate, greedy."""
    from client.api import FINISH_NAMES, make_request, sync_stub
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    stub = sync_stub(address)

    def ask(question: str) -> Iterator[str | AnswerEnd]:
        request = make_request(chat_prompt(tokenizer, question), max_tokens=MAX_TOKENS, temperature=0.0)
        for msg in stub.Generate(request, timeout=120):
            if msg.text:
                yield msg.text
            if msg.HasField("finish_reason"):
                t = msg.timings
                yield AnswerEnd(FINISH_NAMES.get(msg.finish_reason, "error"), t.output_tokens,
                                t.time_to_first_token_s, t.replica_id)

    return ask


def openai_asker(base_url: str, model_name: str) -> Asker:
    """Asks through the router's OpenAI API with the openai SDK, greedy, streaming."""
    import time

    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=os.environ.get("QUADRIGA_API_KEY") or "none")

    def ask(question: str) -> Iterator[str | AnswerEnd]:
        start, first, tokens, finish = time.monotonic(), None, 0, "error"
        stream = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.monotonic()
                    yield choice.delta.content
                finish = choice.finish_reason or finish
        yield AnswerEnd(finish, tokens, (first or time.monotonic()) - start, "via OpenAI API")

    return ask
