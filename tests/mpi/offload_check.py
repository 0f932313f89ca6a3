"""Run under mpirun -n N: ``fgrpo.parallel.offload`` moves the training state off the device while
the model decodes, and changes nothing.

For each case (FSDP2 full fine-tuning and LoRA in fp32, DDP full fine-tuning in bf16) and each
offload mode (none, optimizer, state), every rank builds the same tiny model, takes two AdamW
steps on fixed data with a decode (greedy, through the package's generation) between them
inside :func:`hpc.models.parallelize.decoding`, as F-GRPO does. Inside the block it records
the bytes still held by the storages of the AdamW moments, the fp32 masters and the model's
shards. Rank 0 writes, per case and mode, those bytes, the logits and decoded tokens, and the final
masters and moments (this rank's shards) to argv[1] (torch.save).
"""
import sys

import torch

from hpc.engine.engine_backend import EngineBackend
from hpc.engine.generate import generate_tokens
from hpc.models.loading import attach_lora
from hpc.models.parallelize import TrainedWeights, decoding, shard_model
from hpc.runtime.dist import init_process_group
from hpc.runtime.world import get_world
from hpc.toys.toy import tiny_model

world = get_world()
init_process_group(world, torch.device("cpu"))


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(tensors) -> int:
    return sum(local(t).untyped_storage().nbytes() for t in tensors)


def run(case: str, offload: str) -> dict:
    model, tok = tiny_model(seed=0)
    if case == "ddp-full-bf16":
        model = model.to(torch.bfloat16)
    if case == "fsdp2-lora":
        model = attach_lora(model, 4, 8.0, ["q_proj", "v_proj"], seed=0)
    if case.startswith("fsdp2"):
        shard_model(model, "float32")
    params = [p for p in model.parameters() if p.requires_grad]
    shards = list(model.parameters())  # under FSDP2, before any gathering: the shards
    weights = TrainedWeights(params, lr=1e-3, weight_decay=0.01)
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(world.rank))
    out = {"tokens": []}
    decoder = EngineBackend()
    for step in range(2):
        model.train()
        weights.zero_grad()
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        weights.reduce_gradients(world)
        weights.step(1.0)
        weights.free_gradients()
        model.eval()
        with decoding(model, weights, offload, decoder):
            moments = [v for s in weights.opt.state.values() for v in s.values() if v.dim()]
            copies = [m for p, m in zip(weights.params, weights.masters) if p is not m]
            out.setdefault("held", []).append({
                "moments": held_bytes(moments), "master copies": held_bytes(copies),
                "shards": held_bytes(shards) if case.startswith("fsdp2") else None,
                "gradients": sum(p.grad is not None for p in params)})
            with torch.no_grad():
                out.setdefault("logits", []).append(model(input_ids=ids).logits.float())
            out["tokens"].append(generate_tokens(model, tok, ["12+34=", "7+8="], 6,
                                                 decoder=decoder))
    out["masters"] = [local(m).detach().clone() for m in weights.masters]
    out["moments"] = [local(v).clone() for s in weights.opt.state.values() for v in s.values()]
    out["before"] = {"moments": held_bytes(out["moments"]),
                     "master copies": held_bytes(copies)}
    return out


results = {(case, offload): run(case, offload)
           for case in ("fsdp2-full", "fsdp2-lora", "ddp-full-bf16")
           for offload in ("none", "optimizer", "state")}
if world.is_root:
    torch.save(results, sys.argv[1])
