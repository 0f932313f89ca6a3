#!/usr/bin/env bash
# The F-GRPO paper's pairs on Qwen2.5-7B (arXiv 2602.06717, Tables 5 and 7) on a Slurm cluster:
# for each of configs/paper/{fgrpo,fdapo,fcispo}-qwen2.5-7b.yaml, the plain run
# (fgrpo.advantage.gamma=0) and the focal run (the preset's gamma: 0.5, 0.5, 1.0) x seeds, each
# an F-GRPO job of GPUS GPUs submitted through jobscripts/sweep.sh (jobscripts/slurm/fgrpo.sbatch).
# Prepare the data first (the config's header lists the commands), then from the repo root:
#
#   jobscripts/fgrpo-paper.sh [--dry-run] [section.key=value ...]   (keys go to every job)
#   CONFIGS="fgrpo fdapo fcispo"   which pairs     SEEDS="0"   GPUS=16   GPUS_PER_NODE=8
#   SBATCH_ARGS="--partition=gpu --account=proj --time=48:00:00"
#   RUN_ROOT=runs/fgrpo-paper-<date>: every run in $RUN_ROOT/family/fgrpo-<job id> (the run file
#   names its algorithm, gamma and seed), the layout of reproduce.sh's family group, so that
#   `hpc-report reproduce $RUN_ROOT --checkpoint paper` pairs them and applies the paper's
#   checkpoint choice (docs/fgrpo.md); hpc-eval then gives pass@k from 1,024 samples.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=()
if [[ ${1:-} == --dry-run ]]; then
  dry=(--dry-run)
  shift
fi
read -r -a configs <<<"${CONFIGS:-fgrpo fdapo fcispo}"
read -r -a seeds <<<"${SEEDS:-0}"
root=${RUN_ROOT:-runs/fgrpo-paper-$(date +%Y%m%d-%H%M%S)}
for name in "${configs[@]}"; do
  config=configs/paper/$name-qwen2.5-7b.yaml
  [[ -f $config ]] || { echo "fgrpo-paper.sh: no $config (CONFIGS: fgrpo fdapo fcispo)" >&2; exit 2; }
  for gamma in 0 preset; do
    focal=()
    [[ $gamma == 0 ]] && focal=(fgrpo.advantage.gamma=0)
    for seed in "${seeds[@]}"; do
      RUN_ROOT=$root/family METHODS=fgrpo GPU_COUNTS=${GPUS:-16} \
        jobscripts/sweep.sh ${dry[@]+"${dry[@]}"} "$config" ${focal[@]+"${focal[@]}"} \
        "run.seed=$seed" "$@"
    done
  done
done
