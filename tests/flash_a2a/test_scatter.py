"""The device-initiated Ulysses All-to-All: compiles for sm_90a (CPU), validates input, and on 2 GPUs
delivers bit-exact results, repeatedly and under CUDA-Graph replay (epochs never go stale)."""
from __future__ import annotations

import json

import pytest
from ranks import run_ranks

pytest.importorskip("cutlass")


SCATTERS = [(16, "post"), (8, "post"), (16, "pre"), (8, "pre")]  # (128-bit vectors per row, direction)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(vec_per_row, direction) or "wait" -> (kernel, CompiledKernel), each compiled once for this module."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel
    from flash_a2a.scatter import EpochWaitKernel, UlyssesScatterKernel

    cache = {}

    def get(name):
        if name not in cache:
            k = EpochWaitKernel() if name == "wait" else UlyssesScatterKernel(name[0], direction=name[1])
            c = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                               dump_dir=str(tmp_path_factory.mktemp("scatter")))
            assert ".target sm_90a" in c.ptx and c.cubin
            cache[name] = k, c
        return cache[name]

    return get


@pytest.mark.parametrize("vec_per_row,direction", SCATTERS)
def test_scatter_kernels_compile_for_sm90a(compiled, vec_per_row, direction):
    k, c = compiled((vec_per_row, direction))
    assert k.vec_per_thread > 0
    assert c.ptx_count(r"st\.global\.v4\.b32") == k.vec_per_thread, "one 128-bit store per vector"
    assert c.ptx_count(r"ld\.acquire\.sys") >= 1, "waits for the receiver's ready flag"
    assert c.ptx_count(r"red\.release\.sys\.global\.max\.s64") >= 1, "ready flag (release, sys, 64-bit)"
    # data flag: one fence per CTA (release pattern), then its share added to every receiver's word
    assert c.ptx_count(r"fence\.acq_rel\.sys") == 1
    assert c.ptx_count(r"red\.relaxed\.sys\.global\.add\.u64") >= 1
    assert c.ptx_count(r"ld\.acquire\.sys\.global\.b64") >= 1, "64-bit flag words"


def test_epoch_wait_kernel_is_bounded(compiled):
    _, c = compiled("wait")
    assert c.ptx_count(r"ld\.acquire\.sys\.global\.b64") >= 1, "waits on the 64-bit data flags"
    assert c.ptx_count(r"%globaltimer") >= 1, "bounded wait"
    assert c.ptx_count(r"atom\.global\.sys\.cas") >= 1, "a timeout sets the error word"


@pytest.mark.parametrize("name", SCATTERS + ["wait"], ids=lambda v: v if isinstance(v, str) else f"{v[1]}-{v[0]}")
def test_all_to_all_kernels_use_no_local_memory(compiled, no_spills, name):
    no_spills(compiled(name)[1].ptx)


POST_SHAPES = [(1, 1024, 2, 128, "bfloat16"), (2, 2048, 12, 128, "bfloat16"), (1, 4096, 3, 64, "float16"),
               (1, 512, 1, 128, "bfloat16")]  # (b, S, H/P, d, dtype)
PRE_SHAPES = [(1, 512, 2, 128, "bfloat16"), (2, 1024, 3, 64, "float16")]  # (b, S/P, H/P, d, dtype)
POST_CALLS, PRE_CALLS, REPLAYS = 3, 2, 4
BAD_INPUTS = {  # name -> what the error must say
    "rows_per_rank_off_the_tile": "multiple of the 128-row tile",
    "float32": "must be bfloat16 or float16",
    "non_contiguous": "must be contiguous",
}


def _expected_checks(world: int) -> list[list]:
    """Every comparison the worker makes against the reference, by name (JSON-shaped: lists)."""
    out = [["post", *shape, call] for shape in POST_SHAPES for call in range(POST_CALLS)]
    out += [["pre", *shape, call, slot] for shape in PRE_SHAPES for call in range(PRE_CALLS) for slot in range(2)]
    return out + [["graph", replay] for replay in range(REPLAYS)]


