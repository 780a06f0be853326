"""The 128-bit tile store kernel: input validation (anywhere) and a real run on an H200 (GPU only)."""
from __future__ import annotations

import pytest
import torch

from cute_kernels.tile_store import tile_copy


@pytest.mark.parametrize("shape,dtype,match", [
    ((64, 100), torch.bfloat16, "multiple of the tile"),
    ((64, 128), torch.float64, "dtype"),
    ((64, 128, 2), torch.bfloat16, "2-D"),
])
def test_bad_input_is_rejected_before_launch(shape, dtype, match):
    src = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        tile_copy(src, src.clone())


def test_cpu_tensors_are_rejected():
    src = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        tile_copy(src, src.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,dtype", [(64, 128, torch.bfloat16), (1024, 4096, torch.bfloat16),
                                       (512, 1024, torch.float16), (256, 512, torch.float32)])
def test_tile_copy_writes_every_element(m, n, dtype):
    src = torch.randn(m, n, device="cuda").to(dtype)
    dst = torch.full_like(src, float("nan"))  # poisoned: an unwritten element stays NaN
    spans = tile_copy(src, dst, tile_n=128 if dtype != torch.float32 else 64)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    spans = spans.cpu()
    assert spans.shape[0] == (m // 64) * (n // (128 if dtype != torch.float32 else 64))
    assert (spans[:, 0] > 0).all() and (spans[:, 1] >= spans[:, 0]).all()
    assert (spans[:, 3] >= spans[:, 2]).all() and (spans[:, 2] > 0).all()


@pytest.mark.gpu
def test_tile_copy_strided_destination():
    src = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
    big = torch.full((128, 384), float("nan"), device="cuda", dtype=torch.bfloat16)
    tile_copy(src, big[:, :256])
    torch.cuda.synchronize()
    assert torch.equal(big[:, :256], src) and torch.isnan(big[:, 256:].float()).all()
