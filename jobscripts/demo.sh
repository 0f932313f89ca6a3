#!/usr/bin/env bash
# The main job end to end on the built-in toy model, on 2 MPI ranks of this machine:
# toy model (built once, cached) -> LoRA SFT -> ESSA and F-GRPO from the same SFT adapter ->
# one table comparing base, SFT, ESSA and F-GRPO.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python}
RANKS=${RANKS:-2}
OUT=${OUT:-runs/demo}
MPIRUN=(mpirun -n "$RANKS" --oversubscribe)
# DEMO_OVERRIDES: config keys for every job, e.g. the demo on vLLM (docs/engine.md):
#   PYTHON=.venv-vllm/bin/python OUT=runs/demo-vllm DEMO_OVERRIDES=model.engine=vllm \
#     bash jobscripts/demo.sh
read -r -a MORE <<< "${DEMO_OVERRIDES:-}"
# Every stage runs the pinned kernels the toy model is built with (hpc/toys/pinned.py:
# torch's baseline kernels, MKL's reproducible mode), so the kernels this CPU would choose
# (AVX2, AVX-512) do not move the table (docs/toy.md); DEMO_NATIVE_KERNELS=1 runs them.
if [[ "${DEMO_NATIVE_KERNELS:-0}" != 1 ]]; then
  export $($PY -c 'from hpc.toys.pinned import pinned_description; print(pinned_description())')
fi

rm -rf "$OUT"
echo "== toy model"
$PY -m hpc.toys.toy
echo "== LoRA SFT ($RANKS ranks)"
"${MPIRUN[@]}" $PY -m sft configs/demo/sft.yaml "run.out=$OUT/sft" "${MORE[@]}"
echo "== ESSA ($RANKS ranks)"
"${MPIRUN[@]}" $PY -m essa configs/demo/essa.yaml "lora.adapter=$OUT/sft/adapter" "run.out=$OUT/essa" "${MORE[@]}"
echo "== F-GRPO ($RANKS ranks)"
"${MPIRUN[@]}" $PY -m fgrpo configs/demo/fgrpo.yaml "lora.adapter=$OUT/sft/adapter" "run.out=$OUT/fgrpo" "${MORE[@]}"
echo "== held-out comparison (256 problems; pass@k from 8 samples at temperature 1)"
$PY -m compare.report compare "$OUT/sft/sft.h5" "$OUT/essa/essa.h5" "$OUT/fgrpo/fgrpo.h5"
