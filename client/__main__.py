"""python -m client "prompt" [--max-tokens N --temperature T ...]: streams the text to stdout.

python -m client --chat "question": asks the model a question through the
router's OpenAI API, with its chat template, and streams the answer.

--router takes several comma-separated addresses: when a router goes away
mid-stream the client re-attaches at the next one by request_id, and the
output goes on where it stopped."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import grpc

from client.api import FINISH_NAMES, FailoverStream, make_request, metadata, parse_routers
from common.pb.quadriga.v1 import generation_pb2 as gpb


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m client", description="Send a prompt to a Quadriga router")
    p.add_argument("prompt", nargs="?", help="a raw prompt, sent over gRPC")
    p.add_argument("--chat", metavar="QUESTION", help="ask through the OpenAI API instead")
    p.add_argument("--http", default=os.environ.get("QUADRIGA_OPENAI_URL", "http://127.0.0.1:8000/v1"),
                   help="the router's OpenAI API, for --chat")
    p.add_argument("--router", help="HOST:PORT, or several comma-separated (another is tried when "
                                    "one fails); env QUADRIGA_ROUTER_ADDRESS, default 127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--request-id", default="")
    p.add_argument("--priority", type=int, default=0, help="higher is served first")
    p.add_argument("--tls-ca-file", default=os.environ.get("QUADRIGA_TLS_CA_FILE", ""))
    p.add_argument("--timings", action="store_true", help="print the request's timings at the end (gRPC)")
    p.epilog = "The API key, if the router wants one, comes from QUADRIGA_API_KEY (never a flag)."
    a = p.parse_args(argv)
    if a.chat is not None and (a.router is not None or a.timings):
        p.error("--router and --timings are for a prompt sent over gRPC; --chat goes to --http")
    if a.router is None:
        a.router = os.environ.get("QUADRIGA_ROUTER_ADDRESS", "127.0.0.1:50051")
    return a


def chat(a) -> int:
    import openai

    http_client = None
    if a.tls_ca_file:
        import httpx

        http_client = httpx.Client(verify=a.tls_ca_file)
    client = openai.OpenAI(base_url=a.http, api_key=os.environ.get("QUADRIGA_API_KEY") or "none",
                           http_client=http_client)
    # The OpenAI API's own fields, then the server's extensions; its priority is
    # lower-first (vLLM's), this flag's higher-first (the gRPC API's).
    extra = {"top_k": a.top_k, "ignore_eos": a.ignore_eos or None, "priority": -a.priority or None}
    try:
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": a.chat}], stream=True,
            max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
            stop=a.stop, extra_body={k: v for k, v in extra.items() if v is not None},
            extra_headers={"X-Request-Id": a.request_id} if a.request_id else None)
        for chunk in stream:
            for choice in chunk.choices:
                sys.stdout.write(choice.delta.content or "")
                sys.stdout.flush()
                if choice.finish_reason:
                    print(f"\n[{choice.finish_reason}]", file=sys.stderr)
    except openai.APIError as exc:
        print(f"\n{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.chat is not None:
        return chat(a)
    if a.prompt is None:
        print("give a prompt, or --chat QUESTION", file=sys.stderr)
        return 2
    try:
        routers = parse_routers(a.router)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    request = make_request(
        a.prompt, request_id=a.request_id, max_tokens=a.max_tokens, temperature=a.temperature,
        top_p=a.top_p, top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos, stop=a.stop,
        priority=a.priority,
    )
    # The API key comes from the environment only, so it never shows in `ps`.
    md = metadata(os.environ.get("QUADRIGA_API_KEY", ""))
    stream = FailoverStream(routers, request, ca_file=a.tls_ca_file, metadata=md)
    try:
        return asyncio.run(_print(stream, a.timings))
    except (grpc.aio.AioRpcError, RuntimeError) as exc:
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else exc
        print(f"\n{detail}", file=sys.stderr)
        return 1


async def _print(stream: FailoverStream, timings: bool) -> int:
    """0 when the request finished, 1 when it ended in an error."""
    status = 0
    async for msg in stream:
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        if msg.HasField("finish_reason"):
            print(f"\n[{FINISH_NAMES.get(msg.finish_reason, '?')}]", file=sys.stderr)
            if msg.error or msg.finish_reason == gpb.FINISH_REASON_ERROR:
                print(f"error: {msg.error}", file=sys.stderr)
                status = 1
            if timings:
                print(msg.timings, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
