#!/usr/bin/env bash
# The papers' headline shapes on the built-in toy, from one SFT start (2 MPI ranks each run):
#   gamma/   F-GRPO at several focal exponents gamma x seeds, equal steps; final pass@k for
#            k = 1..SAMPLES on the held-out split (F-GRPO, arXiv 2602.06717)
#   wall/    ESSA and F-GRPO x seeds with the same training-time budget (run.max_train_s)
#   tokens/  ESSA and F-GRPO x seeds with the same generated-token budget
#            (run.max_generated_tokens) (ESSA, arXiv 2507.04453: time to accuracy)
#   family/  the F-GRPO paper's three pairs: GRPO vs F-GRPO, DAPO vs F-DAPO, CISPO vs F-CISPO
#            (fgrpo.algorithm's preset, the paper's clip ranges and gamma, x gamma 0 / the
#            preset's gamma) x seeds, every run stopped by the same
#            generated-token budget (equal work: dynamic sampling's extra rollouts count);
#            final pass@k for k = 1..FAMILY_SAMPLES, paired by seed
# then `hpc-report reproduce` prints the tables and tests (summary.txt), writes summary.json
# and the plots, and `hpc-scaling --runs` predicts 16-128 GPUs from the wall/ runs
# (scaling.txt). About 45 minutes on 2 idle cores with the defaults (the family group about 15).
#
#   jobscripts/reproduce.sh            knobs (environment):
#   OUT=runs/reproduce                 SEEDS="0 1 2"   GAMMAS="0 0.5 1 2"
#   STEPS=150   F-GRPO steps of the gamma sweep      SAMPLES=256  samples a problem for pass@k
#   N_EVAL=128  held-out problems (gamma sweep)      METHOD_EVAL=256  held-out problems (wall/tokens)
#   TRAIN_S=60  training seconds a run (wall/)       TOKENS=400000    tokens a run (tokens/)
#   ESSA_EVERY=10 FGRPO_EVERY=30  held-out evaluations along the wall/ runs (steps)
#   ESSA_EVERY_T=4 FGRPO_EVERY_T=40  ... along the tokens/ runs
#   PARTS="gamma wall tokens family"  the groups to run
#   FAMILY_TOKENS=60000  tokens a run (family/)   FAMILY_EVAL=128
#   FAMILY_GAMMA=preset  the focal arms' gamma: the preset's (the paper's 0.5, 0.5, 1.0) or a number
#   FAMILY_SAMPLES=32  samples a problem for the family's pass@k
#   FAMILY_BATCH=32  prompts a step (family/)   FAMILY_ALGORITHMS="grpo dapo cispo"
#   FAMILY_LR=0.001  fgrpo.optim.learning_rate of every family arm
#   FAMILY_ITERATIONS=1  fgrpo.optim.num_iterations (PPO epochs) of every family arm
#   FAMILY_MINI_BATCH=8  fgrpo.optim.mini_batch_prompts: 4 updates a batch of 32, as the paper's
#                        256 / 64 (the later updates are off-policy, where the clip ranges and
#                        CISPO's weight act; with one update a batch CISPO's gradient is GRPO's)
#   START=demo  the one start: the demo's SFT (10 steps of 32 on the training prompts ESSA and
#               F-GRPO then train on, ESSA's population 16); START=paper: the ESSA paper's warm
#               start, one SFT epoch on a disjoint SFT_SPLIT of the training prompts (task.sft_split;
#               ESSA and F-GRPO train on the rest) and ESSA's population at POPULATION
#   SFT_SPLIT=0.2  (START=paper) the SFT share: the paper's 1,495 of 7,473 GSM8K problems
#   POPULATION=96  (START=paper) ESSA's population: the paper's default
#   RANKS=2
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python}
OUT=${OUT:-runs/reproduce}
read -r -a seeds <<<"${SEEDS:-0 1 2}"
read -r -a gammas <<<"${GAMMAS:-0 0.5 1 2}"
read -r -a parts <<<"${PARTS:-gamma wall tokens family}"
has() { [[ " ${parts[*]} " == *" $1 "* ]]; }
FAMILY_TOKENS=${FAMILY_TOKENS:-60000} FAMILY_GAMMA=${FAMILY_GAMMA:-preset}
FAMILY_EVAL=${FAMILY_EVAL:-128} FAMILY_SAMPLES=${FAMILY_SAMPLES:-32}
FAMILY_BATCH=${FAMILY_BATCH:-32}
read -r -a algorithms <<<"${FAMILY_ALGORITHMS:-grpo dapo cispo}"
FAMILY_ITERATIONS=${FAMILY_ITERATIONS:-1} FAMILY_LR=${FAMILY_LR:-0.001}
FAMILY_MINI_BATCH=${FAMILY_MINI_BATCH:-8}
STEPS=${STEPS:-150} SAMPLES=${SAMPLES:-256} N_EVAL=${N_EVAL:-128}
METHOD_EVAL=${METHOD_EVAL:-256} TRAIN_S=${TRAIN_S:-60} TOKENS=${TOKENS:-400000}
ESSA_EVERY=${ESSA_EVERY:-10} FGRPO_EVERY=${FGRPO_EVERY:-30}
ESSA_EVERY_T=${ESSA_EVERY_T:-4} FGRPO_EVERY_T=${FGRPO_EVERY_T:-40}
MPIRUN=(mpirun -n "${RANKS:-2}" --oversubscribe)
QUIET=(run.progress=false)
START=${START:-demo}
case $START in
  demo) SFT_KEYS=() DATA=() ESSA_KEYS=() ;;
  paper) SFT_KEYS=(sft.epochs=1) DATA=("task.sft_split=${SFT_SPLIT:-0.2}")
         ESSA_KEYS=("essa.population=${POPULATION:-96}") ;;
  *) echo "error: START=$START: one of demo, paper" >&2; exit 2 ;;
