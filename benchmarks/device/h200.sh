#!/usr/bin/env bash
# One device call on nvidia-h200 (one GPU). From the repository root, with .devbundle carried:
#   bash .devbundle/install.sh && export PYTHONPATH=$PWD &&
#     XSTAGE_GIT_COMMIT=<commit> bash benchmarks/device/h200.sh [STAGE...]   (no stage: all)
# Stages:
#   info            nvidia-smi, driver, torch/DSL/flash-attn versions, commit: device_info.txt
#   tests           the GPU tests (pytest -m "gpu or multigpu", MegaMoE's included: TESTS_ARGS="-k megamoe" for
#                   those alone); multi-GPU ones skip with their reason
#   sass            the KV loop's SASS beside flash-attn-4's (python -m benchmarks.kv_loop_sass)
#   calibrate       xstage calibrate: the local control only (remote calibration needs 2 GPUs)
#   fa              FA-only against flash-attn-4 and cuDNN at P = 1 (xstage bench flash-a2a, no A2A columns)
#   clocks          SM clock and power under FA-only and flash-attn-4 (python -m benchmarks.fa_clocks)
#   variants NAME   FA-only beside the set in benchmarks/variants/NAME.json (or a path to one)
#   compare         an older commit's FA-only beside this tree's, one process (python -m benchmarks.old_vs_new;
#                   prepare .oldtree here with --prepare COMMIT and carry it); COMPARE_WHAT=moe: its MegaMoE
#                   instead (python -m benchmarks.megamoe_old_vs_new, W8A8 and bf16 at 8192 tokens, world 1);
#                   COMPARE_PATCH=NAME: this tree's MegaMoE (old, exported here) against a copy of it with
#                   docs/experiments/NAME.patch applied (new), whose MegaMoE GPU tests run first; NAME+NAME2
#                   applies both, in that order (a patch written on top of another); A,B+C times each variant
#                   against the same old in one call (the first variant's tests only)
#   moe             xstage bench megamoe, every column (bf16 and W8A8, both orders, the unfused paths), then
#                   schedule="auto"'s regret on it (python -m benchmarks.megamoe_auto)
#   moedump         the matrix with --dump at emulated P = 2, 8192 tokens (dsv4-flash, qwen3-moe, dit-moe; bf16
#                   and W8A8; --max-minutes 3), then its stall test, spans and timelines (benchmarks.megamoe_analysis)
#   pack            every result into $OUT/h200_<commit>.tgz (the commit in each name); always runs last
#   all             info tests sass calibrate fa pack
# Each stage runs under its own timeout (<STAGE>_TIMEOUT) and starts only if that fits what is left of the
# call (CALL_BUDGET_S, 575 s); the summary names the stages left for the next call. <STAGE>_ARGS appends
# options to a stage's command (e.g. FA_ARGS="--seq-lens 16384 32768"). Logs and results: $OUT/h200/.
# --list prints the stages; DRY_RUN=1 prints every command instead of running it (GPUS=N to pretend N GPUs).

set -euo pipefail
MACHINE=h200
NOMINAL_GPUS=1
STAGES=(info tests sass calibrate fa clocks variants compare moe moedump pack all)
ALL=(info tests sass calibrate fa pack)
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

stage_tests() {
  needs 1 300
  logged python3 -m pytest -q -rs -m "gpu or multigpu" tests "${ARGS[@]}"
}
stage_sass() {  # compiled here for sm_90a from fake tensors: no GPU needed
  needs 0 240
  logged env CUTE_DSL_ARCH=sm_90a python3 -m benchmarks.kv_loop_sass --out "$W/kv_loop_sass.json" "${ARGS[@]}"
}
stage_calibrate() {
  needs 1 240
  logged "${XSTAGE[@]}" calibrate --machine "$MACHINE" --out "$W/calibration" "${ARGS[@]}"
}
# At P = 1 the bench leaves out every column that needs a peer (All-to-All, serial, fused) and says so; the
# plain-order FA-only column is fa_ours itself there.
stage_fa() {  # 10 rounds, 48 adjacent (ours, FA4) pairs per shape
  needs 1 540
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/fa_only.json" --replays 10 --pairs 48 --no-spans \
    --skip fa_ours_plain_order "${ARGS[@]}"
}
stage_clocks() {
  needs 1 240
  logged python3 -m benchmarks.fa_clocks --out "$W/fa_clocks.json" "${ARGS[@]}"
}
stage_variants() {  # a set's FA-only columns (its fused ones need a peer): 8 rounds, 32 pairs per column
  needs 1 300
  logged "${XSTAGE[@]}" bench flash-a2a --out "$W/variants_$VARIANT_SET.json" --seq-lens 16384 32768 --replays 8 \
    --pairs 32 --no-spans --skip fa_ours_plain_order cudnn --variants "$VARIANT_FILE" "${ARGS[@]}"
}

