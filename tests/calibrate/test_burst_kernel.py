"""The calibration kernels (calibrate.burst_kernel) compile for sm_90a on fake tensors (no GPU needed) and are
what the microbenchmark claims: 128-bit bursts, timed on both clocks, one completion flag per producer, a
bounded flag wait, no local memory."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

from cutlass.runtime import make_fake_stream  # noqa: E402

from cute_kernels.compile import compile_kernel  # noqa: E402

VARIANTS = [(False, "fma"), (True, "fma"), (False, "spin"), (True, "spin")]  # (isolated, gap_kind)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """name -> CompiledKernel, each variant compiled once for this module's tests."""
    from calibrate.burst_kernel import BurstGapKernel, FlagWaitKernel

    cache = {}

    def get(name):
        if name not in cache:
            kernel = FlagWaitKernel() if name == "flag_wait" else BurstGapKernel(128, name[1], name[0])
            c = compile_kernel(kernel, *kernel.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                               dump_dir=str(tmp_path_factory.mktemp("dump")))
            assert ".target sm_90a" in c.ptx and c.cubin
            cache[name] = c
        return cache[name]

    return get


@pytest.mark.parametrize("isolated,gap_kind", VARIANTS)
def test_burst_kernel(compiled, isolated, gap_kind):
    c = compiled((isolated, gap_kind))
    assert c.ptx_count(r"st\.global\.v4\.b32") >= 1, "bursts must be 128-bit stores"
    assert c.ptx_count(r"%globaltimer") >= 3 and c.ptx_count(r"%clock64") >= (4 if isolated else 3)
    assert c.ptx_count(r"red\.release\.sys\.global\.add") == 1, "one system-scope completion flag per producer"
    assert c.ptx_count(r"ld\.acquire\.gpu") >= 1, "the start barrier waits with acquire loads"
    fmas = c.ptx_count(r"fma\.rn\.f32")
    assert fmas >= 8 if gap_kind == "fma" else fmas == 0, fmas  # the FMA gap's 8 chains; none in a spin gap
    # isolated: a fence.acq_rel.sys after each burst, plus the one before the completion flag
    assert c.ptx_count(r"fence\.acq_rel\.sys") == (2 if isolated else 1)


def test_flag_wait_kernel_is_bounded(compiled):
    c = compiled("flag_wait")
    assert c.ptx_count(r"ld\.acquire\.sys") >= 1
    assert c.ptx_count(r"%globaltimer") >= 1, "the wait must be bounded by a deadline"
    assert c.ptx_count(r"atom\.global\.sys\.cas") >= 1, "timeouts must set the error word"


@pytest.mark.parametrize("name", VARIANTS + ["flag_wait"], ids=lambda v: v if isinstance(v, str) else
                         f"{'isolated' if v[0] else 'periodic'}-{v[1]}")
def test_calibration_kernels_use_no_local_memory(compiled, no_spills, name):
    no_spills(compiled(name).ptx)
