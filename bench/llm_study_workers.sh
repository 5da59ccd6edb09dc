#!/usr/bin/env bash
# The real-LLM seeded study (`tokendyn study --policy smollm2-135m`) as N workers of one thread each, every run's
# small result folder committed (with the report regenerated from every finished folder) as soon as it ends, so a
# stop loses at most the runs in flight. Resumable: finished runs are skipped, a claimed but unfinished run is
# started over by the next call. Usage, from the repository root:
#   bench/llm_study_workers.sh [WORKERS=2] [OUT=docs/study/llm]
#   SAMPLER=vllm bench/llm_study_workers.sh 2     # the sampler mode (OUT docs/study/llm-vllm, reference docs/study/llm)
# ONLY="dppo_tv w_reinforce" restricts the plan to those methods (default: every method); CLAIMS=DIR shares one claims
# folder between invocations started at different times (each then skips the runs another has claimed);
# PLAN="grpo_camps:0 dppo_tv:3" gives the runs and their order outright.
# Logs: runs/llm-study-logs/. Stop: kill the workers; rerun the same command to continue.
set -u
WORKERS=${1:-2}
SAMPLER=${SAMPLER:-generate}
if [ "$SAMPLER" = vllm ]; then
  OUT=${2:-docs/study/llm-vllm}
  MODE=(--use_vllm)
  REPORT=(--use_vllm --reference docs/study/llm)
else
  OUT=${2:-docs/study/llm}
  MODE=()
  REPORT=()
fi
BIN=${BIN:-.venv/bin}
LOGS=runs/llm-study-logs
SHARED=${CLAIMS:+1}
CLAIMS=${CLAIMS:-runs/llm-study-claims.$$}
LOCK=runs/llm-study.lock
mkdir -p "$LOGS" "$CLAIMS"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false SAMPLER
# the plan, seed by seed: the paper's methods and Lopti's controls first, then GRPO again for the both-camps sweep and
# the other camp (so a stop leaves every method of a block with as many seeds as the others)
PLAN=${PLAN:-$("$BIN/python" - <<'PY'
import os

from tokendyn.commands.llm_study import FULL, ORDER, SAMPLER_FULL, SAMPLER_ORDER
if os.environ.get("SAMPLER") == "vllm":  # every sampler method, seed by seed
    plan = [(m, s) for s in SAMPLER_FULL.seeds for m in SAMPLER_ORDER]
else:
    main = [m for m in ORDER[:5]]
    plan = [(m, s) for s in FULL.seeds for m in main] + [(m, s) for s in FULL.seeds for m in ORDER[5:]]
only = set(os.environ.get("ONLY", "").split())
print(" ".join(f"{m}:{s}" for m, s in plan if not only or m in only))
PY
)}

commit_run() {  # $1 method, $2 seed: the report from every finished folder, then one commit of the study's folder
  # (every finished run in it: the report counts them all; a run in flight is a hidden staging folder, ignored)
  flock "$LOCK" bash -c "
    $BIN/tokendyn study --policy smollm2-135m ${REPORT[*]} --out '$OUT' --report-only >>'$LOGS/report.log' 2>&1 || exit 1
    git add '$OUT' &&
    git commit -q -m 'Seeded study on SmolLM2-135M: $1, seed $2 finished (its result folder, the report regenerated)' \
      -- '$OUT'
  " >>"$LOGS/commits.log" 2>&1
}

worker() {
  local id=$1
  for item in $PLAN; do
    local m=${item%%:*} s=${item##*:}
    [ -f "$OUT/runs/$m-s$s/study_done.json" ] && continue
    mkdir "$CLAIMS/$m-s$s" 2>/dev/null || continue  # another worker has it
    if [ "$id" != 0 ]; then  # the starting policy is evaluated once, by worker 0's first run
      while [ ! -f "$OUT/start/study_done.json" ]; do sleep 10; done
    fi
    echo "$(date -u +%FT%TZ) worker $id: $m seed $s" >>"$LOGS/progress.log"
    if "$BIN/tokendyn" study --policy smollm2-135m "${MODE[@]}" --out "$OUT" --methods "$m" --seeds "$s" --no-report \
        --work "runs/llm-study-work-$$-$id" >"$LOGS/$m-s$s.log" 2>&1; then
      commit_run "$m" "$s"
      echo "$(date -u +%FT%TZ) worker $id: $m seed $s done" >>"$LOGS/progress.log"
    else
      echo "$(date -u +%FT%TZ) worker $id: $m seed $s FAILED (see $LOGS/$m-s$s.log)" >>"$LOGS/progress.log"
    fi
  done
}

for ((i = 0; i < WORKERS; i++)); do worker "$i" & done
wait
[ -z "$SHARED" ] && rm -rf "$CLAIMS"  # (a shared folder is left to the invocations sharing it)