esac

rm -rf "$OUT"
mkdir -p "$OUT"
began=$SECONDS
stage() { echo "== [$((SECONDS - began)) s] $*"; }

stage "toy model"
$PY -m hpc.toys.toy
stage "LoRA SFT: the one start of every run"
"${MPIRUN[@]}" $PY -m sft configs/demo/sft.yaml "${SFT_KEYS[@]}" "${DATA[@]}" "run.out=$OUT/sft" \
  "${QUIET[@]}" >"$OUT/sft.log"
adapter=$OUT/sft/adapter

has gamma && mkdir -p "$OUT/gamma" || gammas=()
for gamma in "${gammas[@]}"; do
  for seed in "${seeds[@]}"; do
    stage "F-GRPO gamma $gamma seed $seed: $STEPS steps, pass@k from $SAMPLES samples"
    "${MPIRUN[@]}" $PY -m fgrpo configs/demo/fgrpo.yaml "lora.adapter=$adapter" "${DATA[@]}" \
      "fgrpo.advantage.gamma=$gamma" "fgrpo.steps=$STEPS" "run.seed=$seed" "task.n_eval=$N_EVAL" \
      "eval.every=0" "eval.n_samples=$SAMPLES" "run.out=$OUT/gamma/g$gamma-s$seed" \
      "${QUIET[@]}" >"$OUT/gamma/g$gamma-s$seed.log" 2>&1 ||
      { echo "failed: see $OUT/gamma/g$gamma-s$seed.log"; exit 1; }
  done
done

