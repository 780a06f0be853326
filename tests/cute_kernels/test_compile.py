"""cute_kernels.compile: kernels compile for sm_90a on fake tensors (no GPU needed) with PTX and cubin kept, the
tile store kernel is what it claims to be, and the ptxas report is read or refused, never read as zeros."""
from __future__ import annotations

import re
import subprocess

import pytest

pytest.importorskip("cutlass")

from cutlass.runtime import make_fake_stream  # noqa: E402

from cute_kernels import compile as ck  # noqa: E402
from cute_kernels.compile import compile_kernel  # noqa: E402


def compile_checked(kernel, tmp_path):
    """compile_kernel into a dump folder that does not exist yet (the helper must create it), with the PTX
    (for sm_90a) and the cubin kept, and the PTX in that folder."""
    dump = tmp_path / "dump" / "nested"
    c = compile_kernel(kernel, *kernel.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                       dump_dir=str(dump))
    assert c.ptx and c.cubin, "PTX and cubin must be kept"
    assert ".target sm_90a" in c.ptx
    assert any(p.suffix == ".ptx" for p in dump.iterdir()), "PTX must land in the dump directory"
    return c


@pytest.fixture(scope="module")
def tile_store(tmp_path_factory):
    from cute_kernels.tile_store import TileStoreKernel

    k = TileStoreKernel()
    return k, compile_checked(k, tmp_path_factory.mktemp("tile_store"))


def test_tile_store_kernel_is_vectorized_and_timed(tile_store):
    k, c = tile_store
    assert c.ptx_count(r"ld\.global\.v4\.b32") >= 1, "expected 128-bit loads"
    # The timed region: between the span's two %globaltimer reads, every store of the CTA's tile and nothing
    # narrower than 128 bits.
    assert c.ptx_count(r"%globaltimer") == 2 and c.ptx_count(r"%clock64") == 2
    timed = c.ptx.split("%globaltimer")[1]
    stores = re.findall(r"st\.global\.[\w.]+", timed)
    per_thread = k.tile_m * k.tile_n * (k.dtype.width // 8) // (16 * k.threads)  # the tile in 16-byte stores
    assert stores == ["st.global.v4.b32"] * per_thread, stores


def test_tile_store_kernel_uses_no_local_memory(tile_store, no_spills):
    no_spills(tile_store[1].ptx)


def test_compile_rejects_bad_arch():
    from cute_kernels.compile import set_target_arch

    with pytest.raises(ValueError, match="sm_90a"):
        set_target_arch("hopper")


# --- the ptxas -v report ------------------------------------------------------------------------------


ENTRY = "kernel_a_0"
REPORT = f"""ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{ENTRY}' for 'sm_90a'
ptxas info    : Function properties for {ENTRY}
    {{stack}} bytes stack frame, {{stores}} bytes spill stores, {{loads}} bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""
CALLEE = """ptxas info    : Function properties for helper_func
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


def _fake_ptxas(monkeypatch, stderr: str, returncode: int = 0):
    monkeypatch.setattr(ck.shutil, "which", lambda name: "/fake/ptxas")
    monkeypatch.setattr(ck.subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(a, returncode, "", stderr))


def test_ptxas_report_is_read_per_entry(monkeypatch):
    _fake_ptxas(monkeypatch, REPORT.format(stack=0, stores=16, loads=24))
    u = ck.ptxas_resource_usage(".entry x")[ENTRY]
    assert (u.registers, u.stack_bytes, u.spill_stores, u.spill_loads) == (168, 0, 16, 24)


def test_a_callees_local_memory_counts_against_its_entry(monkeypatch):
    _fake_ptxas(monkeypatch, REPORT.format(stack=0, stores=0, loads=0) + CALLEE)
    u = ck.ptxas_resource_usage(".entry x")[ENTRY]
    assert (u.stack_bytes, u.spill_stores, u.spill_loads) == (8, 4, 4)


@pytest.mark.parametrize("drop", ["bytes stack frame", "Used 168 registers", "Compiling entry function"])
def test_a_report_it_cannot_read_is_an_error_not_zero_spills(monkeypatch, drop):
    text = "\n".join(line for line in REPORT.format(stack=0, stores=0, loads=0).splitlines() if drop not in line)
    _fake_ptxas(monkeypatch, text)
    with pytest.raises(RuntimeError, match="cannot read registers and spills"):
        ck.ptxas_resource_usage(".entry x")


def test_missing_or_old_ptxas_gives_none(monkeypatch):
    """None (the tests skip on it with the reason) only where no ptxas can assemble the PTX; any other ptxas
    failure raises."""
    monkeypatch.setattr(ck.shutil, "which", lambda name: None)
    assert ck.ptxas_resource_usage(".entry x") is None
    _fake_ptxas(monkeypatch, "ptxas fatal   : Unsupported .version 9.9; current version is '9.0'", 255)
    assert ck.ptxas_resource_usage(".entry x") is None
    _fake_ptxas(monkeypatch, "ptxas fatal   : syntax error", 255)
    with pytest.raises(RuntimeError, match="ptxas failed"):
        ck.ptxas_resource_usage(".entry x")


def test_register_split_shortfall_reads_the_split_and_the_launch():
    """48 / 232 over 384 threads asks for 128 * 48 + 256 * 232 = 65536 registers; a launch at 168 a thread holds
    64512 (the split that hung MegaMoE, session 24), at 176 it fits; a PTX without one split is refused."""
    from cute_kernels.compile import register_split_shortfall

    ptx = (".entry k() .reqntid 384, 1, 1 {\n setmaxnreg.dec.sync.aligned.u32 \t48;\n"
           " setmaxnreg.inc.sync.aligned.u32 \t232;\n}")
    assert register_split_shortfall(ptx, 168) == 1024
    assert register_split_shortfall(ptx, 176) == 0
    with pytest.raises(ValueError, match="setmaxnreg"):
        register_split_shortfall(".entry k() .reqntid 128, 1, 1 {}", 168)
