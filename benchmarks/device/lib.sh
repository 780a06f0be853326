# What every machine script in benchmarks/device/ shares; sourced by them, never run on its own.
# A machine script sets MACHINE, NOMINAL_GPUS, STAGES (every stage name), ALL (the default order) and one
# function stage_<name> per stage, then calls `main "$@"`.
set -euo pipefail
# Never NVLink multicast (it can take a shared host's GPUs out of service): kept set for every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/xstage-out}
DRY_RUN=${DRY_RUN:-}
read -r -a XSTAGE <<< "${XSTAGE_CMD:-python3 -m xstage}"  # the xstage command (no console script there)
# The working tree travels without .git: pass XSTAGE_GIT_COMMIT=$(git rev-parse --short HEAD) in the command.
COMMIT=${XSTAGE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ "$COMMIT" = unknown ] || export XSTAGE_GIT_COMMIT=$COMMIT
TAG=$(printf %s "$COMMIT" | tr -c 'A-Za-z0-9._-' '-')  # file names that come back hold only these
# Seconds from this script's start to its end: the 600 s call less the bundle's install; a stage starts only
# if its timeout fits in what is left (less PACK_RESERVE_S for pack), so the call ends inside its limit.
CALL_BUDGET_S=${CALL_BUDGET_S:-575}
PACK_RESERVE_S=15
T0=$(date +%s)
RECORDS=()

show() {  # print a command as it can be pasted
  local a line="+"
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then line+=" $a"; else line+=" '${a//\'/\'\\\'\'}'"; fi
  done
  echo "$line"
}
left_s() { echo $((T0 + CALL_BUDGET_S - PACK_RESERVE_S - $(date +%s))); }
skip() { echo "skipped $LABEL: $*"; echo "$LABEL" >> "$W/.skipped"; exit 0; }

# needs GPUS TIMEOUT: the stage needs GPUS visible GPUs and TIMEOUT seconds ($<STAGE>_TIMEOUT overrides it),
# else it is skipped with the reason. Sets T (the timeout) and ARGS ($<STAGE>_ARGS, appended to the
# stage's command, so a later option overrides the default's).
needs() {
  local var="${STAGE^^}_TIMEOUT" args="${STAGE^^}_ARGS" left
  T=${!var:-$2}
  read -r -a ARGS <<< "${!args:-}"
  left=$(left_s)
  ((GPUS >= $1)) || skip "needs $1 GPU(s), $GPUS visible"
  [ -n "$DRY_RUN" ] || ((T <= left)) || skip "its ${T}s timeout does not fit the ${left}s left of this call"
  echo "(timeout ${T}s; ${left}s left of the call's ${CALL_BUDGET_S}s)"
  [ -z "$DRY_RUN" ] || echo "$T" >> "$W/.timeouts"
}
# logged CMD...: print CMD; unless DRY_RUN, run it under `timeout $T`, its output also in $LOG.
logged() {
  show timeout "$T" "$@"
  [ -n "$DRY_RUN" ] && return 0
  timeout -k 5 "$T" "$@" 2>&1 | tee -a "$LOG"
}
# keep_out_of_pack FILE: a FILE over PACK_FILE_MB MiB (default 8; a call brings back files of 16 MiB at most,
# the pack's included) is moved to $UNPACKED_DIR (/tmp/xstage-unpacked: left on the machine, not packed).
keep_out_of_pack() {
  local mb=${PACK_FILE_MB:-8} dest=${UNPACKED_DIR:-/tmp/xstage-unpacked} size
  show keep_out_of_pack "$1" "(over ${mb} MiB: to $dest/)"
  [ -n "$DRY_RUN" ] && return 0
  [ -f "$1" ] || return 0
  size=$(($(stat -c %s "$1") / 1048576))
  ((size > mb)) || return 0
  mkdir -p "$dest" && mv "$1" "$dest/"
  echo "$1: ${size} MiB, over ${mb} MiB: moved to $dest/ (not packed)" | tee -a "$LOG"
}
variants_file() {  # NAME or a path -> the variant-set file
  if [ -f "$1" ]; then echo "$1"; else echo "benchmarks/variants/$1.json"; fi
}
# What a variants run leaves out: it times the sets beside fa_ours, fused and fa4 alone.
VARIANT_SKIP=(fa_ours_plain_order cudnn a2a_nccl a2a_symm pre_a2a_nccl pre_a2a_symm serial_ours_nccl serial_fa4_nccl
  fused_cc fused_visible)
