#!/usr/bin/env bash
# The chat-format run end to end on the built-in toy-chat model (byte-level BPE tokenizer,
# Qwen-style chat template, completions ending at <|im_end|>), on 2 MPI ranks of this machine:
# toy-chat model (built once from GSM8K text, cached) -> LoRA SFT -> ESSA and F-GRPO from the
# same SFT adapter -> one table. The tokenizer's corpus: $HPC_TOKENIZER_CORPUS, default
# ../shared/data/gsm8k/train.jsonl next to the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python}
RANKS=${RANKS:-2}
OUT=${OUT:-runs/demo-chat}
MPIRUN=(mpirun -n "$RANKS" --oversubscribe)

rm -rf "$OUT"
echo "== toy-chat model"
$PY -m hpc.toys.toy_chat
echo "== LoRA SFT ($RANKS ranks)"
"${MPIRUN[@]}" $PY -m sft configs/demo-chat/sft.yaml "run.out=$OUT/sft"
echo "== ESSA ($RANKS ranks)"
"${MPIRUN[@]}" $PY -m essa configs/demo-chat/essa.yaml "lora.adapter=$OUT/sft/adapter" "run.out=$OUT/essa"
echo "== F-GRPO ($RANKS ranks)"
"${MPIRUN[@]}" $PY -m fgrpo configs/demo-chat/fgrpo.yaml "lora.adapter=$OUT/sft/adapter" "run.out=$OUT/fgrpo"
echo "== held-out comparison (64 word problems; pass@k from 4 samples at temperature 1)"
$PY -m compare.report compare "$OUT/sft/sft.h5" "$OUT/essa/essa.h5" "$OUT/fgrpo/fgrpo.h5"
