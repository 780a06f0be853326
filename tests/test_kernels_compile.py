"""Every kernel compiles for sm_90a on fake tensors (no GPU needed) and is what it claims to be."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from cutlass.runtime import make_fake_stream  # noqa: E402

from cute_kernels.compile import compile_kernel, ptxas_resource_usage  # noqa: E402


def _compile(kernel, tmp_path):
    dump = tmp_path / "dump" / "nested"  # does not exist yet: the helper must create it
    c = compile_kernel(kernel, *kernel.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                       dump_dir=str(dump))
    assert c.ptx and c.cubin, "PTX and cubin must be kept"
    assert ".target sm_90a" in c.ptx
    assert any(p.suffix == ".ptx" for p in dump.iterdir()), "PTX must land in the dump directory"
    return c


def _no_spills(c):
    usage = ptxas_resource_usage(c.ptx, "sm_90a")
    if usage is None:
        pytest.skip("no ptxas on PATH new enough for this PTX: cannot check spills")
    for name, u in usage.items():
        assert u.spill_stores == 0 and u.spill_loads == 0 and u.stack_bytes == 0, (name, u)


def test_tile_store_kernel_is_vectorized_and_timed(tmp_path):
    from cute_kernels.tile_store import TileStoreKernel

    c = _compile(TileStoreKernel(), tmp_path)
    assert c.ptx_count(r"st\.global\.v4\.b32") >= 1, "expected 128-bit stores"
    assert c.ptx_count(r"ld\.global\.v4\.b32") >= 1, "expected 128-bit loads"
    assert not re.search(r"st\.global\.(b16|v2\.b16|b32)\s", c.ptx.split("%globaltimer")[1].split("%globaltimer")[0]), \
        "the timed store region must hold only 128-bit stores"
    assert c.ptx_count(r"%globaltimer") >= 2 and c.ptx_count(r"%clock64") >= 2
    _no_spills(c)


@pytest.mark.parametrize("isolated,gap_kind", [(False, "fma"), (True, "fma"), (False, "spin")])
def test_burst_kernel(tmp_path, isolated, gap_kind):
    from calibrate.burst_kernel import BurstGapKernel

    c = _compile(BurstGapKernel(128, gap_kind, isolated), tmp_path)
    assert c.ptx_count(r"st\.global\.v4\.b32") >= 1, "bursts must be 128-bit stores"
    assert c.ptx_count(r"%globaltimer") >= 3 and c.ptx_count(r"%clock64") >= (4 if isolated else 3)
    assert c.ptx_count(r"red\.release\.sys\.global\.add") == 1, "one system-scope completion flag per producer"
    assert c.ptx_count(r"ld\.acquire\.gpu") >= 1, "the start barrier waits with acquire loads"
    assert (c.ptx_count(r"fma\.rn\.f32") >= 8) == (gap_kind == "fma")
    # isolated: a fence.acq_rel.sys after each burst, plus the one before the completion flag
    assert c.ptx_count(r"fence\.acq_rel\.sys") == (2 if isolated else 1)
    _no_spills(c)


def test_flag_wait_kernel_is_bounded(tmp_path):
    from calibrate.burst_kernel import FlagWaitKernel

    c = _compile(FlagWaitKernel(), tmp_path)
    assert c.ptx_count(r"ld\.acquire\.sys") >= 1
    assert c.ptx_count(r"%globaltimer") >= 1, "the wait must be bounded by a deadline"
    assert c.ptx_count(r"atom\.global\.sys\.cas") >= 1, "timeouts must set the error word"


def test_compile_rejects_bad_arch():
    from cute_kernels.compile import set_target_arch

    with pytest.raises(ValueError):
        set_target_arch("hopper")