# Budgets stop these runs; the step counts are only upper bounds.
budget_run() {  # group method seed every budget_key=value
  local group=$1 method=$2 seed=$3 every=$4 budget=$5 steps
  local keys=("${DATA[@]}")
  if [[ $method == essa ]]; then
    steps=essa.generations=100000 keys+=("${ESSA_KEYS[@]}")
  else
    steps=fgrpo.steps=100000
  fi
  stage "$method seed $seed, $budget"
  mkdir -p "$OUT/$group"
  "${MPIRUN[@]}" $PY -m "$method" "configs/demo/$method.yaml" "lora.adapter=$adapter" "$steps" \
    "${keys[@]}" "$budget" "run.seed=$seed" "task.n_eval=$METHOD_EVAL" "eval.every=$every" \
    "run.out=$OUT/$group/$method-s$seed" "${QUIET[@]}" >"$OUT/$group/$method-s$seed.log" 2>&1 ||
    { echo "failed: see $OUT/$group/$method-s$seed.log"; exit 1; }
}
for seed in "${seeds[@]}"; do
  has wall || break
  budget_run wall essa "$seed" "$ESSA_EVERY" "run.max_train_s=$TRAIN_S"
  budget_run wall fgrpo "$seed" "$FGRPO_EVERY" "run.max_train_s=$TRAIN_S"
done
for seed in "${seeds[@]}"; do
  has tokens || break
  budget_run tokens essa "$seed" "$ESSA_EVERY_T" "run.max_generated_tokens=$TOKENS"
  budget_run tokens fgrpo "$seed" "$FGRPO_EVERY_T" "run.max_generated_tokens=$TOKENS"
done
for algo in "${algorithms[@]}"; do
  has family || break
  mkdir -p "$OUT/family"
  # the preset's keys given explicitly: they win over the demo config's gamma and clip-higher
  read -r -a preset <<<"$($PY -c "from fgrpo.config import PRESETS
print(' '.join(f'fgrpo.{k}={v}' for k, v in PRESETS['$algo'].items() if not isinstance(v, dict)))")"
  focal=$FAMILY_GAMMA
  [[ $focal == preset ]] && focal=$($PY -c "from fgrpo.config import PRESETS
print(PRESETS['$algo']['advantage.gamma'])")
  for gamma in 0 "$focal"; do
    for seed in "${seeds[@]}"; do
      run=$OUT/family/$algo-g$gamma-s$seed
      stage "$algo gamma $gamma seed $seed: $FAMILY_TOKENS tokens, pass@k from $FAMILY_SAMPLES samples"
      "${MPIRUN[@]}" $PY -m fgrpo configs/demo/fgrpo.yaml "lora.adapter=$adapter" "${DATA[@]}" \
        "fgrpo.algorithm=$algo" "${preset[@]}" "fgrpo.advantage.gamma=$gamma" fgrpo.steps=100000 \
        "fgrpo.batch_prompts=$FAMILY_BATCH" "fgrpo.optim.num_iterations=$FAMILY_ITERATIONS" \
        "fgrpo.optim.mini_batch_prompts=$FAMILY_MINI_BATCH" \
        "fgrpo.optim.learning_rate=$FAMILY_LR" \
        "run.max_generated_tokens=$FAMILY_TOKENS" "run.seed=$seed" "task.n_eval=$FAMILY_EVAL" \
        "eval.every=0" "eval.n_samples=$FAMILY_SAMPLES" "run.out=$run" "${QUIET[@]}" \
        >"$run.log" 2>&1 || { echo "failed: see $run.log"; exit 1; }
    done
  done
done

stage "summary"
$PY -m compare.report reproduce "$OUT" --plots "$OUT/plots" --json "$OUT/summary.json" |
  tee "$OUT/summary.txt"
# 16-128 GPUs from the wall/ runs' steps to a target both methods reach: at the runs' own
# workload with their CPU costs, then at the paper's (population 128 x 256 prompts, GRPO 512
# prompts) with the per-step costs the H200 GPU check measured for Qwen2.5-1.5B.
if has wall; then
  {
    $PY -m compare.scaling --paper --runs "$OUT"/wall/*/*.h5
    echo
    $PY -m compare.scaling --paper --runs "$OUT"/wall/*/*.h5 \
      --gpu-check benchmarks/results/gpu_check-h200-2026-11-30.json \
      --population 128 --minibatch 256 --grpo-batch 512 --grpo-minibatch 64
  } | tee "$OUT/scaling.txt"
fi
stage "done: $OUT"
