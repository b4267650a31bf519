"""GPU figures for tensor parallelism (dummy bf16 weights): TP=1 against TP=2 on the
Llama-3.1-8B shape, and the Llama-3.1-70B shape split over 2 GPUs (it does not fit one).

    python3 benchmarks/gpu/bench_tp.py --out results.json [--sizes 1,2] [--skip-70b] [--skip-offline]
                                       [--requests 1000] [--smoke]

Every engine runs in a child process of this script (`--child NAME`): one
tensor-parallel engine per process, and each starts on GPUs nothing else holds.
Sections, each guarded so one failure leaves the others:
  ceilings      copy bandwidth and bf16 matmul rate of one GPU (as bench_engine.py), and NCCL
                all-reduce between GPUs 0 and 1: time per all-reduce inside a CUDA graph (as the
                decode graphs run them) at a decode step's message sizes, bus bandwidth at 256 MiB
  8b_tp{N}      start-up; decode step at batch 1, 32, 256 (context 1024); prefill of 2048 tokens;
                offline: --requests requests of 1024 random tokens in, 256 out through LLM.generate
  70b_tp{N}     N >= 2 only: start-up, decode at batch 1 and 64, prefill 2048
Limits printed beside each figure, per GPU (every rank holds 1/N of the weights and KV heads):
  decode   (weights read + KV read) / copy bandwidth, plus (2 x layers + 1) all-reduces of
           batch x hidden bf16 and one all-gather of the logits at the measured in-graph time
  prefill  FLOPs / N / matmul rate, plus the all-reduces of tokens x hidden at bus bandwidth
Step times are runner.execute wall time on rank 0 (host work, the broadcast to the other ranks
and the sampled-id sync included); a graph replay alone cannot be timed on rank 0 under TP, since
its collectives wait for the other ranks' replays.
The JSON at --out holds the command and is rewritten after every section.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.bench_engine import (  # noqa: E402
    CTX,
    LLAMA31_8B,
    LLAMA31_70B,
    _fill_kv,
    cuda_time,
    wall_time,
    write_llama31_config,
)

# This script's own figures (bench_engine.py keeps its own).
RESULTS: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
OUT: Path | None = None


def save() -> None:
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=2))


# ---- ceilings (a child process: one GPU in it, two in processes it spawns) ----
AR_SIZES = (8 << 10, 16 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20)


def _all_reduce_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device(f"cuda:{rank}"))
    rows = []
    for size in AR_SIZES:
        x = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        graph, reps = torch.cuda.CUDAGraph(), 32
        with torch.cuda.graph(graph):
            for _ in range(reps):
                dist.all_reduce(x)
        dist.barrier()
        rows.append({"bytes": size, "in_graph_us": cuda_time(graph.replay, 20) / reps * 1e6})
    big = torch.ones(128 << 20, dtype=torch.bfloat16, device="cuda")  # 256 MiB
    t = cuda_time(lambda: dist.all_reduce(big), 10)
    bus = big.numel() * 2 / t * 2 * (2 - 1) / 2  # a ring all-reduce's bus bandwidth, 2 ranks
    if rank == 0:
        Path(out).write_text(json.dumps({"all_reduce": rows, "bus_bandwidth_GBps": bus / 1e9}))
    dist.destroy_process_group()


def ceilings() -> dict:
    from benchmarks.gpu.bench_engine import ceilings as one_gpu

    r = dict(one_gpu())
    r["gpus"] = torch.cuda.device_count()
    if torch.cuda.device_count() >= 2:
        from common.redis_server import free_port

        out = Path(tempfile.mkdtemp()) / "nccl.json"
        torch.multiprocessing.spawn(_all_reduce_rank, args=(free_port(), str(out)), nprocs=2)
        r["nccl_2gpu"] = json.loads(out.read_text())
    print(r, flush=True)
    return r


def _collective_us(ceil: dict, nbytes: int) -> float:
    """In-graph time of one all-reduce of nbytes on 2 GPUs: the next measured size up, or
    past the largest, the bytes at the measured bus bandwidth."""
    nccl = ceil.get("nccl_2gpu", {})
    rows = nccl.get("all_reduce") or []
    if rows and nbytes <= rows[-1]["bytes"]:
        return next(r["in_graph_us"] for r in rows if r["bytes"] >= nbytes)
    bus = nccl.get("bus_bandwidth_GBps", 0) * 1e9
    return nbytes / bus * 1e6 if bus else 0.0


# ---- the child: one engine ----
def startup(model_dir: str, tp: int, max_num_seqs: int, chunk: int):
    from replica_worker import LLM

    torch.cuda.synchronize()
    t = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=10240,
              scheduler="sarathi", chunk_size=chunk, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.9,
              tensor_parallel_size=tp)
    torch.cuda.synchronize()
    runner = llm.engine.runner
    r = {"total_s": time.perf_counter() - t, "phases_s": runner.startup_seconds, "backend": runner.backend.name,
         "fused_ops": None if runner.model.fused is None else runner.model.fused.__name__,
         "graph_buckets": runner.graphs.buckets if runner.graphs else None, "num_kv_blocks": runner.num_blocks,
         "weights_GiB_per_gpu": sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 2**30}
    print(r, flush=True)
    return llm, r


def decode(llm, batches, ceil: dict, tp: int, steps: int) -> list[dict]:
    from replica_worker.engine.model_runner import _Chunk
    from replica_worker.engine.sampling_params import SamplingParams
    from replica_worker.engine.sequence import Sequence

    runner = llm.engine.runner
    s, bs = runner.model.shape, runner.block_size
    blocks_per_seq = -(-(CTX + 1) // bs)
    _fill_kv(runner, min(runner.num_blocks, max(batches) * blocks_per_seq))
    embed = runner.model.embed_tokens.weight
    elem = embed.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters()) - embed.numel() * elem
    bw = ceil.get("copy_bandwidth_TBps", 4.3) * 1e12
    rng, rows = random.Random(0), []
    for b in batches:
        seqs = []
        for i in range(b):
            seq = Sequence(f"d{b}-{i}", [rng.randrange(128000) for _ in range(CTX + 1)], SamplingParams(temperature=0.0))
            seq.num_computed_tokens, seq.block_ids = CTX, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            seqs.append(seq)
        chunks = [_Chunk(q, 1) for q in seqs]
        step = wall_time(lambda: runner.execute(chunks), steps)
        kv_bytes = b * (CTX + 1) * s.num_layers * 2 * runner.num_kv_heads * s.head_dim * elem
        memory = (weight_bytes + kv_bytes) / bw
        comm = 0.0
        if tp > 1:  # the logits' all-gather moves half an all-reduce's bytes
            comm = ((2 * s.num_layers + 1) * _collective_us(ceil, b * s.hidden_size * 2)
                    + _collective_us(ceil, b * s.vocab_size)) / 1e6
        row = {"batch": b, "context": CTX, "step_ms": step * 1e3, "bytes_read_per_gpu_GB": (weight_bytes + kv_bytes) / 1e9,
               "bandwidth_limit_ms": memory * 1e3, "collectives_ms": comm * 1e3,
               "limit_ms": (memory + comm) * 1e3, "step_over_limit": step / (memory + comm),
               "tokens_per_s": b / step}
        print(row, flush=True)
        rows.append(row)
    return rows


def prefill(llm, n: int, ceil: dict, tp: int) -> dict:
    from replica_worker.engine.model_runner import _Chunk
    from replica_worker.engine.sampling_params import SamplingParams
    from replica_worker.engine.sequence import Sequence

    runner = llm.engine.runner
    s = runner.model.shape
    rng = random.Random(1)
    seq = Sequence(f"p{n}", [rng.randrange(128000) for _ in range(n)], SamplingParams(temperature=0.0))
    seq.block_ids = list(range(-(-n // runner.block_size)))
    chunks = [_Chunk(seq, n)]
    t = wall_time(lambda: runner.execute(chunks), 5, warmup=2)
    per_layer = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim \
        + s.num_heads * s.head_dim * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    attention = 4 * s.num_heads * s.head_dim * (n * (n + 1) // 2) * s.num_layers
    flops = 2 * n * per_layer * s.num_layers + 2 * s.vocab_size * s.hidden_size + attention
    compute = flops / tp / (ceil.get("bf16_matmul_TFLOPs", 790) * 1e12)
    comm = 0.0
    if tp > 1:
        bus = ceil.get("nccl_2gpu", {}).get("bus_bandwidth_GBps", 0) * 1e9  # measured on 2 GPUs
        comm = (2 * s.num_layers + 1) * n * s.hidden_size * 2 * 2 * (tp - 1) / tp / bus if bus else 0.0
    row = {"prompt_tokens": n, "time_ms": t * 1e3, "tokens_per_s": n / t,
           "TFLOPs_per_gpu": flops / tp / t / 1e12, "compute_limit_ms": compute * 1e3,
           "collectives_ms": comm * 1e3, "limit_ms": (compute + comm) * 1e3, "time_over_limit": t / (compute + comm)}
    print(row, flush=True)
    return row


def offline(llm, num: int, n_in: int, n_out: int) -> dict:
    from replica_worker import SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randrange(128000) for _ in range(n_in)] for _ in range(num)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    el = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    r = {"requests": num, "input_tokens": n_in, "output_tokens": n_out, "seconds": el,
         "output_tokens_per_s": produced / el, "total_tokens_per_s": (produced + num * n_in) / el}
    print(r, flush=True)
    return r


def run_child(name: str, args, ceil: dict) -> dict:
    shape, tp = name.split("_tp")
    tp = int(tp)
    tmp = Path(tempfile.mkdtemp())
    if shape == "8b":
        model = write_llama31_config(tmp / "llama31-8b-shape", LLAMA31_8B)
        batches, seats, chunk = ([1, 32] if args.smoke else [1, 32, 256]), (32 if args.smoke else 256), 8192
    else:
        model = write_llama31_config(tmp / "llama31-70b-shape", LLAMA31_70B)
        batches, seats, chunk = [1, 64], 64, 4096
    r: dict = {}
    llm, r["startup"] = startup(str(model), tp, seats, chunk)
    for key, fn in (("decode", lambda: decode(llm, batches, ceil, tp, 10 if args.smoke else 30)),
                    ("prefill_2048", lambda: prefill(llm, 2048, ceil, tp)),
                    ("offline", lambda: offline(llm, args.requests, 1024, 256))):
        if key == "offline" and (shape != "8b" or args.skip_offline or args.smoke):
            continue
        try:
            r[key] = fn()
        except Exception as exc:  # keep the other figures
            traceback.print_exc()
            r[key] = {"error": f"{type(exc).__name__}: {exc}"}
    llm.shutdown()
    return r


def child_main(args) -> None:
    if args.child == "ceilings":
        print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}", flush=True)
        Path(args.part).write_text(json.dumps(ceilings()))
        return
    ceil = json.loads(Path(args.ceilings).read_text())
    Path(args.part).write_text(json.dumps(run_child(args.child, args, ceil)))


def run_section(name: str, args, ceil_path: Path) -> None:
    """Runs section `name` in a child process of its own; its figures land in RESULTS."""
    print(f"\n=== {name} ===", flush=True)
    part = Path(tempfile.mkdtemp()) / f"{name}.json"
    command = [sys.executable, __file__, "--out", str(part), "--child", name, "--part", str(part),
               "--ceilings", str(ceil_path), "--requests", str(args.requests)]
    command += ["--smoke"] * args.smoke + ["--skip-offline"] * args.skip_offline
    t = time.perf_counter()
    done = subprocess.run(command)
    RESULTS[name] = json.loads(part.read_text()) if done.returncode == 0 and part.exists() \
        else {"error": f"child exited with status {done.returncode}"}
    print(f"--- {name}: {time.perf_counter() - t:.1f} s", flush=True)
    save()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes for the 8B shape")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="batch 1/32, no offline, no 70B")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args)
    from benchmarks.common import tree_commit

    RESULTS["commit"] = tree_commit()
    OUT = Path(args.out)
    # This process never touches a GPU: each section's engine starts on idle ones.
    ceil_path = Path(tempfile.mkdtemp()) / "ceilings.json"
    ceil_path.write_text("{}")
    run_section("ceilings", args, ceil_path)
    ceil_path.write_text(json.dumps(RESULTS["ceilings"]))
    sizes = [int(x) for x in args.sizes.split(",")]
    for tp in sizes:
        run_section(f"8b_tp{tp}", args, ceil_path)
    if not (args.skip_70b or args.smoke):
        for tp in [n for n in sizes if n >= 2]:
            run_section(f"70b_tp{tp}", args, ceil_path)
    print("\n=== summary ===")
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "command"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
