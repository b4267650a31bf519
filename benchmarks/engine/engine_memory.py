"""Whether the engine's memory stays flat under a long stream of requests: the
engine core alone, in this process, as a replica's engine process drives it.

    python -m benchmarks.engine.engine_memory [--rounds 80 --num-blocks 1024]

Rounds of --requests requests (prompts of 16-96 random ids, 16-64 greedy output
tokens, ignore_eos) on a tiny random-weight model, each round run to the end;
after every few rounds the process's RSS and the number of objects the garbage
collector tracks. With the prefix cache on, finished requests' blocks stay
cached until their memory is needed, so the cache's bookkeeping grows until
every block holds a hash, then stays: a small --num-blocks fills it in the
first round, and anything that still grows after that is a leak.
Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import rss_mb, save_result, tree_commit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--requests", type=int, default=200, help="requests a round")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks (0: sized by memory)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--sample-every", type=int, default=5, help="rounds between samples")
    p.add_argument("--name", default="engine_memory_cpu")
    a = p.parse_args(argv)

    import torch

    from common.tiny_model import build_tiny_model
    from common.tokenizer import vocab_size
    from replica_worker.engine.config import engine_config
    from replica_worker.engine.core import EngineCore
    from replica_worker.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="quadriga-memory-")) / "model")
    blocks = {"num_blocks": a.num_blocks} if a.num_blocks else {}
    engine = EngineCore(engine_config(str(model), max_num_seqs=a.max_num_seqs, **blocks))
    rng = random.Random(1)
    vocab = vocab_size(model)

    def one_round(tag: str) -> None:
        for i in range(a.requests):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 96))]
            engine.add_request(f"{tag}-{i}", prompt, SamplingParams(
                max_tokens=rng.randint(16, 64), temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            engine.take_kv_events()   # as the replica's loop does every step

    samples, start = [], time.monotonic()
    for k in range(1, a.rounds + 1):
        one_round(f"r{k}")
        if k % a.sample_every == 0 or k == 1:
            samples.append({"rounds": k, "requests": k * a.requests,
                            "seconds": round(time.monotonic() - start, 1), "rss_mb": round(rss_mb(), 1),
                            "gc_objects": len(gc.get_objects()),
                            "cached_blocks": engine.prefix_cache_stats().cached_blocks})
            print(samples[-1], flush=True)
    path = save_result(a.name, {
        "commit": tree_commit(),
        "setup": f"engine core in one process, tiny random model, CPU, 1 torch thread, "
                 f"max_num_seqs {a.max_num_seqs}, prefix caching on, "
                 f"{a.num_blocks or 'memory-sized'} KV blocks; {a.requests} requests a round",
        "samples": samples,
        "growth_after_first_sample": {k: samples[-1][k] - samples[0][k] for k in ("rss_mb", "gc_objects")},
    })
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
