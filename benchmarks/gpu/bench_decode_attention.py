"""Decode attention alone, flashinfer's two kinds of decode kernel side by side:
tensor cores (the prefill kernel over one query row per sequence) and CUDA cores
(the decode kernel), each captured in a CUDA graph of --layers calls as the
engine's decode graphs hold them (Llama-3.1-8B heads: 32 query, 8 KV, dim 128,
bf16, 16-token pages, every sequence its own pages).

    python3 benchmarks/gpu/bench_decode_attention.py --out $OUT/decode_attention_h200.json

Per batch and context: microseconds per call (median of --repeats replays of
the graph, divided by --layers), the two kinds alternating, and the largest
difference between their outputs. The backend
(replica_worker/engine/attention/flashinfer_backend.py) uses tensor cores at
every batch size, as this table found them faster everywhere on the H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
KINDS = ("tensor_cores", "cuda_cores")


def graph_of_calls(kind: str, batch: int, context: int, layers: int, cache, q, workspace):
    import flashinfer

    pages = (context + PAGE - 1) // PAGE
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device="cuda")[: batch + 1]
    indices = torch.arange(batch * pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), context - (pages - 1) * PAGE, dtype=torch.int32, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=kind == "tensor_cores", backend="fa2", use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr.cpu(), indices, last.cpu(), QO_HEADS, KV_HEADS, HEAD_DIM, PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            wrapper.run(q, cache, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            wrapper.run(q, cache, out=out)
    return graph, out, wrapper


def time_graph(graph, layers: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / layers)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    from benchmarks.common import tree_commit

    result = {"command": "python3 " + " ".join(sys.argv), "commit": tree_commit(),
              "gpu": torch.cuda.get_device_name(),
              "heads": {"qo": QO_HEADS, "kv": KV_HEADS, "dim": HEAD_DIM, "page": PAGE}, "rows": []}
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            pages = (context + PAGE - 1) // PAGE
            cache = torch.randn(batch * pages, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            q = torch.randn(batch, QO_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            graphs = {kind: graph_of_calls(kind, batch, context, args.layers, cache, q, workspace) for kind in KINDS}
            us = {kind: [] for kind in KINDS}
            for _ in range(3):  # alternate the kinds
                for kind in KINDS:
                    us[kind].append(time_graph(graphs[kind][0], args.layers, args.repeats))
            diff = (graphs["tensor_cores"][1].float() - graphs["cuda_cores"][1].float()).abs().max().item()
            row = {"batch": batch, "context": context, "max_abs_diff": diff,
                   **{f"{kind}_us": [round(x, 2) for x in us[kind]] for kind in KINDS}}
            row["faster"] = min(KINDS, key=lambda k: statistics.median(us[k]))
            print(row, flush=True)
            result["rows"].append(row)
            del graphs, cache
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
