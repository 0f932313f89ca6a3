#!/usr/bin/env bash
# Submit one experiment at several GPU counts for ESSA and F-GRPO (same config, more ranks),
# one rank per GPU on full nodes, through jobscripts/slurm/<method>.sbatch. Run from the repo.
#
#   jobscripts/sweep.sh [--dry-run] [CONFIG.yaml] [section.key=value ...]
#
#   A key of a method's section (essa.population=64) goes to that method's jobs only.
#   --dry-run                  print the sbatch command lines instead of submitting
#   GPU_COUNTS="16 32 64 128"  total GPUs of each run
#   GPUS_PER_NODE=8            GPUs (= ranks) per node; a count below it takes part of one node
#   METHODS="essa fgrpo"
#   SBATCH_ARGS=               more sbatch options for every job, e.g. "--partition=gpu
#                              --account=proj --time=02:00:00"
#   RUN_ROOT=runs/sweep-<date> where the runs go, one <method>-<job id> folder each, so that
#                              `hpc-report summary $RUN_ROOT/*/*.h5` compares the whole sweep
set -euo pipefail

dry_run=0
if [[ ${1:-} == --dry-run ]]; then
  dry_run=1
  shift
fi
read -r -a counts <<<"${GPU_COUNTS:-16 32 64 128}"
read -r -a methods <<<"${METHODS:-essa fgrpo}"
read -r -a extra <<<"${SBATCH_ARGS:-}"
per_node=${GPUS_PER_NODE:-8}
run_root=${RUN_ROOT:-runs/sweep-$(date +%Y%m%d-%H%M%S)}

die() { echo "sweep.sh: $*" >&2; exit 2; }
[[ $per_node =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE=$per_node is not a positive integer"
for method in "${methods[@]}"; do
  [[ -f jobscripts/slurm/$method.sbatch ]] ||
    die "no jobscripts/slurm/$method.sbatch (run from the repo root)"
done

# Check every count before submitting anything, so a typo never leaves half a sweep queued.
nodes=() tasks_per_node=()
for gpus in "${counts[@]}"; do
  [[ $gpus =~ ^[1-9][0-9]*$ ]] || die "GPU count '$gpus' is not a positive integer"
  if ((gpus <= per_node)); then
    nodes+=(1) tasks_per_node+=("$gpus")
  elif ((gpus % per_node == 0)); then
    nodes+=($((gpus / per_node))) tasks_per_node+=("$per_node")
  else
    die "$gpus GPUs is not a whole number of $per_node-GPU nodes"
  fi
done

# A job refuses a command-line key of another method's section (it would change nothing), so
# each method gets the shared keys and its own section's; a key of a method that no job of
# the sweep runs is refused here, before anything is submitted.
for word; do
  if [[ $word =~ ^(sft|essa|fgrpo)\.[^=]*= && " ${methods[*]} " != *" ${word%%.*} "* ]]; then
    die "$word: METHODS=\"${methods[*]}\" runs no ${word%%.*} job"
  fi
done
own_args() {  # own_args METHOD ARGS...: sets method_args to the arguments for METHOD's jobs
  local method=$1 word
  shift
  method_args=()
  for word; do
    [[ $word =~ ^(sft|essa|fgrpo)\.[^=]*= && ${word%%.*} != "$method" ]] || method_args+=("$word")
  done
}

# A dry run prints lines a shell can run as they are; only words that need it are quoted.
quote() {
  local word out=()
  for word; do
    if [[ $word =~ ^[][A-Za-z0-9_./=,:@%+-]+$ ]]; then out+=("$word"); else out+=("${word@Q}"); fi
  done
  echo "${out[*]}"
}

for method in "${methods[@]}"; do
  own_args "$method" "$@"
  for i in "${!counts[@]}"; do
    gpus=${counts[i]} n=${nodes[i]} per=${tasks_per_node[i]}
    opts=(--job-name="$method-${gpus}g" --nodes="$n" --ntasks="$gpus" --ntasks-per-node="$per"
          --gpus-per-node="$per" --export=ALL "${extra[@]}")
    job=("jobscripts/slurm/$method.sbatch" ${method_args[@]+"${method_args[@]}"})
    # RUN_ROOT goes through the environment (--export=ALL): inside --export=ALL,RUN_ROOT=...
    # a comma in the value would end it and start another variable.
    if ((dry_run)); then
      echo "RUN_ROOT=$(quote "$run_root") $(quote sbatch "${opts[@]}" "${job[@]}")"
    else
      echo "$method at $gpus GPUs on $n node(s): job $(RUN_ROOT=$run_root sbatch --parsable \
        "${opts[@]}" "${job[@]}")"
    fi
  done
done
((dry_run)) || echo "runs: $run_root/<method>-<job id>"
