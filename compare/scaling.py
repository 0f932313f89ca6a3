"""Scaling model: predicted step time, time to target and the ESSA/GRPO ratio at 16-128 GPUs.

``hpc-scaling --paper`` runs the model on the ESSA paper's large setting (Qwen2.5-32B, LoRA
rank 16, ESSA population 128 x minibatch 256 in bf16, GRPO global batch 512 / mini-batch 64
prompts, H100s) and prints the paper's figures beside the prediction. Its GRPO is the one the
paper ran (``--grpo lora-fsdp``, the default there): LoRA rank 16 on an FSDP-sharded frozen
base in verl, a rollout engine fed the new weights each step, and ``--grpo-fixed-s`` seconds a
step that do not shrink with GPUs; ``--paper`` prints the fixed cost the paper's own 16- and
128-GPU times imply and the prediction with it. ``--grpo full`` is full-parameter GRPO sharded
over all GPUs, ``--grpo replica`` LoRA GRPO on a whole replica per GPU, generating in-process.
``hpc-scaling --runs FILE [FILE ...]`` takes the steps to a held-out accuracy target from
measured ESSA and F-GRPO runs (any number of seeds each; the median per method) and, unless
``--gpu-check`` is given, the per-completion costs too, instead of a roofline of the described
model. ``--gpu-check JSON`` takes the costs from one model of a GPU check
(benchmarks/gpu_check.py). Every assumption is printed with the table. The F-GRPO flags also
take the spelling --fgrpo... (--fgrpo full, --fgrpo-batch).

Units: seconds, bytes, bytes/s, FLOP/s; "tokens/s" are per GPU.
"""
from __future__ import annotations

from compare.options import parse_options
from compare.prediction import print_prediction
from hpc.runtime.cli import plain
from hpc.runtime.errors import user_errors_exit


@user_errors_exit
def main(argv=None):
    """``hpc-scaling``: its options (:mod:`compare.options`; this module's docstring heads
    their ``--help``), printed as the prediction and its reports (:mod:`compare.prediction`)."""
    print_prediction(parse_options(argv, plain(__doc__)))


if __name__ == "__main__":
    main()