stage_compare() {  # old against new by adjacent pairs, with an old-against-old noise column
  needs 1 "$([ -n "${COMPARE_PATCH:-}" ] && echo 540 || echo 420)"
  [ -z "${COMPARE_PATCH:-}" ] || { compare_patch; return; }
  [ -n "$DRY_RUN" ] || [ -f .oldtree/COMMIT ] || skip "no .oldtree (python -m benchmarks.old_vs_new --prepare COMMIT, then carry .oldtree)"
  if [ "${COMPARE_WHAT:-fa}" = moe ]; then
    logged env PYTHONPATH="$PYTHONPATH:$REPO/.oldtree" python3 -m benchmarks.megamoe_old_vs_new \
      --out "$W/megamoe_old_vs_new.json" "${ARGS[@]}"
  else
    logged env PYTHONPATH="$PYTHONPATH:$REPO/.oldtree" python3 -m benchmarks.old_vs_new --out "$W/old_vs_new.json" \
      "${ARGS[@]}"
  fi
}
compare_patch() {  # no git, no carried tree: old is exported from this tree, each new a patched copy of it
  local old=/tmp/xstage-old t=$T variant name list k=0 share rc=0
  local -a variants names paths patch_lists  # patch_lists[k]: variant k's patch paths, space-separated
  IFS=, read -ra variants <<< "$COMPARE_PATCH"
  for variant in "${variants[@]}"; do  # every patch checked before any step runs
    IFS=+ read -ra names <<< "$variant"
    paths=()
    for name in "${names[@]}"; do
      [ -f "$REPO/docs/experiments/$name.patch" ] || skip "no $REPO/docs/experiments/$name.patch"
      paths+=("$REPO/docs/experiments/$name.patch")
    done
    patch_lists+=("${paths[*]}")
  done
  T=60
  logged python3 -m benchmarks.old_vs_new --prepare WORKTREE --old "$old"
  T=30  # a copy of the tree and its patches: seconds
  for list in "${patch_lists[@]}"; do
    read -ra paths <<< "$list"
    logged bash -c 'rm -rf "$0" && mkdir "$0" && tar -C "$1" --exclude=./.devbundle --exclude=./.venv \
      --exclude=./.git --exclude=./.oldtree -cf - . | tar -C "$0" -xf - &&
      for p in "${@:2}"; do patch -d "$0" -p1 -s < "$p" || exit 1; done' \
      "/tmp/xstage-new$k" "$REPO" "${paths[@]}"
    k=$((k + 1))
  done
  T=${COMPARE_TESTS_TIMEOUT:-240}  # the first variant's tests; a failing test is reported, the timing still runs
  logged env -C /tmp/xstage-new0 PYTHONPATH=/tmp/xstage-new0 python3 -m pytest -q -rs -m gpu tests/megamoe \
    -p no:cacheprovider || rc=$?
  [ "$rc" -eq 0 ] || echo "the patched copy's GPU tests: rc $rc (124: out of time, which is not a failure)" |
    tee -a "$LOG"
  share=$(((t - 60 - 30 * k - T) / k))
  k=0
  for variant in "${variants[@]}"; do
    T=$share
    logged env -C "/tmp/xstage-new$k" PYTHONPATH="/tmp/xstage-new$k:$old" XSTAGE_GIT_COMMIT="$COMMIT+$variant" \
      python3 -m benchmarks.megamoe_old_vs_new --old "$old" --out "$W/megamoe_$variant.json" "${ARGS[@]}"
    k=$((k + 1))
  done
}
stage_moe() {  # 36 rows x 6 columns (W4A8's 2 more columns do not fit the call: run them with --columns); the
  # regret tool needs no GPU
  needs 1 420
  logged "${XSTAGE[@]}" bench megamoe --replays 6 --out "$W/megamoe.json" \
    --columns unfused_bf16,unfused_fp8,ours_bf16_wave,ours_bf16_interleaved,ours_fp8_wave,ours_fp8_interleaved "${ARGS[@]}"
  logged python3 -m benchmarks.megamoe_auto "$W/megamoe.json" --out "$W/megamoe_auto_regret.json"
}
stage_moedump() {  # the matrix (~100 s planned with its dump) under T less the analysis' 60 s
  needs 1 300
  local t=$T
  T=$((t - 60))
  logged "${XSTAGE[@]}" bench megamoe --matrix --world 2 --ranks emulated --tokens 8192 \
    --shapes dsv4-flash,qwen3-moe,dit-moe --precision bf16,w8a8 --trials 5 --max-minutes 3 \
    --out "$W/megamoe_dump_matrix.json" --dump "$W/megamoe_dump" "${ARGS[@]}"
  T=60
  logged python3 -m benchmarks.megamoe_analysis "$W/megamoe_dump.json" --out-dir "$W"
  keep_out_of_pack "$W/megamoe_dump.npz"
}

main "$@"