def _worker(rank, world, init_file, out, seed):
    import torch
    import torch.distributed as dist
    from cute_kernels.dist import process_group

    torch.manual_seed(seed + rank)  # each rank its own inputs; the references gather them all
    with process_group(rank, world, init_file):
        from flash_a2a import pre_attention_a2a
        from flash_a2a.a2a import SymmetricUlyssesA2A, nccl_post_a2a
        from flash_a2a.mapping import reference_post_a2a, reference_pre_a2a

        a2a = SymmetricUlyssesA2A()
        checked = []
        for b, s, h_loc, d, dt in POST_SHAPES:
            dt = getattr(torch, dt)
            for call in range(POST_CALLS):  # repeated calls advance the epoch
                o = torch.randn(b, s, h_loc, d, device="cuda").to(dt)
                gathered = [torch.empty_like(o) for _ in range(world)]
                dist.all_gather(gathered, o)
                ref = reference_post_a2a([g.cpu() for g in gathered])[rank]
                st = a2a.states.get((b, s, h_loc, d, dt))
                if st is not None:
                    st.out.fill_(float("nan"))  # poison (stream-ordered before this rank's ready flag)
                got = a2a(o)
                torch.cuda.synchronize()
                a2a.check()
                assert torch.equal(got.cpu(), ref), ("mismatch", b, s, h_loc, d, f"seed={seed}")
                assert torch.equal(nccl_post_a2a(o).cpu(), ref), ("NCCL reference", f"seed={seed}")
                checked.append(["post", b, s, h_loc, d, str(dt).split(".")[-1], call])
        # Pre-attention direction: (b, S/P, H, d) -> (b, S, H/P, d), two slots of one shape alive at once.
        for b, s_loc, h_loc, d, dt in PRE_SHAPES:
            dt = getattr(torch, dt)
            for call in range(PRE_CALLS):
                xs = [torch.randn(b, s_loc, h_loc * world, d, device="cuda").to(dt) for _ in range(2)]
                refs = []
                for x in xs:
                    gathered = [torch.empty_like(x) for _ in range(world)]
                    dist.all_gather(gathered, x)
                    refs.append(reference_pre_a2a([g.cpu() for g in gathered])[rank])
                outs = [a2a.pre(x, slot) for slot, x in enumerate(xs)]
                torch.cuda.synchronize()
                a2a.check()
                for slot, (got, ref, x) in enumerate(zip(outs, refs, xs)):
                    assert torch.equal(got.cpu(), ref), ("pre mismatch", b, s_loc, h_loc, d, f"seed={seed}")
                    assert torch.equal(pre_attention_a2a(x).cpu(), ref), ("NCCL pre-attention", f"seed={seed}")
                    checked.append(["pre", b, s_loc, h_loc, d, str(dt).split(".")[-1], call, slot])
        # CUDA Graph: capture one call, replay with fresh inputs copied into the static input.
        b, s, h_loc, d = 1, 2048, 4, 128
        static = torch.randn(b, s, h_loc, d, device="cuda").to(torch.bfloat16)
        a2a(static)
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graph_out = a2a(static)
        for replay in range(REPLAYS):
            fresh = torch.randn_like(static, dtype=torch.float32).to(torch.bfloat16)
            gathered = [torch.empty_like(fresh) for _ in range(world)]
            dist.all_gather(gathered, fresh)
            static.copy_(fresh)
            g.replay()
            torch.cuda.synchronize()
            a2a.check()
            ref = reference_post_a2a([x.cpu() for x in gathered])[rank]
            assert torch.equal(graph_out.cpu(), ref), ("stale or wrong data after graph replay", f"seed={seed}")
            checked.append(["graph", replay])
            dist.barrier()
        bad_inputs = {
            "rows_per_rank_off_the_tile": torch.randn(1, 1000, 2, 128, device="cuda").to(torch.bfloat16),
            "float32": torch.randn(1, 1024, 2, 128, device="cuda"),
            "non_contiguous": torch.randn(1, 1024, 128, 2, device="cuda").to(torch.bfloat16).transpose(2, 3),
        }
        errors = {}
        for name, bad in bad_inputs.items():
            try:
                a2a(bad)
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"checked": checked, "errors": errors}, f)


@pytest.mark.multigpu
def test_symmetric_a2a_matches_reference(tmp_path, seed):
    for rank, res in enumerate(run_ranks(_worker, tmp_path, args=(seed,))):
        assert res["checked"] == _expected_checks(2), (rank, f"seed={seed}")
        assert set(res["errors"]) == set(BAD_INPUTS), res["errors"]
        for name, message in BAD_INPUTS.items():
            assert message in (res["errors"][name] or "was accepted"), (rank, name, res["errors"][name])
