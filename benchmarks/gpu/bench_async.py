"""Async scheduling on the H200, on and off in one process (Llama-3.1-8B shape, dummy bf16;
`--shape mistral-7b` gives Mistral 7B v0.1's, whose 4096-token sliding window is on
every layer).

  decode   batch 1/32/128/256 at context ~1024 (`--batches`, `--context`), the engine's
           own step loop: median ms per step over `--steps` decode steps, against the
           bandwidth limit (weights but the embedding table, plus the KV read, at most
           the window, at the copy bandwidth measured in the same run)
  prefill  back-to-back prompts of 512/2048/8192 tokens, one output token each, through
           the engine (8192-token steps): prompt tokens/s and the share of the matmul
           rate measured in the same run (FLOPs counted as bench_engine.prefill counts them)
  offline  1000 x (1024 in, 256 out), greedy and seeded sampling
Sides alternate (off, on, off, on, ...); --modes picks them. Usage on the device:
  source benchmarks/gpu/device-env.sh .carry
  python3 benchmarks/gpu/bench_async.py --out $OUT/async_h200.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine as be  # noqa: E402

from replica_worker import LLM, SamplingParams  # noqa: E402

ALL_MODES = {"sync": False, "async": True}
MODES: tuple = tuple(ALL_MODES.items())


def prefill_flops(shape, n: int) -> float:
    per_layer = shape.hidden_size * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim \
        + shape.num_heads * shape.head_dim * shape.hidden_size + 3 * shape.hidden_size * shape.intermediate_size
    return 2 * n * per_layer * shape.num_layers + 2 * shape.vocab_size * shape.hidden_size \
        + 4 * shape.num_heads * shape.head_dim * (n * (n + 1) // 2) * shape.num_layers


def write_mistral_7b_config(path: Path) -> Path:
    """Mistral 7B v0.1's config.json: the 8B's layers but a 32k vocabulary, and a sliding
    window of 4096 tokens on every layer (on whenever max_model_len is past it)."""
    import transformers

    transformers.MistralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False, torch_dtype="bfloat16",
    ).save_pretrained(str(path))
    return path


SHAPES = {"llama31-8b": be.write_llama31_8b_config, "mistral-7b": write_mistral_7b_config}


def random_prompt(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(min(vocab_size, 128000)) for _ in range(n)]


def queue_and_drain(engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    """Seconds from the first step to the last, with every prompt queued at once."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def prefill(llm, lengths, ceil: dict, repeats: int) -> dict:
    engine = llm.engine
    shape = engine.runner.model.shape
    mm = ceil["bf16_matmul_TFLOPs"] * 1e12
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows = []

    def run(n: int, count: int, tag: str) -> float:
        return queue_and_drain(engine, [random_prompt(rng, shape.vocab_size, n) for _ in range(count)], params, tag)

    for n in lengths:
        count = max(16, (1 << 17) // n)
        row = {"prompt_tokens": n, "prompts": count}
        for mode, on in MODES:
            engine.set_async_scheduling(on)
            run(n, 4, f"warm{n}{mode}")
            seconds = [run(n, count, f"p{n}{mode}{k}") for k in range(repeats)]
            rates = [count * prefill_flops(shape, n) / t / mm for t in seconds]
            row[f"{mode}_prompt_tokens_per_s"] = [count * n / t for t in seconds]
            row[f"{mode}_share_of_matmul_rate"] = rates
        print(row, flush=True)
        rows.append(row)
        be.save()
    return {"rows": rows, "method": "all prompts queued at once, timed from the first step to the last; "
                                    "a warm-up of 4 prompts of the length first"}


def decode(llm, batches, ceil: dict, steps: int, repeats: int, ctx: int) -> dict:
    engine = llm.engine
    s = engine.runner.model.shape
    window = engine.runner.backend.sliding_window
    weight_bytes = engine.runner.model.weight_nbytes()
    embed = engine.runner.model.embed_tokens.weight
    bw = ceil["copy_bandwidth_TBps"] * 1e12
    rng = random.Random(0)
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {m: [] for m, _ in MODES}
        contexts: list[float] = []  # mean tokens per request at the window's start and end
        for k in range(repeats):
            for mode, on in MODES:
                engine.set_async_scheduling(on)
                # Long enough that no request finishes before the timed steps end: the first
                # ones start decoding about b * CTX / 8192 steps before the last (their prefill
                # steps), and the batch must stay b throughout.
                params = SamplingParams(temperature=0.0, ignore_eos=True,
                                        max_tokens=steps + 16 + -(-b * ctx // 8192) * 2)
                for i in range(b):
                    engine.add_request(f"d{b}-{k}-{mode}-{i}", random_prompt(rng, s.vocab_size, ctx), params)
                started: set[str] = set()
                while len(started) < b:  # prefill, until every request has its first token
                    started.update(d.request_id for d in engine.step().deltas if d.new_token_ids)
                for _ in range(3):
                    engine.step()
                torch.cuda.synchronize()
                contexts.append(statistics.mean(q.num_tokens for q in engine.scheduler.running))
                t = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[mode].append((time.perf_counter() - t) / steps)
                assert engine.scheduler.num_running == b, "a request finished inside the timed steps"
                contexts.append(statistics.mean(q.num_tokens for q in engine.scheduler.running))
                for i in range(b):
                    engine.abort_request(f"d{b}-{k}-{mode}-{i}")
                while engine.has_unfinished():
                    engine.step()
        context = statistics.mean(contexts)
        attended = min(context, window) if window else context  # keys a query reads
        kv_bytes = b * attended * s.num_layers * 2 * s.num_kv_heads * s.head_dim * 2
        need = weight_bytes - embed.numel() * embed.element_size() + b * s.hidden_size * 2 + kv_bytes
        limit = need / bw
        row = {"batch": b, "mean_context": context, "sliding_window": window, "bandwidth_limit_ms": limit * 1e3}
        for mode, _ in MODES:
            ms = [t * 1e3 for t in times[mode]]
            row[f"{mode}_step_ms"] = ms
            row[f"{mode}_over_limit"] = statistics.median(ms) / (limit * 1e3)
        print(row, flush=True)
        rows.append(row)
        be.save()
    return {"rows": rows, "method": f"engine.step() wall time over {steps} decode steps after 3, "
                                    "every request greedy with ignore_eos and running throughout; the "
                                    "limit at the mean context over the windows; medians over repeats"}


def offline(llm, num: int, n_in: int, n_out: int, repeats: int) -> dict:
    vocab_size = llm.engine.runner.model.shape.vocab_size
    runs = []
    run = 0
    for k in range(repeats):
        for kind, knobs in (("greedy", be.GREEDY), ("seeded", be.SEEDED)):
            for mode, on in MODES:
                llm.engine.set_async_scheduling(on)
                # Prompts of their own per run: no run finds another's in the prefix cache.
                rng = random.Random(1000 + run)
                run += 1
                prompts = [random_prompt(rng, vocab_size, n_in) for _ in range(num)]

                def params_of(i, knobs=knobs, seeded=kind == "seeded"):
                    return SamplingParams(max_tokens=n_out, ignore_eos=True, seed=i if seeded else None, **knobs)

                r = {"kind": kind, "mode": mode, "repeat": k, **be._offline_job(llm, prompts, params_of, n_out)}
                print(r, flush=True)
                runs.append(r)
                be.save()
    return {"requests": num, "input_tokens": n_in, "output_tokens": n_out, "runs": runs, "detokenized": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=1, help="offline repeats (decode uses 2)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--sections", default="decode,offline", help="of decode, prefill, offline")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama31-8b")
    ap.add_argument("--batches", default="1,32,128,256", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=be.CTX, help="decode prompt tokens")
    args = ap.parse_args()
    global MODES
    MODES = tuple((m, ALL_MODES[m]) for m in args.modes.split(","))
    sections = args.sections.split(",")
    be.OUT = Path(args.out)
    be.require_flashinfer()
    import os

    be.RESULTS["flashinfer_prefill"] = os.environ.get("QUADRIGA_FLASHINFER_PREFILL", "default")
    torch.set_num_threads(1)  # the engine's setting on an accelerator
    ceil = be.ceilings()
    be.RESULTS["shape"] = args.shape
    be.RESULTS["attention_backend"] = os.environ.get("QUADRIGA_ATTENTION_BACKEND", "default")
    model_dir = SHAPES[args.shape](Path(tempfile.mkdtemp()) / args.shape)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=10240,
              scheduler="sarathi", chunk_size=8192, max_num_seqs=256, gpu_memory_utilization=0.9)
    be.RESULTS["startup_s"] = llm.engine.runner.startup_seconds
    be.RESULTS["prefill_kernels"] = getattr(llm.engine.runner.backend, "prefill_kernels", None)
    be.RESULTS["backend"] = llm.engine.runner.backend.name
    be.RESULTS["sliding_window"] = llm.engine.runner.backend.sliding_window
    if "decode" in sections:
        batches = [int(b) for b in args.batches.split(",")]
        be.section("decode")(decode)(llm, batches, ceil, args.steps, 2, args.context)
    if "prefill" in sections:
        be.section("prefill")(prefill)(llm, [512, 2048, 8192], ceil, 2)
    if "offline" in sections:
        be.section("offline")(offline)(llm, args.requests, 1024, 256, args.repeats)


if __name__ == "__main__":
    main()
