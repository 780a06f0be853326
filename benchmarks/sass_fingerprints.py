"""SASS fingerprints of the attention kernels (no GPU): each kernel compiled for sm_90a from fake tensors, its
instruction stream hashed (nvdisasm's instructions, without the kernel's mangled name), so a refactor can show
that the kernels it did not mean to change are byte-identical, and which ones moved.

    python -m benchmarks.sass_fingerprints --out FILE.json                 # fingerprint this tree
    python -m benchmarks.sass_fingerprints --check benchmarks/results/sass_fingerprints.json

``--check`` compares with a stored file (its "kernels" entry) and exits 1 if a kernel it lists differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

# name -> FlashAttentionA2AForward options (bf16 unless dtype is "fp16"); the defaults' kernels first
KERNELS = {
    "local_d128": {"head_dim": 128, "mode": "local"},
    "local_d64": {"head_dim": 64, "mode": "local"},
    "local_d128_fp16": {"dtype": "fp16", "head_dim": 128, "mode": "local"},
    "local_d128_rounds": {"head_dim": 128, "mode": "local", "walk": "rounds"},
    "local_d128_tail": {"head_dim": 128, "mode": "local", "walk": "tail"},
    "local_d128_spans": {"head_dim": 128, "mode": "local", "instrument": True},
    "local_d64_spans": {"head_dim": 64, "mode": "local", "instrument": True},
    "pb2_all": {"head_dim": 128, "mode": "piggyback", "n_dst": 2},
    "pb2_all_paced": {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "store": "paced"},
    "pb2_rounds": {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "walk": "rounds"},
    "pb2_rounds_paced": {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "walk": "rounds", "store": "paced"},
    "pb2_tail": {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "walk": "tail"},
    "pb2_tail_relay": {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "walk": "tail", "relay": True},
    "pb2_spans": {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "instrument": True},
    "cc2_all": {"head_dim": 128, "mode": "completion_coupled", "n_dst": 2},
    "cc2_rounds": {"head_dim": 128, "mode": "completion_coupled", "n_dst": 2, "walk": "rounds"},
    "cc2_tail": {"head_dim": 128, "mode": "completion_coupled", "n_dst": 2, "walk": "tail"},
    "pb2_d64": {"head_dim": 64, "mode": "piggyback", "n_dst": 2},
    "pb2_d64_paced": {"head_dim": 64, "mode": "piggyback", "n_dst": 2, "store": "paced"},
    "pb4_all": {"head_dim": 128, "mode": "piggyback", "n_dst": 4},
}


def instructions(sass_text: str) -> list[str]:
    """The instruction stream of nvdisasm's output (one entry per instruction, operands included)."""
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass_text)]


def fingerprint(options: dict) -> dict:
    import cutlass
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel, sass
    from flash_a2a.attention import FlashAttentionA2AForward

    opts = dict(options)
    dtype = cutlass.Float16 if opts.pop("dtype", "bf16") == "fp16" else cutlass.BFloat16
    k = FlashAttentionA2AForward(dtype, **opts)
    text = sass(compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True)).cubin)
    if text is None:
        raise SystemExit("no nvdisasm on this machine (it comes with triton): cannot fingerprint the SASS")
    ins = instructions(text)
    return {"instructions": len(ins), "sha256": hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sass_fingerprints", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the fingerprints as JSON here")
    p.add_argument("--check", help="a stored fingerprints JSON: exit 1 where a kernel it lists differs")
    p.add_argument("--only", nargs="*", choices=sorted(KERNELS), help="these kernels only")
    args = p.parse_args(argv)
    got = {}
    for name in args.only or KERNELS:
        got[name] = fingerprint(KERNELS[name])
        print(f"{name:20s} {got[name]['sha256']}  {got[name]['instructions']} instructions", flush=True)
    if args.out:
        from cute_kernels.runtime import git_commit

        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "kernels": got, "options": {n: KERNELS[n] for n in got}}, f, indent=1)
    if args.check:
        with open(args.check) as f:
            stored = json.load(f)["kernels"]
        moved = [n for n in got if n in stored and stored[n]["sha256"] != got[n]["sha256"]]
        print(f"{len(got) - len(moved)} of {len(got)} identical to {args.check}"
              + (f"; moved: {moved}" if moved else ""))
        return 1 if moved else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
