"""The few-row Triton matmul (model/triton_gemv.py) against torch's, on CUDA when there
is one, else on the CPU under Triton's interpreter; skipped without triton."""

from __future__ import annotations

import pytest
import torch

from tests.engine.triton_device import DEV
from replica_worker.engine.model import triton_gemv


def _reference(x, w, b):
    y = x.float() @ w.float().t()
    return (y + b.float() if b is not None else y).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k,with_bias", [(96, 256, False), (100, 300, True), (2000, 512, False)])
def test_matches_a_float32_matmul(dtype, rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if with_bias else None
    got = triton_gemv.linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), _reference(x, w, b).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("config", [(16, 256, 4, 4), (32, 64, 4, 2), (64, 128, 8, 3)])
def test_every_block_shape_gives_the_same_product(config):
    """Edges: N and K not multiples of the blocks; a row-strided x."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 2 * 333, generator=g).to(torch.bfloat16).to(DEV)[:, :333]
    w = (torch.randn(150, 333, generator=g) / 18).to(torch.bfloat16).to(DEV)
    got = triton_gemv.linear(x, w, config=config)
    torch.testing.assert_close(got.float(), _reference(x, w, None).float(), rtol=2e-2, atol=2e-2)


def test_more_rows_than_a_tile_are_refused():
    x = torch.zeros(17, 32, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="at most 16"):
        triton_gemv.linear(x, torch.zeros(16, 32, dtype=torch.bfloat16, device=DEV))


def test_the_config_table_covers_every_width():
    assert triton_gemv.config_for(1) == triton_gemv.CONFIGS[0][1]
    assert triton_gemv.config_for(128256) == triton_gemv.CONFIGS[-1][1]