set_name() { local base=${1##*/}; echo "${base%.json}"; }  # the set's name in result and log names

stage_info() {  # machine, driver, software versions, commit and the multicast switches: device_info.txt
  needs 0 60
  LOG=$W/device_info.txt
  if ((GPUS > 0)); then
    logged nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
    ((GPUS < 2)) || logged nvidia-smi topo -m
  fi
  logged uname -srm
  logged python3 -c 'import os, platform, torch, cutlass
try:
    import flash_attn; fa = getattr(flash_attn, "__version__", "present")
except Exception as e:
    fa = "missing (%s)" % type(e).__name__
print("commit", os.environ.get("XSTAGE_GIT_COMMIT", "unknown"), "| python", platform.python_version(),
      "| torch", torch.__version__, "cuda", torch.version.cuda, "| dsl", cutlass.__version__, "| flash_attn", fa,
      "| gpus", torch.cuda.device_count())
print(*(k + "=" + os.environ.get(k, "unset") for k in
        ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")))'
}

stage_pack() {  # $W into $OUT/<machine>_<commit>.tgz, the commit in every name; device info and summary beside
  local dir="$OUT/${MACHINE}_$TAG" e name
  show pack "$W" into "$dir.tgz" and "$OUT/{device_info,stages}_$TAG.txt"
  [ -n "$DRY_RUN" ] && return 0
  printf '%s\n' "${RECORDS[@]}" > "$W/stages.txt"
  rm -rf "$dir" && mkdir -p "$dir"
  for e in "$W"/*; do
    name=${e##*/}
    case $name in
      *"$TAG"*) ;;
      *.*) name="${name%%.*}_$TAG.${name#*.}" ;;
      *) name="${name}_$TAG" ;;
    esac
    mv "$e" "$dir/$name"
  done
  tar czf "$dir.tgz" -C "$OUT" "${dir##*/}"
  cp "$dir/stages_$TAG.txt" "$OUT/"
  [ ! -f "$dir/device_info_$TAG.txt" ] || cp "$dir/device_info_$TAG.txt" "$OUT/"
  rm -rf "$dir" "$W"
  ls -l "$OUT"
}

usage() { sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; }

main() {
  local plan=() item i=0 rc t1 pack= failed=() skipped=()
  [ $# -gt 0 ] || set -- all
  case $1 in
    -h | --help) usage; return 0 ;;
    --list) printf '%s\n' "${STAGES[@]}"; return 0 ;;
  esac
  local words=() w
  for w in "$@"; do if [ "$w" = all ]; then words+=("${ALL[@]}"); else words+=("$w"); fi; done
  while ((i < ${#words[@]})); do  # the plan, checked whole before anything runs
    item=${words[i]}
    if [ "$item" = variants ]; then
      i=$((i + 1))
      [ $i -lt ${#words[@]} ] && [ -f "$(variants_file "${words[i]}")" ] || {
        echo "variants needs a set:" "$(cd benchmarks/variants && ls -- *.json | sed 's/\.json$//' | xargs)" >&2
        return 2
      }
      plan+=("variants:${words[i]}")
    elif [ "$item" = pack ]; then pack=pack  # always last: it takes $W away
    elif [[ " ${STAGES[*]} " == *" $item "* ]]; then plan+=("$item")
    else echo "unknown stage '$item'; stages: ${STAGES[*]}" >&2; return 2
    fi
    i=$((i + 1))
  done
  [ -z "$pack" ] || plan+=(pack)
  if [ -n "$DRY_RUN" ]; then GPUS=${GPUS:-$NOMINAL_GPUS}
  else GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
  fi
  W=$OUT/$MACHINE
  mkdir -p "$W" && rm -f "$W/.skipped" "$W/.timeouts"
  [ "$COMMIT" != unknown ] || echo "commit unknown (no .git here): pass XSTAGE_GIT_COMMIT=<commit>"
  echo "$MACHINE: commit $COMMIT, $GPUS GPU(s), ${CALL_BUDGET_S}s budget${DRY_RUN:+, dry run (nothing runs)};" \
    "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST" \
    "NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS; plan: ${plan[*]}"
  for item in "${plan[@]}"; do
    STAGE=${item%%:*}
    LABEL=$STAGE
    if [ "$STAGE" = variants ]; then  # what stage_variants reads: VARIANT_FILE, and VARIANT_SET for its names
      VARIANT_FILE=$(variants_file "${item#variants:}") VARIANT_SET=$(set_name "${item#variants:}")
      LABEL=variants_$VARIANT_SET
    fi
    LOG=$W/$LABEL.log
    t1=$(date +%s)
    echo "=== $LABEL $(date -u +%T)"
    set +e
    # set -e holds inside the subshell (it would not inside `||`): a stage stops at its first failure
    (set -e; "stage_$STAGE")
    rc=$?
    set -e
    if grep -qx "$LABEL" "$W/.skipped" 2>/dev/null; then skipped+=("$LABEL"); rc=skipped
    elif [ "$rc" != 0 ]; then failed+=("$LABEL")
    fi
    RECORDS+=("$LABEL rc=$rc $(($(date +%s) - t1))s")
  done
  echo "=== summary ($(($(date +%s) - T0))s): ${RECORDS[*]/%/;}"
  [ -z "$DRY_RUN" ] || [ ! -f "$W/.timeouts" ] || echo "dry run: the timeouts add up to" \
    "$(($(paste -sd+ "$W/.timeouts")))s; a real call starts each stage only while its timeout fits what is left"
  [ ${#skipped[@]} -eq 0 ] ||
    echo "not run here: ${skipped[*]} (next call: bash $0 ${skipped[*]/#variants_/variants } pack)"
  [ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; return 1; }
}
