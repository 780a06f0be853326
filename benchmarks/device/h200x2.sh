#!/usr/bin/env bash
# One device call on nvidia-h200-x2: install the carried DSL bundle, run every test (GPU tests included),
# then the full calibration. Logs and results land under $OUT (results packed in one archive).
# Usage there: bash .devbundle/install.sh && export PYTHONPATH=$PWD && bash benchmarks/device/h200x2.sh [stage...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/xstage-out}
mkdir -p "$OUT"
stages=${*:-"info tests calibrate fa dit pack"}

# protocol_diag NAME LOG VARIANTS: FA-only, fused and the fused VARIANTS (JSON) at M = $FADIAG_SEQ (default
# 8K), 10 rounds, every residual from 48 aligned adjacent-launch pairs, no spans, nothing else timed.
protocol_diag() {
  timeout ${FA_TIMEOUT:-300} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/$1.json" \
    --seq-lens ${FADIAG_SEQ:-8192} --replays 10 --alternate-min-us 0 --no-spans --skip fa_ours_no_overlap \
    fa_ours_lag_v fa_ours_pin_all fa_ours_unpinned fa_ours_plain_order fa_ours_nonpersistent pre_a2a_nccl \
    pre_a2a_symm cudnn a2a_nccl a2a_symm serial_ours_nccl fused_cc fused_visible fa4 serial_fa4_nccl \
    --variants "$3" 2>&1 | tee "$OUT/$2.log"
}
# pair_diag NAME LOG SEQS VARIANTS [SKIP... OPTION...]: the named columns and variants beside FA-only (and FA4
# unless skipped) at M = $FADIAG_SEQ (default SEQS), 8 rounds, 32 adjacent pairs per column, no spans; the
# trailing words add to the --skip list, then any further options (e.g. --heads-per-rank 3).
pair_diag() {
  local name=$1 log=$2 seqs=$3 variants=$4
  shift 4
  timeout ${FA_TIMEOUT:-300} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/$name.json" \
    --seq-lens ${FADIAG_SEQ:-$seqs} --replays 8 --alternate-pairs ${FADIAG_PAIRS:-32} --alternate-min-us 0 --no-spans \
    --skip fa_ours_no_overlap fa_ours_lag_v fa_ours_nonpersistent fa_ours_pin_all fa_ours_unpinned \
    fa_ours_plain_order cudnn a2a_nccl a2a_symm pre_a2a_nccl pre_a2a_symm serial_ours_nccl fused_cc \
    fused_visible "$@" --variants "$variants" 2>&1 | tee "$OUT/$log.log"
}
diag_12h48k() {
  # 12 heads/rank at M = 49152 (where H sits at the 0.9 line): FA-only, fused and the variants, no FA4 columns
  pair_diag "$1" "$2" "49152" "$3" fa4 serial_fa4_nccl --heads-per-rank 12
}
for stage in $stages; do
  echo "=== $stage $(date -u +%T)"
  case $stage in
    info)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/info.txt"
      nvidia-smi topo -m | tee -a "$OUT/info.txt"
      python3 -c 'import torch, cutlass; print("torch", torch.__version__, "cuda", torch.version.cuda, "dsl", cutlass.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/info.txt" ;;
    tests)
      timeout 420 python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest.log" ;;
    calibrate)
      timeout 420 python3 -m calibrate.cli calibrate --machine h200x2 --out "$OUT/h200x2" 2>&1 | tee "$OUT/calibrate.log" ;;
    gputests)
      timeout ${GPUTESTS_TIMEOUT:-420} python3 -m pytest -q -rs -m "gpu or multigpu" tests 2>&1 | tee "$OUT/pytest_gpu.log" ;;
    fatests)
      timeout 300 python3 -m pytest -q -x -rs tests/test_flash_attention.py tests/test_flash_a2a_scatter.py 2>&1 | tee "$OUT/pytest_fa.log" ;;
    fa)
      # FA_ARGS overrides the default, which fills one device call on its own (all 10 rows in 558 s with
      # install at 6c95827: 5 rounds and 20 pairs of 6 kinds, the unsplit default kernel as an FA-only variant
      # beside the split-tail default), without the variant columns measured before (RUNS.md; the self-store
      # control runs in fadiag/faparts). The JSON is rewritten after every row, so a run cut short keeps its rows.
      # Since 23a6417 also --alternate-min-us 0: the 3 heads/8K row's residual and ratios from pairs too (its
      # round-paired E_res was +7.2 µs at 6c95827 where 32 pairs gave +3.7 in fa_split_c46d572; a few seconds).
      fa_default='--replays 5 --alternate-pairs 20 --alternate-min-us 0 --skip fa_ours_no_overlap fa_ours_lag_v
        fa_ours_nonpersistent fa_ours_pin_all fa_ours_unpinned --variants {"nosplit":{"tail_split":false}}'
      timeout ${FA_TIMEOUT:-548} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/flash_a2a.json" \
        ${FA_ARGS:-$fa_default} 2>&1 | tee "$OUT/fa.log" ;;
    faonly)
      # FA-only against flash-attn-4 and cuDNN at every shape of the main run, 10 rounds, and for T_FA >= 500 µs
      # 48 adjacent alternating (ours, FA4) launch pairs (fa4_over_ours_paired: immune to the clock drift
      # between rounds that moved single columns by up to 7% at 12 heads/48K); no fused, A2A or spans columns.
      timeout ${FA_TIMEOUT:-300} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/fa_only.json" \
        --replays 10 --alternate-pairs 48 --no-spans --skip fa_ours_no_overlap fa_ours_lag_v fa_ours_nonpersistent \
        fa_ours_pin_all fa_ours_unpinned a2a_nccl a2a_symm pre_a2a_nccl pre_a2a_symm serial_ours_nccl fused \
        fused_cc fused_visible serial_fa4_nccl 2>&1 | tee "$OUT/faonly.log" ;;
    fapins)
      # FA-only mainloop schedules not measured before: pin_softmax 8/16/24 (18/26/34 of 66 exponentials ahead
      # of the PV wait; the default's first_row gives 51) and pin 8 without rescale_before_pv (10 ahead, O
      # rescaled after the PV wait: FA4's SM90 loop issues 10 there), beside the default and FA4, at M =
      # $FADIAG_SEQ (default 16K/32K), 8 rounds, 32 adjacent pairs per variant (against the default) and for FA4.
      timeout ${FA_TIMEOUT:-240} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/fa_pins.json" \
        --seq-lens ${FADIAG_SEQ:-16384 32768} --replays 8 --alternate-pairs 32 --no-spans --skip fa_ours_no_overlap \
        fa_ours_lag_v fa_ours_nonpersistent fa_ours_pin_all fa_ours_unpinned fa_ours_plain_order cudnn a2a_nccl \
        a2a_symm pre_a2a_nccl pre_a2a_symm serial_ours_nccl fused fused_cc fused_visible serial_fa4_nccl \
        --variants '{"pin8":{"pin_softmax":8},"pin16":{"pin_softmax":16},"pin24":{"pin_softmax":24},"fa4like":{"pin_softmax":8,"rescale_before_pv":false}}' \
        2>&1 | tee "$OUT/fapins.log" ;;
    fadiag)
      # Decomposes the fused residual (M = $FADIAG_SEQ, default 8K): fused_self_nosig - fa_ours (epilogue code),
      # fused_self - fused_self_nosig (flag protocol), fused - fused_self (NVLink stores); spans of both kernels
      # (clock, time between bursts); FA-only one CTA per tile (FA4's SM90 launch); TMA-store epilogues
      # (first_row and pin 34, which schedules the mainloop like the default's 51 of 66 exponentials).
      timeout ${FA_TIMEOUT:-300} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/fused_diag.json" \
        --seq-lens ${FADIAG_SEQ:-8192} --replays 6 --skip fa_ours_no_overlap fa_ours_lag_v \
        fa_ours_pin_all fa_ours_unpinned fa_ours_plain_order pre_a2a_nccl pre_a2a_symm cudnn \
        --variants '{"self":{"mode":"piggyback","self_store":true},"self_nosig":{"mode":"piggyback","self_store":true,"signal":false},"nosig":{"mode":"piggyback","signal":false},"tma":{"store":"tma"},"tma34":{"store":"tma","pin_softmax":34},"pbtma":{"mode":"piggyback","store":"tma"},"pbtma34":{"mode":"piggyback","store":"tma","pin_softmax":34}}' \
        2>&1 | tee "$OUT/fadiag.log" ;;
    faparts)
      # Prices the flag protocol's parts at M = $FADIAG_SEQ (default 8K), with and without NVLink: without the
      # completion fence ("nofence"), without the ready wait ("done"), without both ("done_nofence").
      protocol_diag fused_parts faparts '{"self":{"mode":"piggyback","self_store":true},"self_nosig":{"mode":"piggyback","self_store":true,"signal":false},"self_nofence":{"mode":"piggyback","self_store":true,"signal":"nofence"},"self_done":{"mode":"piggyback","self_store":true,"signal":"done"},"self_donenf":{"mode":"piggyback","self_store":true,"signal":"done_nofence"},"nosig":{"mode":"piggyback","signal":false},"nofence":{"mode":"piggyback","signal":"nofence"},"done":{"mode":"piggyback","signal":"done"}}' ;;
    faready)
      # The ready wait's cost (faparts at bf4aabc: +1.2/+4.4 µs at 3/12 heads per rank, 8K), taken apart:
      # the gate's barrier arrival without the poll ("gate_only") and the poll with a 500 ns back-off, beside
      # the full protocol and no ready wait ("done"), with and without NVLink.
      protocol_diag fused_ready faready '{"self":{"mode":"piggyback","self_store":true},"self_done":{"mode":"piggyback","self_store":true,"signal":"done"},"self_gate":{"mode":"piggyback","self_store":true,"signal":"gate_only"},"self_sleep":{"mode":"piggyback","self_store":true,"ready_poll_ns":500},"done":{"mode":"piggyback","signal":"done"},"gate":{"mode":"piggyback","signal":"gate_only"},"sleep":{"mode":"piggyback","ready_poll_ns":500}}' ;;
    fareadyspans)
      # Where the ready wait's cost comes from (faparts at 8fc9d76: ~0.65% of T_FA at every shape, the whole
      # residual at 32K): the protocol's parts beside a 50 µs delay before the first poll, with the per-CTA
      # ready rows of an instrumented launch (poll time, first-tile gate wait) in spans_ready.
      timeout ${FA_TIMEOUT:-300} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/fused_ready_spans.json" \
        --seq-lens ${FADIAG_SEQ:-16384 32768} --replays 10 --alternate-min-us 0 --skip fa_ours_no_overlap \
        fa_ours_lag_v fa_ours_pin_all fa_ours_unpinned fa_ours_plain_order fa_ours_nonpersistent pre_a2a_nccl \
        pre_a2a_symm cudnn a2a_nccl a2a_symm serial_ours_nccl fused_cc fused_visible fa4 serial_fa4_nccl \
        --variants '{"self":{"mode":"piggyback","self_store":true},"self_done":{"mode":"piggyback","self_store":true,"signal":"done"},"self_gate":{"mode":"piggyback","self_store":true,"signal":"gate_only"},"self_delay":{"mode":"piggyback","self_store":true,"ready_delay_ns":50000},"delay":{"mode":"piggyback","ready_delay_ns":50000},"done":{"mode":"piggyback","signal":"done"}}' \
        2>&1 | tee "$OUT/fareadyspans.log" ;;
    fawalk)
      # The crossed tile walk (flash_a2a.mapping.tile_halves) beside the default walk at M = $FADIAG_SEQ: fused and
      # self-store columns of both, FA-only in the crossed walk, and the ready-wait control ("done").
      FADIAG_SEQ=${FADIAG_SEQ:-8192 16384 32768} protocol_diag fused_walk fawalk '{"cross":{"mode":"piggyback","cross_halves":true},"self":{"mode":"piggyback","self_store":true},"self_cross":{"mode":"piggyback","self_store":true,"cross_halves":true},"done":{"mode":"piggyback","signal":"done"},"xfa":{"cross_halves":true}}' ;;
    fareadywait)
      # Where the ready wait runs (ready_wait): the idle warp with relaxed polls and one fence (default), with
      # acquire polls, or thread 0 of each storing warpgroup before its first stores; beside no ready wait ("done").
      FADIAG_SEQ=${FADIAG_SEQ:-8192 16384 32768} protocol_diag fused_ready_wait fareadywait '{"epi":{"mode":"piggyback","ready_wait":"epilogue"},"acquire":{"mode":"piggyback","ready_wait":"warp_acquire"},"done":{"mode":"piggyback","signal":"done"},"self":{"mode":"piggyback","self_store":true},"self_epi":{"mode":"piggyback","self_store":true,"ready_wait":"epilogue"}}' ;;
    fagputests)
      timeout ${GPUTESTS_TIMEOUT:-300} python3 -m pytest -q -x -rs -m "gpu or multigpu" tests/test_flash_attention.py \
        tests/test_flash_a2a_scatter.py 2>&1 | tee "$OUT/pytest_fa_gpu.log" ;;
    fapaced)
      # store="paced" (a tile's stores spread over the next tile's Q-loop) beside the default burst epilogue,
      # at M = $FADIAG_SEQ: pace 1 and 2 KV blocks per vector, pin_softmax 34 and 40 (53 of 66 exponentials
      # ahead of the PV wait with the in-loop stores, the nearest to the default's 51), and the self-store control of
      # the burst and the paced epilogue (what NVLink adds to each).
      protocol_diag fused_paced fapaced '{"paced":{"mode":"piggyback","store":"paced"},"paced2":{"mode":"piggyback","store":"paced","pace_kv":2},"paced34":{"mode":"piggyback","store":"paced","pin_softmax":34},"paced40":{"mode":"piggyback","store":"paced","pin_softmax":40},"self":{"mode":"piggyback","self_store":true},"self_paced":{"mode":"piggyback","self_store":true,"store":"paced"}}' ;;
    fapacedsplit)
      # store="paced" at the pin-40 default, now split like the default where "auto" splits (its tail launch
      # stores its local chunks in bursts): pace_kv=2, peeled (pace 1 and 2), the self-store controls of the
      # burst and of pace_kv=2, beside FA-only, fused and FA4, at M = $FADIAG_SEQ (default 8K/16K/32K), 8 rounds,
      # 32 adjacent pairs per column (run at 53f1f5c: fused_paced_split_53f1f5c)
      pair_diag fused_paced_split fapacedsplit "8192 16384 32768" '{"paced2":{"mode":"piggyback","store":"paced","pace_kv":2},"peel":{"mode":"piggyback","store":"paced","peel_drip":true},"self":{"mode":"piggyback","self_store":true},"self_paced2":{"mode":"piggyback","self_store":true,"store":"paced","pace_kv":2},"peel2":{"mode":"piggyback","store":"paced","peel_drip":true,"pace_kv":2}}' serial_fa4_nccl ;;
    fapacedall)
      # pace_kv=2 against the burst epilogue at every shape of the main run, with both self-store controls,
      # 8 rounds, 32 adjacent pairs per column, no FA4: the data of the per-shape choice (store="auto",
      # mapping.paced_store_pays; run at 7c35388, before "auto", as fused_paced_all_7c35388, where "fused" and
      # "self" were the burst). Since "auto" the default ("fused") is the choice; "burst" names the burst.
      pair_diag fused_paced_all fapacedall "8192 16384 32768 49152 65536" '{"burst":{"mode":"piggyback","store":"st"},"paced2":{"mode":"piggyback","store":"paced","pace_kv":2},"self":{"mode":"piggyback","self_store":true,"store":"st"},"self_paced2":{"mode":"piggyback","self_store":true,"store":"paced","pace_kv":2}}' fa4 serial_fa4_nccl ;;
    fatma)
      # The fused rounds kernel's peer stores through the TMA engine ("tma": one tensor store per 64-row half;
      # "bulk": cp.async.bulk per row) with the launch split (the tail launch stores its local chunks in bursts),
      # beside the default and the self-store controls of the burst and of TMA, at M = $FADIAG_SEQ (default 8K:
      # 3 heads/8K's one round of 96 peer tiles, 3 MiB against Q = 2.4 MiB, is the residual H misses by).
      pair_diag fused_tma fatma "8192" '{"burst":{"mode":"piggyback","store":"st"},"tma":{"mode":"piggyback","store":"tma"},"bulk":{"mode":"piggyback","store":"bulk"},"self":{"mode":"piggyback","self_store":true,"store":"st"},"self_tma":{"mode":"piggyback","self_store":true,"store":"tma"}}' fa4 serial_fa4_nccl ;;
    farelay)
      # relay (the launch split's rounds kernel stores its peer tiles into local shadows, the tail launch's MMA
      # threads send them on under their chunks' Q-loops): the default ("auto": relays at 3 heads/8K, the one-round
      # rounds kernel), relay off, relay forced (refused where the walk has no launch split, e.g. 12 heads/8K: the
      # column then records the ValueError), and the self-store controls of both, at M = $FADIAG_SEQ (default 8K),
      # 32 adjacent pairs each.
      pair_diag fused_relay farelay "8192" '{"norelay":{"mode":"piggyback","relay":false},"relay":{"mode":"piggyback","relay":true},"self":{"mode":"piggyback","self_store":true,"relay":false},"self_relay":{"mode":"piggyback","self_store":true,"relay":true}}' fa4 serial_fa4_nccl ;;
    farelaystart)
      # the relay's first event (its griddepcontrol.wait and first load) at KV block 2 (the default), 8 and 16 of
      # the chunk's Q-loop, without the wait (a control), and the self-store controls, at 3 heads/8K
      pair_diag fused_relay_start farelaystart "8192" '{"norelay":{"mode":"piggyback","relay":false},"relay8":{"mode":"piggyback","relay":true,"relay_start":8},"relay16":{"mode":"piggyback","relay":true,"relay_start":16},"nowait":{"mode":"piggyback","relay":true,"relay_wait":false},"self":{"mode":"piggyback","self_store":true,"relay":false},"self_relay8":{"mode":"piggyback","self_store":true,"relay":true,"relay_start":8},"self_nowait":{"mode":"piggyback","self_store":true,"relay":true,"relay_wait":false}}' fa4 serial_fa4_nccl --heads-per-rank 3 ;;
    fa48parts)
      # 12 heads/48K, where H measured 0.995, 0.873, 0.773 and 0.851 with the same kernels (3e0381a-5dbe015): the
      # fused default beside its self-store control (no NVLink), 32 pairs each against FA-only, so a real NVLink
      # residual (fused above self) can be told from the pairs' noise (the serial excess there: 764-940 µs)
      pair_diag fa_48parts fa48parts "49152" '{"self":{"mode":"piggyback","self_store":true}}' fa4 --heads-per-rank 12 ;;
    fa48sig)
      # 12 heads/48K: fa48parts put fused and its self-store control both ~+100 µs over FA-only (75 and 122, 32
      # pairs), so the residual there is not NVLink's. The flag protocol's parts without NVLink: self-store with
      # no protocol (signal=False), with the completion flags but no ready gate ("done"), and the remote
      # stores with no protocol, beside the default and its self-store control.
      diag_12h48k fa_48sig fa48sig '{"self":{"mode":"piggyback","self_store":true},"selfnosig":{"mode":"piggyback","self_store":true,"signal":false},"selfdone":{"mode":"piggyback","self_store":true,"signal":"done"},"nosig":{"mode":"piggyback","signal":false}}' ;;
    fa48ctl)
      # 12 heads/48K with 96 pairs each (the crossover split, order_balanced_us): an A/A control (FA-only
      # against itself rebuilt with the same knobs: the estimator's zero), and the fused protocol's parts with
      # and without NVLink (fa48sig's 48 pairs left them within 2-3 standard errors of each other).
      diag_12h48k fa_48ctl fa48ctl '{"same":{"pin_softmax":40},"self":{"mode":"piggyback","self_store":true},"selfnosig":{"mode":"piggyback","self_store":true,"signal":false},"nosig":{"mode":"piggyback","signal":false},"done":{"mode":"piggyback","signal":"done"}}' ;;
    fa48cs)
      # 12 heads/48K, 96 pairs each: the output stores with the streaming cache operator (store_cache="cs",
      # st.global.cs: evict-first in L2) in FA-only, fused and the self-store control, beside the defaults.
      diag_12h48k fa_48cs fa48cs '{"cs":{"store_cache":"cs"},"pbcs":{"mode":"piggyback","store_cache":"cs"},"self":{"mode":"piggyback","self_store":true},"selfcs":{"mode":"piggyback","self_store":true,"store_cache":"cs"}}' ;;
    fa48buf)
      # (run at d8a07f6: FA-only into the symmetric buffer -2 µs from FA-only, fa_48buf_d8a07f6.json)
      # 12 heads/48K, 96 pairs each: FA-only storing into the fused op's symmetric buffer ("out": "symmetric",
      # the same kernel as fa_ours) beside the fused default and its self-store control. Whether the fused
      # kernel's launch-to-launch spread there (pair quartiles ~0 and +250 µs where an A/A control of FA-only
      # has -15 and +11, fa_48ctl_b818648.json) comes with the buffer it writes, not with its own code.
      diag_12h48k fa_48buf fa48buf '{"sym":{"out":"symmetric"},"self":{"mode":"piggyback","self_store":true}}' ;;
    fasplitgpu)
      # the fused split-tail GPU test alone (relay, TMA/bulk rounds, graph replays): a quick check before the rest
      timeout ${GPUTESTS_TIMEOUT:-300} python3 -m pytest -q -x -rs tests/test_flash_attention.py -k \
        "tail_split or split_tail" 2>&1 | tee "$OUT/pytest_split_gpu.log" ;;
    farepeat)
      # One point of the main run again, in a short run (the paper repeats noisy points so): FA-only, fused, the
      # serial composition and its FA-only in plain order, NCCL A2A, at M = $FADIAG_SEQ (default 64K) and
      # $FA_HEADS (default 12) heads per rank, 5 rounds, 64 adjacent pairs per residual (the main run's 20 pairs
      # of 40 ms kernels put the serial excess's quartiles at -108 and +1492 µs at 12 heads/64K).
      timeout ${FA_TIMEOUT:-240} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/fa_repeat.json" \
        --seq-lens ${FADIAG_SEQ:-65536} --heads-per-rank ${FA_HEADS:-12} --replays 5 --alternate-pairs ${FADIAG_PAIRS:-64} \
        --alternate-min-us 0 --no-spans --skip fa_ours_no_overlap fa_ours_lag_v fa_ours_nonpersistent \
        fa_ours_pin_all fa_ours_unpinned cudnn a2a_symm pre_a2a_nccl pre_a2a_symm fused_cc fused_visible fa4 \
        serial_fa4_nccl 2>&1 | tee "$OUT/farepeat.log" ;;
    fahiding)
      # H at the two long 12-heads/rank shapes, where one 20-pair run cannot place it on either side of 0.9
      # (intervals 0.79-0.98 at 48K, 0.22-0.96 at 64K in flash_a2a.json of 94be979): farepeat's columns (FA-only in
      # both orders, serial ours + NCCL, fused, NCCL A2A) at 48K and 64K, $FADIAG_PAIRS (default 128) pairs each,
      # 3 rounds; ~150 s + ~270 s. Pool with the earlier runs: xstage bench flash-a2a --pool-hiding A.json B.json
      # $FAHIDING_NAME (default fa_hiding) names the JSON and log, so one call can hold several repeats.
      timeout ${FA_TIMEOUT:-560} python3 -m calibrate.cli bench flash-a2a --out "$OUT/h200x2/${FAHIDING_NAME:-fa_hiding}.json" \
        --seq-lens ${FADIAG_SEQ:-49152 65536} --heads-per-rank 12 --replays 3 --alternate-pairs ${FADIAG_PAIRS:-128} \
        --alternate-min-us 0 --no-spans --skip fa_ours_no_overlap fa_ours_lag_v fa_ours_nonpersistent \
        fa_ours_pin_all fa_ours_unpinned cudnn a2a_symm pre_a2a_nccl pre_a2a_symm fused_cc fused_visible fa4 \
        serial_fa4_nccl 2>&1 | tee "$OUT/${FAHIDING_NAME:-fa_hiding}.log" ;;
    faq2)
      # q_stages=2 (the next tile's Q loaded a tile ahead, so no warpgroup waits for it at a tile boundary)
      # beside the default, FA-only and fused, and FA4, at M = $FADIAG_SEQ, 8 rounds, 32 adjacent pairs each.
      pair_diag fa_q2 faq2 "8192 16384 32768" '{"q2":{"q_stages":2},"pbq2":{"mode":"piggyback","q_stages":2}}' serial_fa4_nccl ;;
    fapad)
      # FA-only with 32 KiB of unused shared memory (smem_pad_kib, the 228 KB carveout instead of 196 KB: 28 KB
      # of L1 instead of 60) beside the default and FA4: what the footprint alone costs (q_stages=2 takes that
      # carveout too), at M = $FADIAG_SEQ, 8 rounds, 32 adjacent pairs each.
      pair_diag fa_pad fapad "8192 16384 32768" '{"pad32":{"smem_pad_kib":32}}' fused serial_fa4_nccl ;;
    facluster)
      # cluster_kv=2 (CTA pairs share each K/V block through TMA multicast: half the L2->SM traffic of the KV
      # loop, FA3's cluster for d >= 128) FA-only and fused beside the defaults and FA4, at M = $FADIAG_SEQ,
      # 8 rounds, 32 adjacent pairs each.
      pair_diag fa_cluster facluster "8192 16384 32768" '{"cl2":{"cluster_kv":2},"pbcl2":{"mode":"piggyback","cluster_kv":2}}' serial_fa4_nccl ;;
    faclusterpin)
      # cluster_kv=2 moves ptxas's KV loop to 46 of 66 exponentials ahead of the PV wait (the default: 51);
      # pin_softmax=34 brings it to 52: that pair beside the defaults and FA4 (as facluster)
      pair_diag fa_cluster_pin faclusterpin "16384 32768" '{"cl2p34":{"cluster_kv":2,"pin_softmax":34},"pbcl2p34":{"mode":"piggyback","cluster_kv":2,"pin_softmax":34}}' serial_fa4_nccl ;;
    faclusterpins)
      # cluster_kv=2 moved the best exponential window: pin 34 (52 ahead) was slower than the cluster's own 46;
      # fewer ahead (pin 24: 34, pin 16: 26, unpinned: 4) beside cluster_kv=2 (46), the default and FA4
      pair_diag fa_cluster_pins faclusterpins "16384 32768" '{"cl2":{"cluster_kv":2},"cl2p24":{"cluster_kv":2,"pin_softmax":24},"cl2p16":{"cluster_kv":2,"pin_softmax":16},"cl2p0":{"cluster_kv":2,"pin_softmax":false}}' fused serial_fa4_nccl ;;
    fat160)
      # tile_n=160 (KV blocks of 160 rows, FA3's direction: fewer per-block fixed costs per column) with ptxas's
      # own window (82 of 82 exponentials ahead of the PV wait) and pin 36 (40 of 80), unsplit, beside the
      # unsplit and default kernels and FA4, at lengths that 160 and 2 x 128 divide, 32 adjacent pairs each
      pair_diag fa_t160 fat160 "16640 32000" '{"nosplit":{"tail_split":false},"t160":{"tile_n":160,"tail_split":false},"t160p36":{"tile_n":160,"pin_softmax":36,"tail_split":false}}' fused serial_fa4_nccl ;;
    fath)
      # rescale_threshold=8 (a row keeps its max until a block raises it by > 2^8, so most blocks skip the 64
      # O-rescale FMULs behind a warp-uniform branch; FA4's SM100 trick) FA-only beside the default and FA4,
      # 16K/32K, 8 rounds, 32 adjacent pairs each
      pair_diag fa_th fath "16384 32768" '{"th8":{"rescale_threshold":8.0}}' fused serial_fa4_nccl ;;
    fathtune)
      # with rescale_threshold=8: the O rescale after the PV wait (rescale_before_pv=False: 58 of 66
      # exponentials ahead of the PV wait), pin 40 (52), every exponential pinned (66), against the threshold
      # alone (51) and FA4, 16K/32K, 8 rounds, 32 adjacent pairs each (run at 7167ecc: fa_thtune_7167ecc)
      pair_diag fa_thtune fathtune "16384 32768" '{"th8":{"rescale_threshold":8.0},"th8nb":{"rescale_threshold":8.0,"rescale_before_pv":false},"th8p40":{"rescale_threshold":8.0,"pin_softmax":40},"th8all":{"rescale_threshold":8.0,"pin_softmax":true}}' fused serial_fa4_nccl ;;
    fathres)
      # The fused residual with and without rescale_threshold: the default (threshold 8) FA-only and fused
      # beside threshold 0 FA-only and fused, and the fused kernel storing to its own buffer (the self-store
      # control: what NVLink adds), 16K/32K, 8 rounds, 32 adjacent pairs each, no FA4
      pair_diag fa_thres fathres "16384 32768" '{"th0":{"rescale_threshold":0.0},"fth0":{"mode":"piggyback","rescale_threshold":0.0},"fself":{"mode":"piggyback","self_store":true}}' fa4 serial_fa4_nccl ;;
    fathparts)
      # With rescale_threshold=8 the fused residual stays with the self-store control (fa_thres_06b4d0d): the
      # protocol's parts priced beside it, no flags at all (nosig), no ready wait (done), polls backed off
      # 256 ns (poll256), the self-store control without flags (selfnosig), 16K/32K, 32 pairs each, no FA4
      pair_diag fa_thparts fathparts "16384 32768" '{"nosig":{"mode":"piggyback","signal":false},"done":{"mode":"piggyback","signal":"done"},"poll256":{"mode":"piggyback","ready_poll_ns":256},"selfnosig":{"mode":"piggyback","self_store":true,"signal":false}}' fa4 serial_fa4_nccl ;;
    fasymm)
      # With rescale_threshold=8 the fused residual (~1.6% of T_FA) stays without NVLink and without flags
      # (fa_thparts_99eed69) and with the KV loop moved in the code (a319365, fa_align): FA-only storing into the
      # fused op's symmetric buffer (the destination memory alone), beside the defaults, 16K/32K, 32 pairs
      pair_diag fa_symm fasymm "16384 32768" '{"symm":{"out":"symmetric"},"selfnosig":{"mode":"piggyback","self_store":true,"signal":false}}' fa4 serial_fa4_nccl ;;
    fathp40)
      # rescale_threshold=8 with pin 40 was the fastest FA-only in fa_thtune_7167ecc (-0.7..-1.1%): FA-only and
      # fused with it beside the defaults and FA4, 16K/32K, 8 rounds, 32 adjacent pairs each
      pair_diag fa_thp40 fathp40 "16384 32768" '{"p40":{"pin_softmax":40},"fp40":{"mode":"piggyback","pin_softmax":40}}' serial_fa4_nccl ;;
    fasplit64)
      # the split tail at M = 64K (12 heads/rank: k = 9, one launch's quartiles spanned -26..+318 us at a4eba34)
      # against the unsplit kernel and FA4, FA-only, 8 rounds, 32 adjacent pairs each
      pair_diag fa_split64 fasplit64 "65536" '{"nosplit":{"tail_split":false}}' fused serial_fa4_nccl ;;
    fatw)
      # try_wait (each K/V wait of the Q-loop probes the barrier first, as FA4's SM90 loop does; ptxas then
      # issues 61 of 66 exponentials ahead of the PV wait) alone and with pin_softmax=36 (53), FA-only beside
      # the default and FA4, at M = $FADIAG_SEQ, 8 rounds, 32 adjacent pairs each.
      pair_diag fa_tw fatw "16384 32768" '{"tw":{"try_wait":true},"tw36":{"try_wait":true,"pin_softmax":36}}' fused serial_fa4_nccl ;;
    fatail)
      # tail_split (the last round's tiles in KV chunks over the CTAs that would idle, combined by the last
      # chunk's CTA) with the default pin (ptxas then issues 61 of 66 exponentials ahead of the PV wait) and
      # pin_softmax=34 (50), FA-only beside the default and FA4, at M = $FADIAG_SEQ, 8 rounds, 32 pairs each.
      # (The default is the split tail in a second launch since 6c95827; before, the unsplit kernel.)
      pair_diag fa_tail fatail "8192 32768" '{"tail":{"tail_split":true},"tail34":{"tail_split":true,"pin_softmax":34}}' fused serial_fa4_nccl ;;
    fatailfused)
      # tail_split in the fused kernel (its last round is local tiles, so the combining CTA stores locally)
      # beside the default fused and FA-only, FA-only with tail_split and FA4, at M = $FADIAG_SEQ (default 8K,
      # where the last round splits in 2), 8 rounds, 32 adjacent pairs per column.
      pair_diag fa_tail_fused fatailfused "8192" '{"tail":{"tail_split":true},"ftail":{"mode":"piggyback","tail_split":true}}' --heads-per-rank 3 ;;
    fasplit)
      # The default since 2026-11-30, the split tail in a second launch (tail_split="auto": the whole rounds in
      # the default kernel, then the last round's KV chunks, a programmatic dependent launch), beside the
      # unsplit kernel and the one-launch split, FA-only and fused, and FA4, at M = $FADIAG_SEQ (default
      # 8K/32K), 8 rounds, 32 adjacent pairs per column.
      pair_diag fa_split fasplit "8192 32768" '{"nosplit":{"tail_split":false},"kernel":{"tail_split":true},"fnosplit":{"mode":"piggyback","tail_split":false}}' ;;
    faturn)
      # The walk's destination turn (turn_destinations=True: each CTA's destination rank turns by one per round
      # in the first stretch, so every CTA takes its share of the remote bursts) against the default walk,
      # fused and FA-only, at M = $FADIAG_SEQ (default 8K/32K), 8 rounds, 32 adjacent pairs per column; no FA4.
      # (fa_turn_c0c3b00 ran it with the turn as the default and the walk without it as the variants.)
      pair_diag fa_turn faturn "8192 32768" '{"turn":{"turn_destinations":true},"fturn":{"mode":"piggyback","turn_destinations":true}}' fa4 serial_fa4_nccl ;;
    fapeel)
      # store="paced" with the vector-carrying KV blocks peeled into a loop of their own (peel_drip), so the
      # plain overlapped loop holds no store, beside the predicated paced loop and the default burst, with the
      # self-store controls (what NVLink adds to each), at M = $FADIAG_SEQ.
      FADIAG_SEQ=${FADIAG_SEQ:-8192 16384} protocol_diag fused_peel fapeel '{"paced":{"mode":"piggyback","store":"paced"},"peel":{"mode":"piggyback","store":"paced","peel_drip":true},"peel2":{"mode":"piggyback","store":"paced","peel_drip":true,"pace_kv":2},"self":{"mode":"piggyback","self_store":true},"self_peel":{"mode":"piggyback","self_store":true,"store":"paced","peel_drip":true}}' ;;
    faearly)
      # early_done (a measured alternative): a CTA with a local tail tile raises its peers' data flags from the
      # idle warp once its peer stores are out, leaving a GPU-scope fence and its own flag on the last path:
      # right after its last tile before the tail ("early": the fence then runs under the tail tile's Q-loop)
      # or once its final tile's Q-loop is done ("last": the fence overlaps only that tile's epilogue);
      # beside the default (every flag at the end), with and without NVLink.
      # (fused_early_89dce51.json ran with early_done the default: its "late" columns are today's default.)
      FADIAG_SEQ=${FADIAG_SEQ:-8192 16384} protocol_diag fused_early faearly '{"early":{"mode":"piggyback","early_done":true},"last":{"mode":"piggyback","early_done":"last_epilogue"},"self":{"mode":"piggyback","self_store":true},"self_last":{"mode":"piggyback","self_store":true,"early_done":"last_epilogue"}}' ;;
    faclocks)
      # SM clock, power and clock-event reasons (nvidia-smi every 20 ms) while our FA-only and FA4 run back to
      # back from CUDA Graphs, alternating, 6 phases of 1.5 s per shape (12 heads/48K, 3 heads/32K and 16K:
      # unsplit, where FA4 leads by ~2%; 12 heads/32K, split, at parity), one GPU (benchmarks/fa_clocks.py).
      mkdir -p "$OUT/h200x2"
      timeout ${FA_TIMEOUT:-240} python3 benchmarks/fa_clocks.py --out "$OUT/h200x2/fa_clocks.json" 2>&1 \
        | tee "$OUT/faclocks.log" ;;
    fusedclocks)
      # SM clock, power and clock-event reasons on both GPUs (nvidia-smi every 20 ms) while FA-only, the fused
      # op (sender-side and complete), its self-store control, the serial compositions (ours + NCCL or our
      # symmetric scatter, FA4 + NCCL) and FA4 run back to back from CUDA Graphs, taking turns, 6 phases of
      # 1.5 s per shape (12 heads/48K, 12 heads/32K, 3 heads/64K): is the fused residual cycles or clock?
      # (At the power cap it is clock: flash_a2a_variants/fused_clocks_d8a07f6.json.) FUSED_CLOCKS_ARGS adds
      # options, e.g. --seconds 1.0 --no-fa4 --skip fused_self --variants '{"rf":{"mode":"piggyback",...}}'
      # (JSON without spaces: the variable is split on them).
      mkdir -p "$OUT/h200x2"
      timeout ${FA_TIMEOUT:-300} python3 benchmarks/fused_clocks.py --out "$OUT/h200x2/fused_clocks.json" \
        ${FUSED_CLOCKS_ARGS:-} 2>&1 | tee "$OUT/fusedclocks.log" ;;
    fusedclocksstores)
      # At the power cap (as fusedclocks), the fused op with its peer stores through the TMA engine
      # (store="tma": per-tile tensor maps; "bulk": 1-D bulk copies of padded rows) beside the "st" burst
      # default and ours + NCCL, at 12 heads/48K, 12 heads/32K and 3 heads/64K: whether how the stores reach
      # NVLink changes the clock they cost (fused_clocks_d8a07f6.json: 15-75 MHz at equal cycles).
      mkdir -p "$OUT/h200x2"
      timeout ${FA_TIMEOUT:-300} python3 benchmarks/fused_clocks.py --out "$OUT/h200x2/fused_clocks_stores.json" \
        --seconds 1.0 --no-fa4 --skip fused_visible fused_self serial_ours_symm \
        --variants '{"tma":{"mode":"piggyback","store":"tma"},"bulk":{"mode":"piggyback","store":"bulk"}}' 2>&1 \
        | tee "$OUT/fusedclocksstores.log" ;;
    fusedclocksawake)
      # At the power cap (as fusedclocks), FA-only beside FA-only whose every launch also stores 16 bytes into
      # the peer (NVLink kept out of its 50 ms low-power state, as in a model whose every step uses it: +29.5 W
      # per GPU, link_power.py) and its local-store control, the fused op and the serial compositions: the
      # fused residual and H over FA-only with the links awake.
      mkdir -p "$OUT/h200x2"
      timeout ${FA_TIMEOUT:-300} python3 benchmarks/fused_clocks.py --out "$OUT/h200x2/fused_clocks_awake.json" \
        --seconds 1.0 --no-fa4 --skip fused_self ${FUSED_CLOCKS_ARGS:-} 2>&1 | tee "$OUT/fusedclocksawake.log" ;;
    fusedclockssplit)
      # At the power cap (as fusedclocks), at the shapes where "auto" splits the tail into a second launch and
      # where the fused kernel (sender-side) loses 52-83 MHz in all seven cap runs so far (12 heads/32K, 3
      # heads/64K; unsplit shapes 11-30): the fused kernel and FA-only unsplit (tail_split=False) beside the
      # defaults and ours + NCCL.
      mkdir -p "$OUT/h200x2"
      timeout ${FA_TIMEOUT:-240} python3 benchmarks/fused_clocks.py --out "$OUT/h200x2/fused_clocks_split.json" \
        --seconds 1.0 --no-fa4 --shapes 1x32768x12 1x65536x3 --skip fused_visible fused_self serial_ours_symm \
        fa_ours_tiny fa_ours_awake --variants '{"nosplit":{"mode":"piggyback","tail_split":false},"unsplit":{"tail_split":false}}' \
        ${FUSED_CLOCKS_ARGS:-} 2>&1 | tee "$OUT/fusedclockssplit.log" ;;
    linkpower)
      # Board power and SM clock on both GPUs while each trickles (or saturates) remote stores into its peer,
      # against the same burst kernel storing into local memory (L2: one ring slot), and idle (benchmarks/link_power.py): whether the
      # fused kernel's clock cost at the power cap is the links' active state (a fixed power) or per byte.
      mkdir -p "$OUT/h200x2"
      timeout ${FA_TIMEOUT:-240} python3 benchmarks/link_power.py --out "$OUT/h200x2/link_power.json" \
        ${LINK_POWER_ARGS:-} 2>&1 | tee "$OUT/linkpower.log" ;;
    dit)
      timeout ${DIT_TIMEOUT:-300} torchrun --nproc-per-node 2 examples/dit_ulysses.py --seq-len 8192 2>&1 | tee "$OUT/dit.log" ;;
    pack)
      tar czf "$OUT/h200x2.tgz" -C "$OUT" h200x2 && rm -rf "$OUT/h200x2" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
