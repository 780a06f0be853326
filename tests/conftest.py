"""Shared pytest setup: GPU tests skip, with the reason, where no suitable GPU is present; a fixed, printed
seed per test (``seed``); the ptxas register/spill check of a compiled kernel (``no_spills``)."""
from __future__ import annotations

import os
import zlib

import pytest

from cute_kernels.dist import apply_safe_env

apply_safe_env()  # never NVLink multicast, also in the processes the tests spawn


def _gpu_state() -> tuple[int, str]:
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        return 0, f"kernels target sm_90a; this GPU is sm_{major}{minor}"
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config, items):
    count, why = _gpu_state()
    for item in items:
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason=f"needs an sm_90a GPU: {why}"))
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 2 GPUs with peer access: {why or f'only {count} GPU visible'}"))


@pytest.fixture
def seed(request) -> int:
    """This test's random seed: fixed per test (CRC-32 of its name with its parameters, so every run draws the
    same inputs and two tests draw different ones), or ``XSTAGE_TEST_SEED`` to try another. Printed as
    ``seed=N`` (pytest shows it beside a failure) and kept in the report's user properties; tests also put it
    in their assertion messages. Seed each generator from it: ``random.Random(seed)``,
    ``np.random.default_rng(seed)``, ``torch.Generator().manual_seed(seed)``."""
    value = int(os.environ.get("XSTAGE_TEST_SEED", zlib.crc32(request.node.name.encode()) & 0x7FFFFFFF))
    print(f"seed={value}")
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def no_spills():
    """``no_spills(ptx, arch="sm_90a")``: assemble ``ptx`` with ptxas -v and assert every kernel entry uses no
    local memory (no spill stores or loads, no stack frame) and, where the PTX has a setmaxnreg split, that
    the split fits the launch's registers (``cute_kernels.compile.register_split_shortfall``); returns
    {entry: ResourceUsage} and prints each entry's registers. Skips, with the reason, where no ptxas on PATH
    can assemble this PTX, so the check is never passed without being made."""
    import re
    import shutil
    import subprocess

    from cute_kernels.compile import ptxas_resource_usage, register_split_shortfall

    def check(ptx: str, arch: str = "sm_90a"):
        entries = re.findall(r"\.entry\s+(\w+)", ptx)
        assert entries, "no kernel entry in the PTX: nothing to check"
        usage = ptxas_resource_usage(ptx, arch)
        if usage is None:
            tool = shutil.which("ptxas")
            if tool is None:
                pytest.skip("no ptxas on PATH: cannot check registers and spills")
            version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
            release = re.search(r"release [\d.]+, V[\d.]+", version)
            isa = re.search(r"^\.version\s+(\S+)", ptx, re.M)
            pytest.skip(f"{tool} ({release.group(0) if release else 'unknown version'}) cannot assemble "
                        f"PTX ISA {isa.group(1) if isa else '?'}: cannot check registers and spills")
        assert sorted(usage) == sorted(entries), (sorted(usage), entries)
        for name, u in usage.items():
            print(f"ptxas {arch}: {u.registers} registers, {u.stack_bytes} B stack, {u.spill_stores} B spill "
                  f"stores, {u.spill_loads} B spill loads: {name[:80]}")
            assert u.registers > 0, (name, u.raw)
            assert (u.spill_stores, u.spill_loads, u.stack_bytes) == (0, 0, 0), (name, u)
            if "setmaxnreg" in ptx:  # a warp-specialized split must fit the launch, or setmaxnreg.inc hangs
                short = register_split_shortfall(ptx, u.registers)
                assert short == 0, f"{name}: the register split needs {short} registers more than the launch's"
        return usage

    return check
