"""The decode step's kernels on the H200 (Llama-3.1-8B shape, dummy bf16), the candidates
beside what the engine runs now, in one process:

  gemv     every decode projection (q|k|v, o, gate|up, down, lm_head) at 1-16 rows:
           cuBLAS (F.linear) against model/triton_gemv.py at each candidate block
           shape, each a CUDA graph of 32 calls over weight copies that do not fit the
           L2 together; microseconds a call and TB/s of weight read
  decode   the engine's own step loop (async scheduling, CUDA graphs) at batch 1, 8
           and 32, context ~1024, with the graphs recaptured for each variant:
           base (what ships), kv_store (rotary + KV write in one kernel,
           QUADRIGA_FUSED_KV_STORE), gemv (QUADRIGA_SMALL_M_GEMV_ROWS=16), both;
           variants alternate, `--repeats` rounds; ms a step against the bandwidth
           limit, and each variant's batch-1 kernel profile

Usage on the device:
  source benchmarks/gpu/device-env.sh .carry
  python3 benchmarks/gpu/bench_decode_kernels.py --out $OUT/decode_kernels_h200.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_async as ba  # noqa: E402
import bench_engine as be  # noqa: E402

from replica_worker import LLM  # noqa: E402
from replica_worker.engine.cuda_graph import DecodeGraphs  # noqa: E402
from replica_worker.engine.model import parallel, triton_gemv  # noqa: E402

# (name, out features, in features) of the 8B shape's decode matmuls
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096))
CANDIDATES = ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5),
              (64, 128, 4, 4), (64, 256, 8, 3), (128, 64, 4, 4))
VARIANTS = {"base": (False, 0), "kv_store": (True, 0), "gemv": (False, 16), "both": (True, 16)}


def _graph_us(fn, calls: int) -> float:
    """Microseconds a call: fn(i) for i < calls captured in one CUDA graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return be.cuda_time(g.replay, 20) / calls * 1e6


def gemv(ceil: dict) -> dict:
    rows_out = []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))   # 512 MiB of weights in turn: past the L2
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5 for _ in range(copies)]
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
            want = F.linear(x, ws[0]).float()
            row = {"matmul": name, "N": n, "K": k, "rows": m, "weight_MB": nbytes / 1e6}

            def cublas(i):
                torch.matmul(x, ws[i % copies].t(), out=ys[i % copies])

            row["cublas_us"] = _graph_us(cublas, 32)
            row["cublas_TBps"] = nbytes / row["cublas_us"] / 1e6
            tried = []
            for cfg in CANDIDATES:
                try:
                    diff = (triton_gemv.linear(x, ws[0], config=cfg).float() - want).abs().max().item()
                    us = _graph_us(lambda i, cfg=cfg: triton_gemv.linear(x, ws[i % copies], config=cfg), 32)
                    tried.append({"config": cfg, "us": us, "TBps": nbytes / us / 1e6, "max_abs_diff": diff})
                except Exception as exc:
                    tried.append({"config": cfg, "error": f"{type(exc).__name__}: {exc}"})
            ok = [t for t in tried if "us" in t]
            row["triton"] = tried
            row["default_config"] = triton_gemv.config_for(n)
            if ok:
                best = min(ok, key=lambda t: t["us"])
                row["triton_best"] = best
                row["cublas_over_triton_best"] = row["cublas_us"] / best["us"]
            print({k_: v for k_, v in row.items() if k_ != "triton"}, flush=True)
            rows_out.append(row)
            be.save()
        del ws
        torch.cuda.empty_cache()
    return {"rows": rows_out, "copy_bandwidth_TBps": ceil.get("copy_bandwidth_TBps"),
            "method": "CUDA graph of 32 calls cycling over weight copies (512 MiB in all), "
                      "median of 20 replays by CUDA events"}


def apply_variant(llm, store: bool, gemv_rows: int, max_seqs: int) -> None:
    """Turns the kernels on or off in the loaded model and recaptures the decode graphs."""
    runner = llm.engine.runner
    parallel.SMALL_M_GEMV_ROWS = gemv_rows
    for layer in runner.model.layers:
        layer.self_attn.store_kv_in_rope = store
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner, max_seqs)


def profile_b1(llm, steps: int = 10) -> list:
    from torch.profiler import ProfilerActivity, profile

    from replica_worker import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 32)
    engine.add_request("prof", list(range(100, 100 + be.CTX)), params)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_request("prof")
    while engine.has_unfinished():
        engine.step()
    return [{**r, "device_ms_per_step": r["device_ms_total"] / steps} for r in be._top_kernels(prof, 20)]


def decode(llm, ceil: dict, batches, steps: int, repeats: int, max_seqs: int) -> dict:
    per_variant: dict[str, dict] = {v: {"rows": {}} for v in VARIANTS}
    for k in range(repeats):
        for name, (store, rows) in VARIANTS.items():
            apply_variant(llm, store, rows, max_seqs)
            ba.MODES = (("async", True),)
            out = ba.decode(llm, batches, ceil, steps, 1)
            for r in out["rows"]:
                slot = per_variant[name]["rows"].setdefault(r["batch"], {"step_ms": [], "limit_ms": []})
                slot["step_ms"] += r["async_step_ms"]
                slot["limit_ms"].append(r["bandwidth_limit_ms"])
            if k == 0:
                per_variant[name]["profile_b1"] = profile_b1(llm)
            be.save()
    summary = []
    for b in batches:
        row = {"batch": b}
        for name in VARIANTS:
            slot = per_variant[name]["rows"][b]
            limit = statistics.mean(slot["limit_ms"])
            row[f"{name}_step_ms"] = slot["step_ms"]
            row[f"{name}_over_limit"] = statistics.median(slot["step_ms"]) / limit
            row["bandwidth_limit_ms"] = limit
        print(row, flush=True)
        summary.append(row)
    apply_variant(llm, False, 0, max_seqs)
    return {"rows": summary, "variants": {n: {"QUADRIGA_FUSED_KV_STORE": int(s), "QUADRIGA_SMALL_M_GEMV_ROWS": r}
                                          for n, (s, r) in VARIANTS.items()},
            "profiles_b1": {n: v.get("profile_b1") for n, v in per_variant.items()},
            "method": f"bench_async.decode (async) per variant, {steps} steps, variants alternating, "
                      f"{repeats} rounds; graphs recaptured per variant"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="gemv,decode")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    be.OUT = Path(args.out)
    sections = args.sections.split(",")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    ceil = be.ceilings()
    if "gemv" in sections:
        be.section("gemv")(gemv)(ceil)
    if "decode" in sections:
        max_seqs = 32
        model_dir = be.write_llama31_8b_config(Path(tempfile.mkdtemp()) / "llama31-8b-shape")
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=4096,
                  scheduler="sarathi", chunk_size=8192, max_num_seqs=max_seqs, gpu_memory_utilization=0.9)
        be.RESULTS["fused_ops"] = getattr(llm.engine.runner.model.fused, "__name__", None)
        be.section("decode")(decode)(llm, ceil, [1, 8, 32], args.steps, args.repeats, max_seqs)
    be.save()


if __name__ == "__main__":
    main()
