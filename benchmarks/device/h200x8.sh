#!/usr/bin/env bash
# Issue 5, the paper's own scale: one device call on nvidia-h200-x8 (or -x4 for a 4-GPU point; results then
# go to h200x4). From the repository root, with .devbundle carried:
#   bash .devbundle/install.sh && export PYTHONPATH=$PWD &&
#     XSTAGE_GIT_COMMIT=<commit> bash benchmarks/device/h200x8.sh [STAGE...]   (no stage: all)
# Stages:
#   info            nvidia-smi and topo (NVSwitch), driver, torch/DSL/flash-attn versions, commit: device_info.txt
#   tests           every GPU test (the multi-GPU ones run at 2 ranks)
#   calibrate       xstage calibrate over every ordered pair (56 at P = 8) and the all-to-all injection sweep
#   fa              xstage bench flash-a2a at the paper's Table 3 setting: 24 heads over 8 GPUs (3 per rank)
#   dit             the DiT example over every GPU (24 heads, dim 3072: 128 per head)
#   variants NAME   the set in benchmarks/variants/NAME.json (or a path to one) beside FA-only, fused and FA4
#   pack            every result into $OUT/h200x<P>_<commit>.tgz (the commit in each name); always runs last
#   all             info tests calibrate fa pack (more than one call: the summary names what is left)
# Each stage runs under its own timeout (<STAGE>_TIMEOUT) and starts only if that fits what is left of the
# call (CALL_BUDGET_S, 575 s); <STAGE>_ARGS appends options to a stage's command. Results: $OUT/h200x<P>/.
# --list prints the stages; DRY_RUN=1 prints every command instead of running it (GPUS=N to pretend N GPUs).

set -euo pipefail
NOMINAL_GPUS=8
STAGES=(info tests calibrate fa dit variants pack all)
ALL=(info tests calibrate fa pack)
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [ -n "$DRY_RUN" ]; then P=${GPUS:-$NOMINAL_GPUS}
else P=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
fi
MACHINE=h200x$P  # h200x8, or h200x4 on a 4-GPU machine

stage_tests() {
  needs 1 420
  logged python3 -m pytest -q -rs -m "gpu or multigpu" tests "${ARGS[@]}"
}
stage_calibrate() {
  needs 4 500
  logged "${XSTAGE[@]}" calibrate --machine "$MACHINE" --out "$W/calibration" --pairs all "${ARGS[@]}"
}
stage_fa() {
  needs 4 540
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/flash_a2a.json" --heads-per-rank 3 "${ARGS[@]}"
}
stage_dit() {
  needs 4 200
  logged torchrun --nproc-per-node "$P" examples/dit_ulysses.py --seq-len 8192 --heads 24 --dim 3072 "${ARGS[@]}"
}
stage_variants() {  # 8 rounds, 32 adjacent pairs per column, no spans, 3 heads per rank
  needs 4 300
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/variants_$VARIANT_SET.json" --heads-per-rank 3 \
    --seq-lens 16384 32768 --replays 8 --pairs 32 --no-spans --skip "${VARIANT_SKIP[@]}" \
    --variants "$VARIANT_FILE" "${ARGS[@]}"
}

main "$@"
