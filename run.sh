#!/usr/bin/env bash
# The main job. With two or more GPUs with peer access: calibrate this machine (remote-store
# microbenchmarks, fitted profile, Figure 3) and run the design test on the fresh profile.
# Without GPUs: the design test on the profile shipped in the repository (H200x2 if present, else the paper's).
set -euo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${XSTAGE_OUT:-results}
mkdir -p "$out"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -ge 2 ]; then
  xstage calibrate --out "$out/calibration"
  xstage design-test --profile "$out/calibration/calibration.json" --preset all --out "$out/design-test.png"
else
  echo "no multi-GPU machine here ($gpus GPU(s)): design test on the shipped profile"
  xstage design-test --preset all --out "$out/design-test.png"
fi
