"""Offline CPU: a sliding-window model's long generations in a small KV cache, this
tree beside another (one from before windowed sequences gave back their
out-of-window blocks), in one run.

    python -m benchmarks.engine.window_release --compare before=TREE [--repeats 3]

A tiny random-weight Mistral (window W) generates N requests of P prompt and O
output tokens, all arriving at once, in a cache of B blocks: too few for the
requests' whole contexts side by side, enough for their windows. Each side runs
in a process of its own with its tree first on the path, alternating, --repeats
times; each reports its wall time, output tokens a second and preemptions, and
both must produce the same tokens. Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, save_result, tree_commit

# Runs in the side's own process, its tree first on the path.
SIDE = r"""
import hashlib, json, sys, time
import torch
from replica_worker import LLM, SamplingParams
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
llm = LLM(a["model"], num_blocks=a["blocks"], block_size=a["block_size"], chunk_size=a["chunk_size"],
          max_num_seqs=a["requests"])
prompts = [[(i * 37 + k * 11) % 500 + 3 for i in range(a["prompt_len"])] for k in range(a["requests"])]
params = SamplingParams(temperature=0.0, max_tokens=a["output_len"], ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
start = time.perf_counter()
outs = llm.generate(prompts, params)
elapsed = time.perf_counter() - start
tokens = [o.outputs[0].token_ids for o in outs]
print(json.dumps({
    "elapsed_s": elapsed,
    "output_tok_s": sum(map(len, tokens)) / elapsed,
    "preemptions": sum(o.outputs[0].metrics.num_preemptions for o in outs),
    "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
}))
"""


def run_side(tree: Path, args: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args["threads"])}
    proc = subprocess.run([sys.executable, "-c", SIDE, json.dumps(args)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"side {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", required=True, metavar="NAME=TREE", help="the other side: a tree (git archive copy)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=448)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=256, help="KV blocks of the cache (the same on both sides)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="engine_window_release_cpu")
    a = p.parse_args(argv)
    from common.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.gettempdir()) / f"quadriga-window{a.window}-mistral", arch="mistral",
                             sliding_window=a.window)
    name, _, tree = a.compare.partition("=")
    sides = {"this": ROOT, name: Path(tree).resolve()}
    side_args = {"model": str(model), "blocks": a.blocks, "block_size": a.block_size, "chunk_size": a.chunk_size,
                 "requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
                 "threads": a.threads}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(a.repeats):
        for side, path in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            row = run_side(path, side_args)
            runs[side].append(row)
            print(f"{side:<8} {row['elapsed_s']:7.2f} s  {row['output_tok_s']:8.1f} output tok/s  "
                  f"preemptions {row['preemptions']}", flush=True)
    digests = {row["tokens_sha256"] for rows in runs.values() for row in rows}
    assert len(digests) == 1, "the sides generated different tokens"
    context = a.prompt_len + a.output_len
    save_result(a.name, {
        "what": __doc__.strip().splitlines()[0],
        "model": f"tiny random Mistral (common/tiny_model.py), sliding window {a.window}, float32, CPU",
        "workload": {**{k: v for k, v in side_args.items() if k != "model"}, "window": a.window,
                     "blocks_for_every_context_whole": a.requests * -(-context // a.block_size)},
        "commits": {side: tree_commit(path) for side, path in sides.items()},
        "runs": runs,
        "same_tokens": True,
    })


if __name__ == "__main__":
    main()
