"""Served against offline, in one run: the same requests through LLM.generate and
through the router to one replica on the same GPU.

    python3 benchmarks/gpu/bench_serving.py --out serving.json [--requests 256] [--input-len 1024]
        [--output-len 256] [--modes process,thread]

The model is the Llama-3.1-8B body (dummy bf16 weights) with SmolLM2's
vocabulary and real tokenizer in its folder (--tokenizer DIR, default the
SmolLM2 folder), so both sides detokenize every token with a real BPE.
Every request arrives at once: N prompts of random token ids, greedy,
ignore_eos, output-len tokens each.

- offline: LLM.generate in a process of its own; output tokens over its wall time;
- served (one per mode): `python -m stack` with one replica, the engine in a
  process of its own (process) or on a thread of the worker's (thread); N
  concurrent gRPC streams, every step streamed (stream interval 1); output
  tokens over the time from the first request sent to the last token
  received, and each stream's gaps between messages.

Each side also says when its first token came and how many engine steps it
took, with their summed time (the replica's step-seconds metric): the gap
between served and offline splits into admission (the first token later),
slower steps, and time between steps.

The sides run one after another, each with the GPU to itself. The JSON
(--out, rewritten after each side) holds every figure and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import percentile  # noqa: E402
from benchmarks.gpu.bench_engine import LLAMA31_8B, write_llama31_config  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


SMOKE_BODY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8)


def model_folder(tokenizer_dir: Path, body: dict) -> Path:
    """The body with the tokenizer's vocabulary (rounded up as checkpoints do)."""
    folder = Path(tempfile.mkdtemp(prefix="serving-model-"))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    write_llama31_config(folder, body)
    cfg = json.loads((folder / "config.json").read_text())
    # The tokenizer's own vocabulary and special tokens, not Llama 3's.
    cfg.update(vocab_size=-(-len(tokenizer) // 64) * 64, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.requests)]


def engine_args(device: str) -> dict:
    return dict(max_num_seqs=256, chunk_size=8192, dtype="bfloat16" if device == "cuda" else "float32",
                load_format="dummy")


def run_offline(args, folder: Path) -> dict:
    from replica_worker import LLM, SamplingParams

    llm = LLM(str(folder), device=args.device, **engine_args(args.device))
    batch = prompts(args, llm.engine.vocab_size)
    llm.generate(batch[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    steps = StepClock(llm.engine)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(o.outputs[0].text for o in outs), "the offline engine did not detokenize"
    return {"seconds": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed,
            "first_token_s": steps.first_token - start, "engine": steps.figures()}


class StepClock:
    """Counts an engine's steps and sums their time (as the replica's
    step-seconds metric does), and notes when its first token came."""

    def __init__(self, engine):
        self.count, self.seconds, self.first_token = 0, 0.0, None
        step = engine.step

        def timed():
            result = step()
            self.count += 1
            self.seconds += result.step_time
            if self.first_token is None and any(d.new_token_ids for d in result.deltas):
                self.first_token = time.perf_counter()
            return result

        engine.step = timed

    def figures(self) -> dict:
        return {"steps": self.count, "step_seconds": self.seconds}


STEP_METRICS = ("quadriga_replica_step_seconds_sum", "quadriga_replica_step_seconds_count")


def replica_steps(url: str) -> dict:
    from benchmarks.harness.prefix_stats import scrape

    got = scrape(url, STEP_METRICS)
    return {"steps": int(got[STEP_METRICS[1]]), "step_seconds": got[STEP_METRICS[0]]}


async def _stream(stub, prompt, args):
    from common.pb.quadriga.v1 import generation_pb2 as gpb

    req = gpb.GenerateRequest(prompt_token_ids=prompt, sampling=gpb.SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True))
    times, tokens, text = [], 0, 0
    async for msg in stub.Generate(req, timeout=600):
        times.append(time.perf_counter())
        tokens += len(msg.token_ids)
        text += len(msg.text)
    return times, tokens, text


async def _load(address: str, batch, args, replica_metrics: str):
    import grpc

    from common.pb.quadriga.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await _stream(stub, batch[0][:64], argparse.Namespace(output_len=8))  # warm-up
        before = await asyncio.to_thread(replica_steps, replica_metrics)
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(stub, p, args) for p in batch))
        return start, results, before


def run_served(args, folder: Path, mode: str) -> dict:
    from benchmarks.harness.stack import Stack

    replica_args = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args(args.device).items()]
    name = mode.replace("@", "-t")
    mode, _, threads = mode.partition("@")
    if mode == "thread":
        replica_args.append("--engine-thread")
    if threads:
        replica_args.append(f"--threads={int(threads)}")
    with Stack(replicas=1, model=str(folder), device=args.device, replica_args=replica_args,
               log_dir=str(Path(args.log_dir) / f"served-{name}")) as stack:
        from transformers import AutoConfig

        batch = prompts(args, AutoConfig.from_pretrained(str(folder)).vocab_size)
        # The warm-up's steps are in `before`: the load's are the difference.
        start, results, before = asyncio.run(_load(stack.address, batch, args,
                                                   stack.replica_metrics_urls[0]))
        after = replica_steps(stack.replica_metrics_urls[0])
    end = max(t[-1] for t, _, _ in results)
    produced = sum(n for _, n, _ in results)
    assert all(text for _, _, text in results), "the served replica did not detokenize"
    gaps = [b - a for t, _, _ in results for a, b in zip(t, t[1:])]
    firsts = [t[0] - start for t, _, _ in results]
    return {"seconds": end - start, "output_tokens": produced, "output_tok_s": produced / (end - start),
            "ttft_p50_s": percentile(firsts, 50), "gap_p50_ms": 1e3 * percentile(gaps, 50),
            "gap_p99_ms": 1e3 * percentile(gaps, 99), "messages": sum(len(t) for t, _, _ in results),
            "first_token_s": min(firsts),
            "engine": {k: after[k] - before[k] for k in after}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="process,thread",
                    help="served modes, in order: process or thread, each with @N for N torch threads "
                         "in the replica (process@1), else torch's default")
    ap.add_argument("--tokenizer", default=str(ROOT / ".cache" / "models" / "smollm2"))
    ap.add_argument("--log-dir", default=tempfile.mkdtemp(prefix="serving-logs-"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer body: checks the script, measures nothing")
    ap.add_argument("--side", help=argparse.SUPPRESS)   # one side, in a child process
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        folder = Path(args.model_dir)
        r = run_offline(args, folder) if args.side == "offline" else run_served(args, folder, args.side)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    folder = model_folder(Path(args.tokenizer), SMOKE_BODY if args.smoke else LLAMA31_8B)
    from benchmarks.common import tree_commit

    out = {"command": " ".join(["python3", "benchmarks/gpu/bench_serving.py", *sys.argv[1:]]),
           "commit": tree_commit(),
           "workload": {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
                        "greedy": True, "ignore_eos": True, "stream_interval": 1},
           "model": ("a 2-layer smoke body" if args.smoke else "Llama-3.1-8B body") +
                    ", dummy weights, SmolLM2's vocabulary and tokenizer",
           "device": args.device, "engine": engine_args(args.device), "sides": {}}
    modes = args.modes.split(",")
    # A mode may run more than once (an A/B/A): each side is keyed by its mode and its place.
    keys = ["offline", *(f"{m}#{i}" if modes.count(m) > 1 else m for i, m in enumerate(modes, 1))]
    for key, side in zip(keys, ["offline", *modes]):
        cmd = [sys.executable, __file__, "--side", side, "--model-dir", str(folder), "--out", args.out,
               "--requests", str(args.requests), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--seed", str(args.seed), "--log-dir", args.log_dir,
               "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            out["sides"][key] = {"error": f"exit {proc.returncode}", "tail": proc.stderr[-2000:]}
        else:
            out["sides"][key] = json.loads(line[len("RESULT "):])
            if side != "offline" and "output_tok_s" in out["sides"].get("offline", {}):
                out["sides"][key]["served_over_offline"] = (
                    out["sides"][key]["output_tok_s"] / out["sides"]["offline"]["output_tok_s"])
        print(key, json.dumps(out["sides"][key])[:600], flush=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
