"""Paged attention: metadata, and chunked prefill mixed with decodes over a shuffled block table."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
import transformers

import pytest

from replica_worker.engine.attention import TorchAttentionBackend, build_attention_metadata, torch_backend
from replica_worker.engine.attention.cpu_backend import CpuAttentionBackend
from replica_worker.engine.kv_cache import HEAD_MAJOR, KVCache
from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig
from replica_worker.engine.model_runner import ModelRunner
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers.base import ScheduledChunk as Chunk
from replica_worker.engine.sequence import Sequence



def test_metadata_fields():
    # Two prefill chunks (one continuing at 5), then two decodes; block size 4.
    md, positions, _ = build_attention_metadata(
        num_computed=[0, 5, 7, 3], num_tokens=[3, 4, 1, 1],
        block_ids=[[9], [2, 6, 4], [1, 8], [5, 3]], num_prefills=2, block_size=4, device="cpu",
    )
    assert md.num_seqs == 4 and md.num_prefills == 2 and md.num_decodes == 2
    assert (md.num_prefill_tokens, md.num_decode_tokens, md.max_query_len, md.max_seq_len) == (7, 2, 4, 9)
    assert positions.tolist() == [0, 1, 2, 5, 6, 7, 8, 7, 3]
    assert md.query_start_loc.tolist() == [0, 3, 7, 8, 9] and md.qo_indptr is md.query_start_loc
    assert md.seq_lens.tolist() == [3, 9, 8, 4]
    assert md.num_computed.tolist() == [0, 5, 7, 3]
    assert md.slot_mapping.tolist() == [36, 37, 38, 25, 26, 27, 16, 35, 23]
    assert md.block_tables.tolist() == [[9, 0, 0], [2, 6, 4], [1, 8, 0], [5, 0, 0]]
    assert md.paged_kv_indptr.tolist() == [0, 1, 4, 6, 7]
    assert md.paged_kv_indices.tolist() == [9, 2, 6, 4, 1, 8, 5]
    assert md.paged_kv_last_page_len.tolist() == [3, 1, 4, 4]
    for t in (md.query_start_loc, md.seq_lens, md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len, md.block_tables):
        assert t.dtype == torch.int32


def test_backend_matches_dense_causal_attention():
    """Random q/k/v: a sequence computed in chunks equals dense causal GQA attention."""
    torch.manual_seed(0)
    hq, hkv, d, bs, length = 4, 2, 8, 4, 23
    q, k, v = torch.randn(length, hq, d), torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    backend = TorchAttentionBackend(hq, hkv, d)
    cache = torch.zeros(10, 2, bs, hkv, d)
    blocks = [7, 0, 3, 9, 1, 5]
    out, done = [], 0
    for n in (6, 1, 9, 1, 1, 5):
        md, _, _ = build_attention_metadata([done], [n], [blocks], 1 if n > 1 else 0, bs, "cpu")
        backend.prepare(md)
        sl = slice(done, done + n)
        out.append(backend.forward(q[sl], k[sl], v[sl], cache, md))
        done += n
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_cpu_backend_matches_torch_backend_on_a_mixed_batch(window):
    """The head-major CPU backend writes the same K/V to the same slots and
    attends like the torch backend: prefills with and without cached context,
    decodes of uneven lengths, blocks shuffled, with and without a window."""
    torch.manual_seed(0)
    rng = random.Random(0)
    hq, hkv, d, bs, num_blocks = 6, 2, 8, 4, 120
    shape = [(9, 7), (0, 13), (0, 2), (30, 1), (5, 1), (0, 1), (61, 1)]  # (cached, new) per sequence
    free = list(range(num_blocks))
    rng.shuffle(free)
    blocks = [[free.pop() for _ in range(-(-(nc + nt) // bs))] for nc, nt in shape]
    md, _, _ = build_attention_metadata([s[0] for s in shape], [s[1] for s in shape], blocks, 3, bs, "cpu")
    q, k, v = (torch.randn(md.num_tokens, h, d) for h in (hq, hkv, hkv))
    nhd = torch.randn(num_blocks, 2, bs, hkv, d)
    head_major = KVCache(1, num_blocks, bs, hkv, d, torch.float32, "cpu", layout=HEAD_MAJOR).layers[0]
    head_major.copy_(nhd.permute(1, 3, 0, 2, 4))
    outs = []
    for backend, cache in ((TorchAttentionBackend(hq, hkv, d, sliding_window=window), nhd),
                           (CpuAttentionBackend(hq, hkv, d, sliding_window=window), head_major)):
        backend.prepare(md)
        outs.append(backend.forward(q, k, v, cache, md))
    assert torch.equal(head_major, nhd.permute(1, 3, 0, 2, 4))  # same slots written, nothing else touched
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)
    n = md.num_prefill_tokens
    assert torch.equal(outs[1][:n], outs[0][:n])  # prefills: the same calls on the same values


@pytest.mark.parametrize("window", [None, 20])
def test_torch_backend_in_slices_matches_one_call(window, monkeypatch):
    """Under a workspace too small for the batch, the decodes and a prefill's
    query rows run in slices (bounded memory on CUDA) and give the same output."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    torch.manual_seed(0)
    rng = random.Random(1)
    hq, hkv, d, bs, num_blocks = 6, 2, 8, 4, 120
    shape = [(9, 7), (30, 12), (0, 5), (30, 1), (5, 1), (0, 1), (61, 1), (17, 1)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    blocks = [[free.pop() for _ in range(-(-(nc + nt) // bs))] for nc, nt in shape]
    md, _, _ = build_attention_metadata([s[0] for s in shape], [s[1] for s in shape], blocks, 3, bs, "cpu")
    q, k, v = (torch.randn(md.num_tokens, h, d) for h in (hq, hkv, hkv))
    outs, counts = [], []
    for workspace in (torch_backend.WORKSPACE_BYTES, 1, 20_000, 100_000):
        cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=torch.Generator().manual_seed(3))
        backend = TorchAttentionBackend(hq, hkv, d, sliding_window=window)
        backend.workspace_bytes = workspace
        backend.prepare(md)
        calls.clear()
        outs.append(backend.forward(q, k, v, cache, md))
        counts.append(len(calls))
    # one call a prefill and one for the decodes; then a row a call (a chunk with no
    # cached context is one call still: the profile measured it); then slices between
    assert counts[0] == 4 and counts[1] == 7 + 12 + 1 + 5 and counts[0] < counts[3] < counts[2] < counts[1]
    for sliced in outs[1:]:
        torch.testing.assert_close(sliced, outs[0], atol=1e-6, rtol=1e-5)


def test_rows_per_slice():
    assert torch_backend.rows_per_slice(100, 1000) == 10
    assert torch_backend.rows_per_slice(100, 50) == 1   # always at least one row
    assert torch_backend.rows_per_slice(0, 50) == 50


def test_chunked_prefill_mixed_with_decodes_matches_transformers(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    runner = ModelRunner(EngineConfig(ModelConfig(str(path)), CacheConfig(block_size=4, num_blocks=40)))
    physical = list(range(40))
    random.Random(1).shuffle(physical)
    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(2)
    long = Sequence("long", [rng.randrange(3, 500) for _ in range(45)], greedy)
    long.block_ids = physical[:12]
    short = Sequence("short", [rng.randrange(3, 500) for _ in range(6)], greedy)
    short.block_ids = physical[12:20]

    def logits_of(chunks):
        inputs = runner.prepare_inputs(chunks)
        runner.backend.prepare(inputs.metadata)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.metadata)
            return runner.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def hf_last(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq.token_ids])).logits[0, -1]

    # Step 1 prefills short whole and long's first chunk; later steps mix long's
    # uneven chunks (one of a single token) with short's decodes.
    plan = [7, 13, 1, 16, 8]
    short_chunk = Chunk(short, short.num_tokens)
    for step, n in enumerate(plan):
        chunks = [Chunk(long, n), short_chunk]
        logits = logits_of(chunks)
        sampling = [c for c in chunks if c.samples]
        for c, row in zip(sampling, logits):
            torch.testing.assert_close(row, hf_last(c.seq), atol=1e-4, rtol=1e-4)
        for c in chunks:
            c.seq.num_computed_tokens += c.num_tokens
        for c, row in zip(sampling, logits):
            c.seq.append_token(int(row.argmax()))
        short_chunk = Chunk(short, 1)
    assert long.num_computed_tokens == 45 and long.num_output_tokens == 1
    assert short.num_output_tokens == len(plan)


def test_flashinfer_prefill_kernels_can_be_named_and_a_wrong_name_is_refused(monkeypatch):
    from replica_worker.engine.attention.flashinfer_backend import prefill_kernels

    for name in ("fa2", "fa3"):
        monkeypatch.setenv("QUADRIGA_FLASHINFER_PREFILL", name)
        assert prefill_kernels(torch.device("cpu")) == name
    monkeypatch.setenv("QUADRIGA_FLASHINFER_PREFILL", "fa4")
    with pytest.raises(ValueError, match="must be auto, fa2 or fa3"):
        prefill_kernels(torch.device("cpu"))
