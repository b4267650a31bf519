"""GPU figures for the replica engine on a Llama-3.1-8B-shaped model (dummy bf16 weights).

    python3 benchmarks/gpu/bench_engine.py --out results.json [--smoke] [--skip-hf] [--skip-offline]

Measures, in one process, each section guarded so one failure leaves the others:
  ceilings   device-to-device copy bandwidth and bf16 matmul rate, measured here
  startup    LLM(...) to ready: weights, KV sizing (profiling forward) + allocation, graph capture
  decode     step time at batch 1..256, context 1024, beside its bandwidth limit
             ((weights + KV read) / copy bandwidth); wall time of runner.execute (host work and
             the sampled-id sync included) and device time of the graph replay alone
  prefill    one prompt of 512/2048/8192 tokens in one chunk: tokens/s and the share of
             the measured matmul rate its FLOPs reach
  offline    1000 requests of 1024 random tokens in, 256 out (ignore_eos) through LLM.generate,
             greedy and sampled with a seed per request, at each --offline-threads count:
             output tokens/s (no tokenizer in the folder: no detokenization, so labelled)
  hf         transformers' generate on the same 1000-request job, timed whole at each batch
             size; the engine's greedy rate over its best is printed
  *_fp8      with --fp8: startup, decode, prefill and offline again with fp8 weights
             (quantization="fp8"); decode's limit then counts the fp8 weight bytes
  decode_unfused  when fused kernels ran (QUADRIGA_FUSED_OPS, default Triton): batch 1 and 32
             decode again with them off (QUADRIGA_FUSED_OPS=0), an A/B in the same process
Prints as it goes; the JSON at --out is rewritten after every section.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import tree_commit  # noqa: E402
from replica_worker import LLM, SamplingParams  # noqa: E402
from replica_worker.engine.model_runner import _Chunk  # noqa: E402
from replica_worker.engine.sequence import Sequence  # noqa: E402

CTX = 1024
RESULTS: dict = {"command": " ".join(
    [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("QUADRIGA_")]
    + [os.path.basename(sys.executable)] + sys.argv),
    "commit": tree_commit()}
OUT: Path | None = None


def save() -> None:
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=2))


def section(name):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n=== {name} ===", flush=True)
            t = time.perf_counter()
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception as exc:  # keep the other figures
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"--- {name}: {time.perf_counter() - t:.1f} s", flush=True)
            save()
            return RESULTS[name]
        return run
    return wrap


LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
LLAMA31_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def write_llama31_config(path: Path, shape: dict) -> Path:
    """A Llama-3.1 config.json (vocabulary, rope scaling, 8 kv heads) of the given shape."""
    import transformers

    transformers.LlamaConfig(
        vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], rms_norm_eps=1e-5, torch_dtype="bfloat16",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        **shape,
    ).save_pretrained(str(path))
    return path


def write_llama31_8b_config(path: Path) -> Path:
    return write_llama31_config(path, LLAMA31_8B)


def cuda_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def wall_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() on the host clock (fn must end with a sync)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def require_flashinfer() -> None:
    """These figures are of the engine's CUDA path, flashinfer. Without it (the carry's
    modules off PYTHONPATH, say) the engine falls back to plain torch attention with
    no CUDA graphs: another engine, so stop before spending device time on it.
    QUADRIGA_ATTENTION_BACKEND=torch measures that fallback on purpose."""
    if os.environ.get("QUADRIGA_ATTENTION_BACKEND", "").strip().lower() == "torch":
        return
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:
        sys.exit(f"flashinfer is not importable ({exc}); source benchmarks/gpu/device-env.sh "
                 "with the carry, and add to PYTHONPATH rather than set it")


@section("ceilings")
def ceilings():
    n = 1 << 30  # 2 GiB of bf16 each way, far past the L2
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), 20)
    copy_bw = 2 * x.numel() * 2 / t
    del x, y
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t = cuda_time(lambda: a @ b, 20)
    mm = 2 * m**3 / t
    del a, b
    torch.cuda.empty_cache()
    r = {"copy_bandwidth_TBps": copy_bw / 1e12, "bf16_matmul_TFLOPs": mm / 1e12,
         "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(r)
    return r


def startup(model_dir: str, max_num_seqs: int, chunk: int, holder: dict, quantization: str | None = None):
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=10240,
              scheduler="sarathi", chunk_size=chunk, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.9,
              quantization=quantization)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    runner = llm.engine.runner
    holder["llm"] = llm
    r = {
        "total_s": total,
        "phases_s": runner.startup_seconds,
        "backend": runner.backend.name,
        "prefill_kernels": getattr(runner.backend, "prefill_kernels", None),
        "graph_buckets": runner.graphs.buckets if runner.graphs else None,
        "num_kv_blocks": runner.num_blocks,
        "kv_cache_GiB": runner.num_blocks * runner.bytes_per_block / 2**30,
        "weights_GiB": runner.model.weight_nbytes() / 2**30,
        "quantization": quantization,
        "note": "dummy weights are generated on the GPU; a real checkpoint adds its read time",
    }
    print(r)
    return r


def _top_kernels(prof, n=15):
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:n]:
        rows.append({"name": e.key[:120], "count": e.count, "device_ms_total": e.device_time_total / 1e3})
    return rows


def _fill_kv(runner, num_blocks: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in runner.kv_cache.layers:
        layer[:num_blocks].normal_(generator=g)


def decode(holder: dict, batches, ceil: dict, steps: int, profile: bool):
    runner = holder["llm"].engine.runner
    s = runner.model.shape
    bs = runner.block_size
    blocks_per_seq = -(-(CTX + 1) // bs)
    _fill_kv(runner, min(runner.num_blocks, max(batches) * blocks_per_seq))
    weight_bytes = runner.model.weight_nbytes()
    embed = runner.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    bw = ceil.get("copy_bandwidth_TBps", 4.3) * 1e12
    rng = random.Random(0)
    out = []
    for b in batches:
        seqs = []
        for i in range(b):
            seq = Sequence(f"d{b}-{i}", [rng.randrange(128000) for _ in range(CTX + 1)], SamplingParams(temperature=0.0))
            seq.num_computed_tokens = CTX
            seq.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            seqs.append(seq)
        chunks = [_Chunk(q, 1) for q in seqs]
        step = wall_time(lambda: runner.execute(chunks), steps)
        replay = None
        if runner.graphs is not None and b <= runner.graphs.max_batch:
            g = runner.graphs.graphs[runner.graphs.bucket_for(b)]
            runner.execute(chunks)  # leaves the graph planned for this batch
            replay = cuda_time(g.graph.replay, steps)
        # Bytes a step must read: every weight but the embedding table (b rows of it), and the KV.
        kv_bytes = b * (CTX + 1) * s.num_layers * 2 * s.num_kv_heads * s.head_dim * 2
        need = weight_bytes - embed_bytes + b * s.hidden_size * 2 + kv_bytes
        limit = need / bw
        row = {"batch": b, "context": CTX, "step_ms": step * 1e3,
               "graph_replay_ms": None if replay is None else replay * 1e3,
               "bytes_read_GB": need / 1e9, "bandwidth_limit_ms": limit * 1e3,
               "step_over_limit": step / limit, "tokens_per_s": b / step}
        print(row, flush=True)
        out.append(row)
        save()
    r = {"rows": out}
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprof

        seq = Sequence("p", [1] * (CTX + 1), SamplingParams(temperature=0.0))
        seq.num_computed_tokens, seq.block_ids = CTX, list(range(blocks_per_seq))
        chunks = [_Chunk(seq, 1)]
        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner.execute(chunks)
        r["profile_batch1_10_steps"] = _top_kernels(prof)
        for row in r["profile_batch1_10_steps"]:
            print(row)
    return r


def prefill(holder: dict, lengths, ceil: dict, profile: bool):
    runner = holder["llm"].engine.runner
    s = runner.model.shape
    bs = runner.block_size
    mm = ceil.get("bf16_matmul_TFLOPs", 790) * 1e12
    per_layer = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim \
        + s.num_heads * s.head_dim * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    rng = random.Random(1)
    out = []
    prof_rows = None
    for n in lengths:
        seq = Sequence(f"p{n}", [rng.randrange(128000) for _ in range(n)], SamplingParams(temperature=0.0))
        seq.block_ids = list(range(-(-n // bs)))
        chunks = [_Chunk(seq, n)]
        start = time.perf_counter()
        runner.execute(chunks)  # the first prefill of this length in the process
        first = time.perf_counter() - start
        t = wall_time(lambda: runner.execute(chunks), 5, warmup=1)
        flops = 2 * n * per_layer * s.num_layers + 2 * s.vocab_size * s.hidden_size \
            + 4 * s.num_heads * s.head_dim * (n * (n + 1) // 2) * s.num_layers
        row = {"prompt_tokens": n, "time_ms": t * 1e3, "first_call_ms": first * 1e3, "tokens_per_s": n / t,
               "TFLOPs": flops / t / 1e12, "share_of_matmul_rate": flops / t / mm,
               "attention_flop_share": 4 * s.num_heads * s.head_dim * (n * (n + 1) // 2) * s.num_layers / flops}
        print(row, flush=True)
        out.append(row)
        save()
        if profile and n == 2048:
            from torch.profiler import ProfilerActivity, profile as tprof

            with tprof(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    runner.execute(chunks)
            prof_rows = _top_kernels(prof)
            for r in prof_rows:
                print(r)
    return {"rows": out, "profile_2048_3_runs": prof_rows,
            "flops_counted": "2*tokens*linear params + lm_head for the sampled row + causal attention 4*H*D*n(n+1)/2 per layer"}


def _offline_job(llm, prompts, params_of, n_out: int) -> dict:
    replays0 = llm.engine.runner.graphs.replays if llm.engine.runner.graphs else 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, [params_of(i) for i in range(len(prompts))])
    el = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": el, "output_tokens_per_s": produced / el,
            "total_tokens_per_s": (produced + sum(map(len, prompts))) / el,
            "graph_replays": (llm.engine.runner.graphs.replays - replays0) if llm.engine.runner.graphs else 0,
            "all_full_length": produced == len(prompts) * n_out}


def job_prompts(num: int, n_in: int) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(128000) for _ in range(n_in)] for _ in range(num)]


GREEDY = dict(temperature=0.0)
# Sampled as a chat client samples, each request with its own seed.
SEEDED = dict(temperature=0.8, top_p=0.95, top_k=50)


def offline(holder: dict, num: int, n_in: int, n_out: int, threads: list[int]):
    """The same job, greedy and sampled with a seed per request, at each torch
    thread count in `threads` (0: torch's default here), sides interleaved."""
    llm = holder["llm"]
    prompts = job_prompts(num, n_in)
    default_threads = torch.get_num_threads()
    runs = []
    for n in threads:
        torch.set_num_threads(n or default_threads)
        for mode, knobs in (("greedy", GREEDY), ("seeded", SEEDED)):
            seeded = mode == "seeded"

            def params_of(i, knobs=knobs, seeded=seeded):
                return SamplingParams(max_tokens=n_out, ignore_eos=True, seed=i if seeded else None, **knobs)

            r = {"mode": mode, "torch_threads": torch.get_num_threads(), **_offline_job(llm, prompts, params_of, n_out)}
            print(r, flush=True)
            runs.append(r)
            save()
    torch.set_num_threads(default_threads)
    by = {(r["mode"], r["torch_threads"]): r["output_tokens_per_s"] for r in runs}
    ratios = {f"seeded/greedy@{t}": by[("seeded", t)] / by[("greedy", t)]
              for (m, t) in by if m == "greedy" and ("seeded", t) in by}
    return {"requests": num, "input_tokens": n_in, "output_tokens": n_out, "runs": runs,
            "seeded_over_greedy": ratios, "sampled": SEEDED, "detokenized": False,
            "engine": "sarathi, chunk_size/max_num_seqs as in startup",
            "note": "no tokenizer in the model folder: no detokenization (bench_serving.py measures "
                    "offline with SmolLM2's tokenizer)"}


def smaller_batch_after_oom(exc: BaseException, batch: int, seen: set[int]) -> int | None:
    """After transformers ran out of memory at `batch`, the next batch to try: three
    quarters of it in multiples of 32 (a smaller card still gets an anchor: on an 80 GB
    H100 the 8B shape's 256 does not fit), None for another error, or once at 32 or tried."""
    if not isinstance(exc, torch.OutOfMemoryError):
        return None
    smaller = batch * 3 // 4 // 32 * 32
    return smaller if smaller >= 32 and smaller not in seen else None


@section("hf")
def hf_baseline(model_dir: str, batches, num: int, n_in: int, n_out: int):
    """transformers' generate on the whole job: the same prompts in waves of
    `batch`, each generating exactly n_out tokens (EOS does not stop it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    t = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    print(f"hf model built in {time.perf_counter() - t:.1f} s", flush=True)
    prompts = torch.tensor(job_prompts(num, n_in), device="cuda")
    rows = []

    def gen(ids, k):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                 min_new_tokens=k, do_sample=False, pad_token_id=0)
        return out.shape[1] - ids.shape[1]

    queue, tried = list(batches), set()
    while queue:
        b = queue.pop(0)
        tried.add(b)
        try:
            gen(prompts[:b], 2)  # warm-up at this batch's shapes
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            produced = sum(gen(prompts[i:i + b], n_out) * len(prompts[i:i + b]) for i in range(0, num, b))
            torch.cuda.synchronize()
            el = time.perf_counter() - t0
            row = {"batch": b, "waves": -(-num // b), "seconds": el, "output_tokens": produced,
                   "output_tokens_per_s": produced / el}
            print(row, flush=True)
            rows.append(row)
        except Exception as exc:
            traceback.print_exc()
            rows.append({"batch": b, "error": f"{type(exc).__name__}: {exc}"})
            smaller = smaller_batch_after_oom(exc, b, tried | set(queue))
            if smaller:
                queue.insert(0, smaller)
        torch.cuda.empty_cache()
        save()
    ok = [r for r in rows if "output_tokens_per_s" in r]
    best = max(ok, key=lambda r: r["output_tokens_per_s"]) if ok else None
    return {"rows": rows, "best": best,
            "method": f"generate(max_new_tokens=min_new_tokens={n_out}, greedy, sdpa, DynamicCache) over all "
                      f"{num} prompts in waves of `batch`, timed whole after one warm-up call per batch size"}


def measure_engine(holder: dict, ceil: dict, args, suffix: str) -> None:
    """decode, prefill and offline (sections named with suffix) of the engine in
    holder, if it started; then frees it."""
    if "llm" in holder:
        section("decode" + suffix)(decode)(holder, [1, 8, 32, 128, 256], ceil, 30, True)
        section("prefill" + suffix)(prefill)(holder, [512, 2048, 8192], ceil, not suffix)
        if not args.skip_offline:
            section("offline" + suffix)(offline)(holder, args.requests, 1024, 256,
                                                 [int(t) for t in args.offline_threads.split(",")])
    holder.clear()
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-offline", action="store_true", help="leave out the 1000-request job (~1 min)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--offline-threads", default="0,1",
                    help="torch thread counts for the offline job, 0: torch's default")
    ap.add_argument("--hf-batches", default="256,384")
    ap.add_argument("--skip-unfused", action="store_true", help="leave out the A/B without fused kernels")
    ap.add_argument("--fp8", action="store_true",
                    help="then startup, decode, prefill and offline again with quantization fp8")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for the whole run (0: torch's default); the offline job sets its own")
    args = ap.parse_args()
    OUT = Path(args.out)
    require_flashinfer()
    if args.threads:
        torch.set_num_threads(args.threads)
    RESULTS["torch_threads"] = torch.get_num_threads()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    model_dir = write_llama31_8b_config(Path(tempfile.mkdtemp()) / "llama31-8b-shape")
    ceil = ceilings()
    holder: dict = {}
    if args.smoke:
        section("startup")(startup)(str(model_dir), 8, 2048, holder)
        if "llm" in holder:
            section("decode")(decode)(holder, [1, 8], ceil, 10, True)
            section("prefill")(prefill)(holder, [512, 2048], ceil, False)
        return
    section("startup")(startup)(str(model_dir), 256, 8192, holder)
    if "llm" not in holder:  # the fused kernels failed to build or load: measure without them
        os.environ["QUADRIGA_FUSED_OPS"] = "0"
        gc.collect()
        torch.cuda.empty_cache()
        section("startup")(startup)(str(model_dir), 256, 8192, holder)
    if "llm" in holder:
        fused = holder["llm"].engine.runner.model.fused
        RESULTS["fused_ops"] = None if fused is None else fused.__name__
        print(f"fused ops: {RESULTS['fused_ops']}", flush=True)
    measure_engine(holder, ceil, args, "")
    if args.fp8:   # the same sections with fp8 weights, in the same process
        section("startup_fp8")(startup)(str(model_dir), 256, 8192, holder, "fp8")
        measure_engine(holder, ceil, args, "_fp8")
    if RESULTS.get("fused_ops") and not args.skip_unfused:  # the same decode steps without the fused norm/rope/SwiGLU kernels
        os.environ["QUADRIGA_FUSED_OPS"] = "0"
        section("startup_unfused")(startup)(str(model_dir), 32, 2048, holder)
        if "llm" in holder:
            section("decode_unfused")(decode)(holder, [1, 32], ceil, 20, False)
        save()
    # The engine's weights and KV cache go before transformers loads its own copy
    # (with --skip-unfused too: on an 80 GB card the two do not fit together).
    holder.clear()
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_hf:
        hf_baseline(str(model_dir), [int(b) for b in args.hf_batches.split(",")], args.requests, 1024, 256)
        engine = max((r["output_tokens_per_s"] for r in RESULTS.get("offline", {}).get("runs", [])
                      if r["mode"] == "greedy"), default=None)
        hf_best = (RESULTS.get("hf") or {}).get("best")
        if engine and hf_best:
            RESULTS["engine_over_transformers"] = engine / hf_best["output_tokens_per_s"]
            print(f"engine greedy {engine:.0f} tok/s over transformers' best "
                  f"{hf_best['output_tokens_per_s']:.0f} (batch {hf_best['batch']}): "
                  f"{RESULTS['engine_over_transformers']:.2f}x", flush=True)
        save()
    print("\n=== summary ===")
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "command"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
