"""CUDA-only (skipped without a GPU): the decode kernels (on by default since measured
by benchmarks/gpu/bench_decode_kernels.py) serve the engine as the path without them
does: the rotary kernel that also stores k and v gives the same tokens bit for bit,
and the few-row matmul takes exactly the matmuls it should."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _recapture(llm, store: bool, gemv_rows: int) -> None:
    from replica_worker.engine.cuda_graph import DecodeGraphs
    from replica_worker.engine.model import parallel

    runner = llm.engine.runner
    parallel.SMALL_M_GEMV_ROWS = gemv_rows
    for layer in runner.model.layers:
        layer.self_attn.store_kv_in_rope = store
    max_batch = runner.graphs.max_batch
    runner.graphs = None
    gc.collect()
    runner.graphs = DecodeGraphs(runner, max_batch)


def test_rope_with_the_kv_store_gives_the_same_tokens(tmp_path_factory, monkeypatch):
    from common.tiny_model import build_tiny_model
    from replica_worker import LLM, SamplingParams
    from replica_worker.engine.model import parallel
    from tests.engine.test_flashinfer_cuda import ENGINE, TINY

    monkeypatch.setattr(parallel, "SMALL_M_GEMV_ROWS", 0)
    path = build_tiny_model(tmp_path_factory.mktemp("tiny128"), "llama3", **TINY)   # head_dim 128
    llm = LLM(str(path), device="cuda", dtype="bfloat16", enable_prefix_caching=False, **ENGINE)
    runner = llm.engine.runner
    assert runner.backend.name == "flashinfer" and runner.graphs is not None
    if getattr(runner.model.fused, "__name__", "").split(".")[-1] != "triton_ops":
        pytest.skip("the Triton kernels are not the fused ops here")
    prompts = [list(range(3, 40)), list(range(50, 53)), [7] * 70]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    base = tokens()
    _recapture(llm, True, 0)
    calls = []
    real = runner.backend.kv_store_rows
    monkeypatch.setattr(runner.backend, "kv_store_rows", lambda *a: calls.append(1) or real(*a))
    assert tokens() == base      # the same fp32 arithmetic, rounded at the same points
    assert calls                 # the eager prefills took the fused path (graphs baked it in)
    _recapture(llm, False, 0)


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
def test_small_m_linear_takes_few_rows_only(rows, monkeypatch):
    from replica_worker.engine.model import parallel, triton_gemv

    monkeypatch.setattr(parallel, "SMALL_M_GEMV_ROWS", 16)
    called = []
    real = triton_gemv.linear
    monkeypatch.setattr(triton_gemv, "linear", lambda *a, **k: called.append(1) or real(*a, **k))
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(6144, 4096, device="cuda", generator=g) / 64).to(torch.bfloat16)
    got = parallel.small_m_linear(x, w)
    assert bool(called) == (rows <= 16)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
