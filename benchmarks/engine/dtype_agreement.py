"""How far bfloat16 and fp8 greedy output follow float32, for the engine and for
transformers itself, on a real model: the engine's bf16 agreement means
something only beside transformers' own. fp8 (quantization="fp8") is also
set against the engine's own bf16, and its logit error measured alone.

    python -m benchmarks.engine.dtype_agreement [--model .cache/models/smollm2]
        [--requests 32] [--output-len 64] [--threads 2]

The prompts are real questions through the model's chat template; every side
generates output-len greedy tokens with EOS kept in the argmax but not
stopping. The reference is transformers in float32. Per side: the share of
all output tokens that come before each sequence's first divergence from the
reference, and the sequences equal throughout. Transformers' bf16 logits
against its float32 logits, teacher-forced on the reference sequences, give
the spread of the logit differences (abs, p50/p99/max, and max over the
vocabulary's range). Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import save_result
from replica_worker.engine.model.fp8 import emulate_in_transformers

ROOT = Path(__file__).resolve().parents[2]

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How do plants make food?",
    "What is a prime number?", "Who wrote Romeo and Juliet?", "How does a rainbow form?",
    "What is the boiling point of water?", "Explain gravity to a child.", "What do bees make?",
    "How many legs does a spider have?", "What is the largest ocean?", "Why do we sleep?",
    "What is photosynthesis?", "How does a compass work?", "What is the speed of light?",
    "Name three primary colors.", "What causes the seasons?", "How do airplanes fly?",
    "What is DNA?", "Why is exercise healthy?", "What is the tallest mountain?",
    "How do vaccines work?", "What is an atom?", "Give me a tip for learning to cook.",
    "What is the moon made of?", "How does the heart pump blood?", "What is a volcano?",
    "Why do leaves change color?", "What is machine learning?", "How do fish breathe?",
    "Write a haiku about rain.", "What is the water cycle?",
]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    prefix = [first_divergence(o, r) for o, r in zip(outputs, reference)]
    total = sum(len(r) for r in reference)
    return {"share_of_tokens_before_first_divergence": sum(prefix) / total,
            "sequences_equal": sum(p == len(r) for p, r in zip(prefix, reference)),
            "sequences": len(reference), "first_divergence_index": prefix}


def transformers_side(model_dir: str, prompts, dtype, n_out: int):

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:   # one at a time: no padding, so nothing but the dtype differs
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_out,
                                 min_new_tokens=n_out, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return model, outs


def logits_on(model, prompts, sequences) -> list[torch.Tensor]:
    """Float32 logits of each output position, teacher-forced on `sequences`."""
    out = []
    with torch.inference_mode():
        for p, s in zip(prompts, sequences):
            ids = torch.tensor([p + s[:-1]])
            out.append(model(input_ids=ids).logits[0, len(p) - 1:].float())
    return out


def logit_error(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(reference, other)]).numpy()
    top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(reference, other)]).float().mean()
    return {"p50": float(np.percentile(diffs, 50)), "p99": float(np.percentile(diffs, 99)),
            "max": float(diffs.max()), "top1_agreement": float(top1)}


def engine_side(model_dir: str, prompts, dtype: str, n_out: int, quantization=None) -> list[list[int]]:
    from replica_worker import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, scheduler="sarathi", chunk_size=2048, max_num_seqs=len(prompts),
              enable_prefix_caching=False, quantization=quantization)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="engine_dtype_agreement_cpu", help="the JSON's name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    questions = (QUESTIONS * (args.requests // len(QUESTIONS) + 1))[:args.requests]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    t0 = time.perf_counter()
    ref_model, reference = transformers_side(args.model, prompts, torch.float32, args.output_len)
    hf_bf16_model, hf_bf16 = transformers_side(args.model, prompts, torch.bfloat16, args.output_len)
    ref_logits = logits_on(ref_model, prompts, reference)
    bf16_logits = logits_on(hf_bf16_model, prompts, reference)
    bf16_error = logit_error(ref_logits, bf16_logits)
    spans = [float((a.max(-1).values - a.min(-1).values).mean()) for a in ref_logits]
    del hf_bf16_model, ref_model
    # fp8's error alone (float32 otherwise), and from its weights and its inputs apart.
    fp8_error = {part: logit_error(ref_logits, logits_on(
        emulate_in_transformers(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(),
                                weights=part != "inputs_only", inputs=part != "weights_only"),
        prompts, reference)) for part in ("weights_and_inputs", "weights_only", "inputs_only")}
    engine_bf16 = engine_side(args.model, prompts, "bfloat16", args.output_len)
    engine_fp8_bf16 = engine_side(args.model, prompts, "bfloat16", args.output_len, "fp8")
    sides = {
        "transformers_bfloat16": agreement(hf_bf16, reference),
        "engine_float32": agreement(engine_side(args.model, prompts, "float32", args.output_len), reference),
        "engine_bfloat16": agreement(engine_bf16, reference),
        "engine_fp8_float32": agreement(engine_side(args.model, prompts, "float32", args.output_len, "fp8"),
                                        reference),
        "engine_fp8_bfloat16": agreement(engine_fp8_bf16, reference),
    }
    fp8_against_bf16 = agreement(engine_fp8_bf16, engine_bf16)
    print(f"engine fp8 (bf16) against engine bf16: {fp8_against_bf16['share_of_tokens_before_first_divergence']:.1%} "
          f"of tokens before the first divergence", flush=True)
    for name, side in sides.items():
        print(f"{name:24s} {side['share_of_tokens_before_first_divergence']:.1%} of tokens before the "
              f"first divergence from float32 transformers; {side['sequences_equal']}/{side['sequences']} "
              f"sequences equal", flush=True)
    result = {
        "model": Path(args.model).name, "requests": args.requests, "output_len": args.output_len,
        "threads": args.threads, "reference": "transformers, float32, greedy, EOS kept in the argmax",
        "sides": sides,
        "transformers_bf16_logit_abs_diff": {
            **bf16_error, "mean_logit_range": float(np.mean(spans)),
            "note": "transformers bf16 against float32 logits, teacher-forced on the float32 outputs"},
        "engine_fp8_bfloat16_against_engine_bfloat16": fp8_against_bf16,
        "fp8_logit_abs_diff": {
            **fp8_error["weights_and_inputs"],
            "weights_only": fp8_error["weights_only"], "inputs_only": fp8_error["inputs_only"],
            "note": "transformers float32 with the fp8 scheme emulated (fp8.emulate_in_transformers: "
                    "e4m3 weights per channel, inputs per token; or one half of it) against plain "
                    "float32 logits, teacher-forced on the float32 outputs: fp8's error alone, no bf16 "
                    "in it. top1_agreement: the share of positions whose argmax is the same"},
        "fp8_on_the_cpu": "the engine emulates the fp8 matmul in float32 (then rounds to its dtype); "
                          "on CUDA _scaled_mm computes the same products (tests/engine/test_fp8_cuda.py)",
        "seconds": time.perf_counter() - t0,
    }
    print("bf16 logit error", {k: v for k, v in result["transformers_bf16_logit_abs_diff"].items() if k != "note"})
    print("fp8 logit error", fp8_error)
    print(f"wrote {save_result(args.name, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
