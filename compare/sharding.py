"""The F-GRPO step's layouts over GPUs beyond a whole replica each: full-parameter training
sharded over all GPUs (:class:`Sharding`) and the paper's LoRA on an FSDP-sharded frozen base
(:class:`LoraFsdp`), each giving its communication terms of one step.

Units: seconds, bytes, bytes/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from compare.network import GPUS, Network

# The layouts the model describes (--fgrpo): name -> the assumption line naming it
FGRPO_MODES = {
    "lora-fsdp": "GRPO as the paper ran it (verl): LoRA on an FSDP-sharded frozen base, a "
                 "rollout engine fed the new weights each step (--grpo lora-fsdp)",
    "replica": "GRPO trains LoRA on its whole replica and generates in-process, no weight sync "
               "to an inference engine (--grpo replica)",
    "full": "GRPO trains every weight, sharded over all GPUs (--grpo full)",
}
MICRO_BATCH = 8  # sequences per forward/backward of the sharded layouts (--micro-batch)


def updates_and_micro_batches(n: int, w, micro_batch: int) -> tuple:
    """(optimizer updates a step, micro-batches a GPU runs a step) on ``n`` GPUs of the
    workload ``w`` (a :class:`compare.model.Workload`)."""
    updates = math.ceil(w.fgrpo_batch / w.fgrpo_minibatch)
    seqs = math.ceil(w.fgrpo_minibatch / n) * w.fgrpo_generations  # a GPU's, per update
    return updates, updates * max(1, math.ceil(seqs / micro_batch))


@dataclass(frozen=True)
class Sharding:
    """Full-parameter F-GRPO with the weights, gradients and AdamW state sharded over all
    GPUs (FSDP2, ``fgrpo.parallel.strategy=fsdp2``): per micro-batch the bf16 weights are
    all-gathered for the forward and again for the backward (resharded after the forward) and
    the gradients reduce-scattered; per step the rollout gathers the bf16 weights once into
    the decoding engine."""

    params: float                 # parameters
    micro_batch: int = MICRO_BATCH  # sequences per forward/backward
    weight_bytes: float = 2.0     # bf16 compute weights, gathered
    grad_bytes: float = 4.0       # fp32 reduction (MixedPrecisionPolicy reduce_dtype)
    host_seconds: tuple = ()      # ((GPUs, seconds a GPU's state takes to host and back
    #                                 around a rollout), ...): compare.plan_terms.host_offload

    def step(self, n: int, w, net: Network) -> dict:
        """Seconds of each communication term of one F-GRPO step of workload ``w`` on ``n``
        GPUs."""
        _, micro = updates_and_micro_batches(n, w, self.micro_batch)
        gather = net.shard_collective(self.weight_bytes * self.params, n)
        return {"gather_forward": micro * gather, "gather_backward": micro * gather,
                "reduce_scatter": micro * net.shard_collective(self.grad_bytes * self.params, n),
                "rollout_gather": gather,
                "host_offload": dict(self.host_seconds).get(n, 0.0)}


@dataclass(frozen=True)
class LoraFsdp:
    """LoRA GRPO as the ESSA paper ran it in verl (``--grpo lora-fsdp``): the frozen bf16 base
    sharded over all GPUs (FSDP), the LoRA adapter trained. Per micro-batch the base's shards
    are all-gathered for the forward and again for the backward (resharded after the
    forward); per optimizer update the LoRA-sized fp32 gradients are all-reduced; per step the
    rollout engine (a whole bf16 model on each GPU) is fed the new weights: with ``sync``
    "model" the LoRA folded into the base, all-gathered from the shards and copied into the
    engine, with "adapter" only the adapter."""

    params: float                 # parameters of the base
    lora_params: float            # trainable LoRA parameters
    micro_batch: int = MICRO_BATCH  # sequences per forward/backward
    weight_bytes: float = 2.0     # bf16 base, gathered
    grad_bytes: float = 4.0       # fp32 LoRA gradients
    sync: str = "model"           # "model" | "adapter": what the rollout engine is fed
    hbm: float = GPUS["h100"].hbm  # bytes/s of the copy into the engine

    @property
    def gather_bytes(self) -> float:
        """Bytes of one all-gather of the base (all ranks' shards together)."""
        return self.weight_bytes * self.params

    @property
    def lora_grad_bytes(self) -> float:
        """Bytes all-reduced per optimizer update."""
        return self.grad_bytes * self.lora_params

    @property
    def sync_bytes(self) -> float:
        """Bytes the rollout engine is fed each step (bf16)."""
        return self.weight_bytes * (self.params if self.sync == "model" else self.lora_params)

    def step(self, n: int, w, net: Network) -> dict:
        """Seconds of each communication term of one F-GRPO step of workload ``w`` on ``n``
        GPUs."""
        updates, micro = updates_and_micro_batches(n, w, self.micro_batch)
        gather = net.shard_collective(self.gather_bytes, n)
        return {"gather_forward": micro * gather, "gather_backward": micro * gather,
                "allreduce": updates * net.allreduce(self.lora_grad_bytes, n),
                "weight_sync": net.shard_collective(self.sync_bytes, n) +
                2 * self.sync_bytes / self.hbm}
