#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (2 GPUs). From the repository root, with .devbundle carried:
#   bash .devbundle/install.sh && export PYTHONPATH=$PWD &&
#     XSTAGE_GIT_COMMIT=<commit> bash benchmarks/device/h200x2.sh [STAGE...]   (no stage: all)
# Stages:
#   info            nvidia-smi (and topo), driver, torch/DSL/flash-attn versions, commit: device_info.txt
#   tests           every GPU test, the multi-GPU ones included (pytest -m "gpu or multigpu")
#   calibrate       xstage calibrate: every ordered pair and the all-to-all injection sweep
#   fa              the full xstage bench flash-a2a run (all 10 shapes): flash_a2a.json, as in
#                   benchmarks/results/h200x2/; fills a call of its own (~540 s)
#   hiding          H again at 12 heads/rank, 48K and 64K, from 128 adjacent pairs per residual, 3 rounds
#                   (HIDING_NAME names its JSON and log, default fa_hiding; HIDING_ARGS="--pairs 192");
#                   pool runs on the CPU: xstage bench flash-a2a --pool-hiding A.json B.json
#   clocks          SM clock and power under the fused op, FA-only and the serial compositions at the power cap
#                   (python -m benchmarks.fused_clocks)
#   linkpower       board power while remote stores trickle through NVLink (python -m benchmarks.link_power)
#   dit             the DiT example over 2 ranks (torchrun examples/dit_ulysses.py)
#   moe             MegaMoE at real EP = 2 (issue 31, items 3-4), in one call (~550 s): the multi-GPU MegaMoE
#                   test, xstage bench megamoe --world 2 --ranks real (ours beside the NCCL unfused path), the
#                   --matrix at EP = 2 with --dump in what is left (--max-minutes from it; MOE_MATRIX_ARGS=
#                   "--resume F" or "--shapes dsv4-flash" narrows or continues it), the stall test, spans and
#                   timelines of its dump (python -m benchmarks.megamoe_analysis), auto's regret on the bench;
#                   each command under its share of the stage's timeout (test 120 s, bench 220 s, analysis 40 s,
#                   auto 20 s, the matrix the rest); MOE_ARGS goes to the bench (e.g. "--tokens 4096")
#   variants NAME   the set in benchmarks/variants/NAME.json (or a path to one) beside FA-only, fused and FA4
#   pack            every result into $OUT/h200x2_<commit>.tgz (the commit in each name); always runs last
#   all             info tests calibrate fa dit pack (more than one call: the summary names what is left)
# Each stage runs under its own timeout (<STAGE>_TIMEOUT) and starts only if that fits what is left of the
# call (CALL_BUDGET_S, 575 s); the summary names the stages left for the next call. <STAGE>_ARGS appends
# options to a stage's command (FA_ARGS="--seq-lens 8192", VARIANTS_ARGS="--heads-per-rank 3"). A full run is
# about five calls (info tests dit; info fa; calibrate; hiding; moe; each with pack). Results: $OUT/h200x2/.
# --list prints the stages; DRY_RUN=1 prints every command instead of running it (GPUS=N to pretend N GPUs).

set -euo pipefail
MACHINE=h200x2
NOMINAL_GPUS=2
STAGES=(info tests calibrate fa hiding clocks linkpower dit moe variants pack all)
ALL=(info tests calibrate fa dit pack)
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

