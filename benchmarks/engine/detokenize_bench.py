"""Incremental detokenization's cost per token: the detokenizer decoding through
transformers' `decode` against one call into the fast tokenizer (what
`detokenizer.ids_to_text` picks), in one run, sides alternating.

    python -m benchmarks.engine.detokenize_bench [--model .cache/models/smollm2]
        [--sequences 256] [--tokens 128] [--repeats 5]

The sequences are slices of real text (this repository's docs) encoded with the
model's tokenizer; every sequence grows one token a step, as in a batch of
decodes. Both sides must produce the same text. Writes
benchmarks/results/engine_detokenize_cpu.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.common import save_result
from common.tokenizer import load_tokenizer
from replica_worker.engine.detokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[2]


def corpus_ids(tokenizer, sequences: int, tokens: int) -> list[list[int]]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    stride = max(1, (len(ids) - tokens) // sequences)
    return [ids[i * stride:i * stride + tokens] for i in range(sequences)]


class TransformersDecodeOnly:
    """The tokenizer with its fast backend hidden, so the detokenizer falls back to
    transformers' decode (detokenizer.ids_to_text), as it did before."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def run(tokenizer, seqs: list[list[int]], via_transformers: bool) -> tuple[float, list[str]]:
    outs = [[] for _ in seqs]
    tok = TransformersDecodeOnly(tokenizer) if via_transformers else tokenizer
    detoks = [IncrementalDetokenizer(tok, out, ("\n\n\n",)) for out in outs]
    texts = ["" for _ in seqs]
    start = time.perf_counter()
    for step in range(len(seqs[0])):
        final = step == len(seqs[0]) - 1
        for k, (seq, out, d) in enumerate(zip(seqs, outs, detoks)):
            out.append(seq[step])
            texts[k] += d.step(final=final)[0]
    return time.perf_counter() - start, texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2"))
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    seqs = corpus_ids(tokenizer, args.sequences, args.tokens)
    n_tokens = args.sequences * args.tokens
    times = {"transformers_decode": [], "fast_tokenizer": []}
    reference = None
    for _ in range(args.repeats):
        for side in times:
            seconds, texts = run(tokenizer, seqs, via_transformers=side == "transformers_decode")
            times[side].append(seconds)
            reference = reference or texts
            assert texts == reference, f"{side} decoded other text"
    per_token = {side: [t / n_tokens * 1e6 for t in ts] for side, ts in times.items()}
    ratios = [a / b for a, b in zip(times["transformers_decode"], times["fast_tokenizer"])]
    result = {
        "model": Path(args.model).name, "sequences": args.sequences, "tokens_per_sequence": args.tokens,
        "repeats": args.repeats, "stop_strings": 1,
        "us_per_token": {side: {"median": float(np.median(v)), "min": min(v), "max": max(v)}
                         for side, v in per_token.items()},
        "transformers_over_fast": {"median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios)},
        "texts_equal": True,
        "note": "IncrementalDetokenizer.step per token per sequence (two decodes of a short window "
                "each); the same sequences, sides alternating within each repeat",
    }
    for side, v in result["us_per_token"].items():
        print(f"{side:20s} {v['median']:.2f} us/token [{v['min']:.2f}, {v['max']:.2f}]")
    print(f"transformers' decode over the fast tokenizer: {result['transformers_over_fast']['median']:.2f}x")
    print(f"wrote {save_result('engine_detokenize_cpu', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
