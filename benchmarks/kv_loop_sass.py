"""The KV loop of our attention kernel beside flash-attn-4's SM90 forward, from their SASS, without a GPU.

Both are compiled for sm_90a from fake tensors (d = 128, bf16, non-causal, 128 x 128 tiles) and each KV
loop is printed as its synchronization skeleton (``cute_kernels.compile.loop_outline``: every HGMMA,
barrier, mbarrier op and warpgroup wait, with the arithmetic ptxas placed between two of them), with the
exponentials ahead of the PV wait (``softmax_overlap``) and the loop's length. Our kernel takes any
``FlashAttentionA2AForward`` options (``--knobs JSON``); FA4 comes from the ``flash_attn`` Python finds (an
installed one, or a flash-attention checkout whose directory is on PYTHONPATH).
Usage: CUTE_DSL_ARCH=sm_90a python3 -m benchmarks.kv_loop_sass [--knobs JSON] [--no-fa4] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def ours(knobs: dict):
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel
    from flash_a2a.attention import FlashAttentionA2AForward

    k = FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", **knobs})
    return compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                          dump_dir=tempfile.mkdtemp(prefix="kvloop-ours-"))


def fa4():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass.runtime import make_fake_stream
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData

    from cute_kernels.compile import compile_kernel

    # interface.py's SM90 configuration for d = 128, non-causal
    fa = FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, 1, is_causal=False, is_local=False, pack_gqa=False,
                                   tile_m=128, tile_n=128, num_stages=2, num_threads=384, Q_in_regs=False,
                                   intra_wg_overlap=True, mma_pv_is_rs=True)

    def qkv():
        b, s, h = cute.sym_int64(), cute.sym_int64(divisibility=128), cute.sym_int64()
        return make_fake_tensor(cutlass.BFloat16, (b, s, h, 128),
                                stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8),
                                        cute.sym_int64(divisibility=8), 1), assumed_align=16)

    # (q, k, v, o, lse, scale, cu_seqlens_q/k, seqused_q/k, page_table, window left/right, sink, block
    # sparsity, aux data, cu_total_m_blocks, cu_total_splits, stream)
    return compile_kernel(fa, qkv(), qkv(), qkv(), qkv(), None, Float32(0.1), *([None] * 9), AuxData(), None, None,
                          make_fake_stream(use_tvm_ffi_env_stream=True),
                          dump_dir=tempfile.mkdtemp(prefix="kvloop-fa4-"))


def describe(name: str, compiled) -> dict:
    from cute_kernels.compile import hgmma_loop, loop_outline, sass, softmax_overlap

    text = sass(compiled.cubin)
    if text is None:
        raise SystemExit("no nvdisasm on this machine (it comes with triton)")
    body = hgmma_loop(text, 16) or []
    outline = loop_outline(body)
    print(f"===== {name}: {len(body)} instructions in the KV loop, exponentials ahead of the PV wait "
          f"(MUFU.EX2, FFMA): {softmax_overlap(text)}")
    for kind, item in outline:
        print(f"  {item}" if kind == "sync" else "      " + " ".join(f"{k}x{v}" for k, v in item.items()))
    return {"instructions": len(body), "windows": softmax_overlap(text),
            "outline": [[kind, item] for kind, item in outline]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--knobs", default="{}", help="FlashAttentionA2AForward knobs for our kernel (JSON)")
    p.add_argument("--no-fa4", action="store_true", help="our kernel only")
    p.add_argument("--out", default=None, help="also write both outlines as JSON")
    a = p.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    result = {"ours": describe(f"ours {a.knobs}", ours(json.loads(a.knobs)))}
    if not a.no_fa4:
        result["fa4"] = describe("flash-attn-4 SM90", fa4())
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