stage_tests() {
  needs 1 420
  logged python3 -m pytest -q -rs -m "gpu or multigpu" tests "${ARGS[@]}"
}
stage_calibrate() {
  needs 2 420
  logged "${XSTAGE[@]}" calibrate --machine "$MACHINE" --out "$W/calibration" "${ARGS[@]}"
}
stage_fa() {  # 5 rounds, 20 adjacent pairs per residual; the JSON is rewritten after every row. Beside the
  # defaults, FA-only unsplit (splits.json's nosplit: the data of the split rule); its fused half skipped for time
  needs 2 540
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/flash_a2a.json" --replays 5 --pairs 20 \
    --variants benchmarks/variants/splits.json --skip fused_fnosplit "${ARGS[@]}"
}
stage_hiding() {  # the columns H needs: FA-only in both orders, ours + NCCL, fused, the NCCL All-to-All
  needs 2 540
  local name=${HIDING_NAME:-fa_hiding}
  LOG=$W/$name.log
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/$name.json" --seq-lens 49152 65536 --heads-per-rank 12 \
    --replays 3 --pairs 128 --no-spans --skip cudnn a2a_symm pre_a2a_nccl pre_a2a_symm fused_cc fused_visible \
    fa4 serial_fa4_nccl "${ARGS[@]}"
}
stage_clocks() {
  needs 2 300
  logged python3 -m benchmarks.fused_clocks --out "$W/fused_clocks.json" "${ARGS[@]}"
}
stage_linkpower() {
  needs 2 240
  logged python3 -m benchmarks.link_power --out "$W/link_power.json" "${ARGS[@]}"
}
stage_dit() {
  needs 2 200
  logged torchrun --nproc-per-node 2 examples/dit_ulysses.py --seq-len 8192 "${ARGS[@]}"
}
moe_t() {  # T for the stage's next command: $1 s, or what is left of the stage less $2 s if that is less (at
  # least 1 s); a dry run counts each command as taking its whole timeout
  local used=$MOE_USED left
  [ -n "$DRY_RUN" ] || used=$(($(date +%s) - MOE_START))
  left=$((MOE_TOTAL - used - ${2:-0}))
  ((left > 1)) || left=1
  T=$(($1 < left ? $1 : left))
  MOE_USED=$((MOE_USED + T))
}
stage_moe() {  # every command runs even after one fails (the stage then fails); results beside their logs
  needs 2 550
  MOE_START=$(date +%s) MOE_TOTAL=$T MOE_USED=0
  local failed=() mx tenths
  read -r -a mx <<< "${MOE_MATRIX_ARGS:-}"
  moe_t 120
  logged python3 -m pytest -q -rs tests/megamoe/test_megamoe_multigpu.py || failed+=(test)
  moe_t 220
  logged "${XSTAGE[@]}" bench megamoe --world 2 --ranks real --replays 6 --out "$W/megamoe_ep2.json" "${ARGS[@]}" \
    || failed+=(bench)
  moe_t "$MOE_TOTAL" 60  # the rest but the analysis' 40 s and auto's 20 s; --max-minutes leaves 90 s of it
  tenths=$(((T - 90) / 6))  # (start-up, a layer's compile); the dump's compiles and launches are in its estimate
  if ((tenths > 0)); then
    logged "${XSTAGE[@]}" bench megamoe --matrix --world 2 --ranks real --out "$W/megamoe_matrix_ep2.json" \
      --dump "$W/megamoe_matrix_ep2_dump" --max-minutes "$((tenths / 10)).$((tenths % 10))" "${mx[@]}" \
      || failed+=(matrix)
  else echo "no time left for the matrix (${T}s)"
  fi
  moe_t 40
  logged python3 -m benchmarks.megamoe_analysis "$W/megamoe_matrix_ep2_dump.json" --out-dir "$W" \
    || failed+=(analysis)
  keep_out_of_pack "$W/megamoe_matrix_ep2_dump.npz"
  moe_t 20
  logged python3 -m benchmarks.megamoe_auto "$W/megamoe_ep2.json" --out "$W/megamoe_ep2_auto_regret.json" \
    || failed+=(auto)
  ((${#failed[@]} == 0)) || { echo "moe: failed: ${failed[*]}"; return 1; }
}
stage_variants() {  # 8 rounds, 32 adjacent pairs per column, no spans, at 8K/16K/32K
  needs 2 300
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/variants_$VARIANT_SET.json" --seq-lens 8192 16384 32768 \
    --replays 8 --pairs 32 --no-spans --skip "${VARIANT_SKIP[@]}" --variants "$VARIANT_FILE" "${ARGS[@]}"
}

main "$@"
