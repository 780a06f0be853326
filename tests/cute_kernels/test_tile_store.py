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
def test_tile_copy_writes_every_element(m, n, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    dst = torch.full_like(src, float("nan"))  # poisoned: an unwritten element stays NaN
    tile_n = 128 if dtype != torch.float32 else 64  # 128 bytes of row per tile either way
    spans = tile_copy(src, dst, tile_n=tile_n)
    torch.cuda.synchronize()
    assert torch.equal(dst, src), f"seed={seed}"
    spans = spans.cpu()
    assert spans.shape == ((m // 64) * (n // tile_n), 4)
    # every CTA wrote its span (globaltimer ns, then clock64 cycles), each end at or after its start
    assert (spans[:, 0] > 0).all() and (spans[:, 1] >= spans[:, 0]).all()
    assert (spans[:, 2] > 0).all() and (spans[:, 3] >= spans[:, 2]).all()


@pytest.mark.gpu
def test_tile_copy_strided_destination(seed):
    src = torch.randn(128, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    src = src.to(torch.bfloat16)
    big = torch.full((128, 384), float("nan"), device="cuda", dtype=torch.bfloat16)
    tile_copy(src, big[:, :256])
    torch.cuda.synchronize()
    assert torch.equal(big[:, :256], src), f"seed={seed}"
    assert torch.isnan(big[:, 256:].float()).all(), "wrote past the destination view"
