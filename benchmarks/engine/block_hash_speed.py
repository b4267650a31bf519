"""Cost of addressing a prompt's KV blocks (common/block_hash.py), per block.

    python -m benchmarks.engine.block_hash_speed [--repeats 200]

The router hashes every arriving prompt to find which replica caches its
prefix, so this is on its hot path. Prints ns per block for several prompt
lengths and block sizes (best of --repeats, which is what the code costs
when the machine is not interfering) and saves
benchmarks/results/block_hash_cpu.json.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import save_result, summarize
from common.block_hash import SCHEME, block_hashes


def time_per_block(tokens: list[int], block_size: int, repeats: int) -> list[float]:
    """ns per full block, one sample per repeat."""
    num_blocks = len(tokens) // block_size
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        block_hashes(tokens, block_size)
        samples.append((time.perf_counter_ns() - start) / num_blocks)
    return samples


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    rows = []
    print(f"scheme {SCHEME}")
    print(f"{'tokens':>8}{'block':>7}{'best ns/block':>15}{'p50 ns/block':>14}{'best us/prompt':>16}")
    for block_size in (16, 32):
        for num_tokens in (256, 2048, 16384):
            tokens = [rng.randrange(150_000) for _ in range(num_tokens)]
            samples = time_per_block(tokens, block_size, a.repeats)
            stats = summarize(samples)
            best = min(samples)
            rows.append({"tokens": num_tokens, "block_size": block_size, "best_ns_per_block": best,
                         "ns_per_block": stats})
            print(f"{num_tokens:>8}{block_size:>7}{best:>15.0f}{stats['p50']:>14.0f}"
                  f"{best * num_tokens / block_size / 1000:>16.1f}")
    path = save_result("block_hash_cpu", {"scheme": SCHEME, "repeats": a.repeats, "results": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
