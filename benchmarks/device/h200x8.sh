#!/usr/bin/env bash
# Issue 5, the paper's own scale: one call on nvidia-h200-x8 (or -x4 for a 4-GPU point).
# Usage there: bash .devbundle/install.sh && export PYTHONPATH=$PWD && bash benchmarks/device/h200x8.sh
# DRY_RUN=1 prints the commands instead of running them (used to check the script without the machine).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/xstage-out}
gpus=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
machine=h200x$gpus
run() { echo "+ $*"; [ -n "${DRY_RUN:-}" ] || "$@"; }
mkdir -p "$OUT/$machine"
run nvidia-smi topo -m
# GPU tests first (any world size code paths, tested at 2 ranks by the suite).
run timeout 420 python3 -m pytest -q -rs -m "gpu or multigpu" tests
# Calibration over every ordered pair (56 at P = 8): R, T_iss0, Q per pair, all through NVSwitch; then the
# all-to-all injection sweep (every rank to its 7 peers at once) fitted beside it (calibration_all_to_all.json).
run timeout 500 python3 -m calibrate.cli calibrate --machine "$machine" --out "$OUT/$machine" --pairs all
# Table 3 setting: 24 heads over 8 GPUs = 3 heads per rank, M = 8K..64K.
run timeout 500 python3 -m calibrate.cli bench flash-a2a --heads-per-rank 3 --out "$OUT/$machine/flash_a2a.json"
run tar czf "$OUT/$machine.tgz" -C "$OUT" "$machine"
