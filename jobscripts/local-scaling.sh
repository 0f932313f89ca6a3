#!/usr/bin/env bash
# ESSA and F-GRPO at 1, 2 and 4 ranks on this machine (toy model, short runs), then the
# report over all six run files: summary table, CSV and plots in $OUT/report.
# Needs the demo's SFT adapter (make demo) or ADAPTER=<folder>.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python}
OUT=${OUT:-runs/local-scaling}
ADAPTER=${ADAPTER:-runs/demo/sft/adapter}
TARGET=${TARGET:-0.6}
[[ -d $ADAPTER ]] || { echo "error: no SFT adapter at $ADAPTER (run make demo first)" >&2; exit 2; }

rm -rf "$OUT"
for n in 1 2 4; do
  mpirun -n "$n" --oversubscribe $PY -m essa configs/demo/essa.yaml "lora.adapter=$ADAPTER" \
    essa.generations=30 run.max_time_s=0 eval.every=5 eval.n_samples=2 run.progress=false \
    "run.out=$OUT/essa-$n"
  mpirun -n "$n" --oversubscribe $PY -m fgrpo configs/demo/fgrpo.yaml "lora.adapter=$ADAPTER" \
    fgrpo.steps=120 run.max_time_s=0 eval.every=10 eval.n_samples=2 run.progress=false \
    "run.out=$OUT/fgrpo-$n"
done
$PY -m compare.report summary "$OUT"/*/*.h5 --csv "$OUT/report/summary.csv" \
  --plots "$OUT/report" --target "$TARGET"
