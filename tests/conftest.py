"""Shared pytest setup: GPU tests skip, with the reason, where no suitable GPU is present."""
from __future__ import annotations

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
