"""Host-side helpers: dtype maps, error-word checks, provenance of the machine and software."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata

import cutlass

from .flags import ERROR_NAMES, ERROR_WORDS

try:
    import torch

    TORCH_TO_CUTLASS = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
    }
except ImportError:  # pragma: no cover - torch is a dependency
    TORCH_TO_CUTLASS = {}


class XStageKernelError(RuntimeError):
    """A kernel reported an error through its error word (a bounded wait timed out)."""


def new_error_word(device):
    import torch

    return torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)


def check_error_word(errors, what: str) -> None:
    """Raise ``XStageKernelError`` if the kernel wrote an error code (synchronizes with the device)."""
    code, block, seen = (int(x) for x in errors[:3].tolist())
    if code:
        raise XStageKernelError(f"{what}: {ERROR_NAMES.get(code, f'error code {code}')} "
                                f"(block {block}, value seen {seen})")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=cwd or os.path.dirname(os.path.abspath(__file__)), check=False)
        return out.stdout.strip() or None
    except OSError:
        return None


def provenance(command: str | None = None) -> dict:
    """Device, driver, software versions, git commit and date for result files."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl") or getattr(cutlass, "__version__", None),
        "git_commit": os.environ.get("XSTAGE_GIT_COMMIT") or git_commit(),
        "command": command,
    }
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(device=props.name, device_count=torch.cuda.device_count(),
                        sm_count=props.multi_processor_count, cuda_runtime=torch.version.cuda)
    except Exception:  # noqa: BLE001 - provenance is best effort
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=20)
        if out.returncode == 0:
            info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return info
