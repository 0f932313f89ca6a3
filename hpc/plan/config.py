"""The ``plan`` config section: the GPU memory, prompt length and node shape the pre-flight
memory plan assumes (:mod:`hpc.plan.registry`). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from hpc.runtime.config import param


@dataclass
class PlanConfig:
    gpu_memory_gib: float = param(80.0, "GPU memory per rank that the pre-flight memory plan "
                                  "assumes (GiB; hpc-plan, and job start on CUDA with a model "
                                  "folder); 0 = no check at job start", min=0.0,
                                  max=1_000_000.0)
    max_prompt_tokens: int = param(512, "longest prompt (tokens) the memory plan assumes; "
                                   "hpc-data check counts the prompts longer than this", min=1,
                                   max=1_000_000)
    ranks_per_node: int = param(8, "ranks (GPUs) per node the plan assumes for a node's host "
                                "memory during the load (hpc-doctor counts the real ones)",
                                min=1, max=4096)
    host_gb_per_s: float = param(20.0, "host-device copy speed per GPU (GB/s, pinned memory) "
                                 "the plan assumes for the seconds a step's offload of optimizer "
                                 "state to host memory costs (F-GRPO's parallel.offload)",
                                 above=0.0, max=10_000.0)
