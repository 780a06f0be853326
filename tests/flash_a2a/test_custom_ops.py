"""The custom ops trace as opaque nodes with the right output shapes (CPU, fake tensors, a 1-rank gloo group)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

pytest.importorskip("cutlass")

from flash_a2a import ops  # noqa: E402,F401 - registers torch.ops.xstage.*


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_flash_attention_op_traces_with_fake_tensors():
    def f(q, k, v):
        return torch.ops.xstage.flash_attention(q, k, v, 0.1) * 2

    q = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)  # traced with fake tensors: the values never matter
    gm = make_fx(f, tracing_mode="fake")(q, q, q)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.xstage.flash_attention.default in targets
    out_node = next(n for n in gm.graph.nodes if n.target == torch.ops.xstage.flash_attention.default)
    assert tuple(out_node.meta["val"].shape) == (1, 256, 2, 128)


def test_fused_op_fake_shape_follows_the_group(one_rank_group):
    def f(q, k, v):
        return torch.ops.xstage.fused_attention_a2a(q, k, v, one_rank_group.group_name, None, "piggyback")

    q = torch.zeros(2, 512, 3, 64, dtype=torch.bfloat16)
    gm = make_fx(f, tracing_mode="fake")(q, q, q)
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.xstage.fused_attention_a2a.default)
    assert tuple(node.meta["val"].shape) == (2, 512, 3, 64)  # world 1: (b, S/1, H_loc*1, d)
