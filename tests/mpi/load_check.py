"""Run under mpirun -n N: what a rank holds while a model loads through the job's own load path
(:func:`hpc.models.loading.load_model`, ``model.load=streamed``), tracked by torch's memory
tracker, beside the memory plan's load phase for the same job.

``load_check.py MODEL OUT CASE``: CASE is ``fsdp2-lora`` (F-GRPO's LoRA policy in fp32, sharded
over the N ranks as it loads, then FSDP2's settling forward) or ``ddp-int8`` (ESSA's model with
its adapter, each decoder linear quantised to int8 as it arrives). Each rank measures the
tracker's peak over the load (and, for FSDP2, the peak of the streaming alone), the bytes it
holds at the end, and the largest tensor of the model; the loaded tensors are compared with
``model.load=transformers`` (whole tensors, gathered), and rank 0 writes every rank's figures
and the plan's load phase as JSON to OUT.
"""
import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor

from hpc.engine.shape import ModelShape
from hpc.models.loading import attach_lora, load_adapter, load_model
from hpc.models.parallelize import settle, shard_units
from hpc.job.config import plan_job_class
from hpc.runtime.config import load_config
from hpc.runtime.dist import init_process_group
from hpc.runtime.world import get_world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from memory_tracker import LiveBytesTracker  # noqa: E402 (the benchmark's tracker, no module hooks)

model_dir, out, case = sys.argv[1:4]
adapter = sys.argv[4] if len(sys.argv) > 4 else ""
world = get_world()
init_process_group(world, torch.device("cpu"))
CPU = torch.device("cpu")


def tracked_peak(fn, *existing):
    """(fn's result, the tracker's peak of live tensor bytes on the CPU over fn, ``existing``
    objects' tensors counted from the start)."""
    tracker = LiveBytesTracker()
    with tracker:
        tracker.track_external(*existing)
        result = fn()
    return result, tracker.peaks.get("all", 0)


def held(model) -> int:
    """Live tensor bytes of ``model``'s parameters and buffers (a shard its local rows, a
    quantised weight its int8 values and scales), by the same tracker."""
    tracker = LiveBytesTracker()
    with tracker:
        tracker.track_external(model)
        return tracker.get_tracker_snapshot("current")[CPU]["Total"]


def whole(model) -> dict:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else
                p.dequantize() if hasattr(p, "dequantize") else p).detach().clone()
            for n, p in model.named_parameters()}


if case == "fsdp2-lora":
    overrides = ["fgrpo.parallel.strategy=fsdp2", "model.dtype=float32", "lora.rank=4",
                 "lora.targets=[q_proj,v_proj]"]

    def load(how):
        return load_model(model_dir, "float32", CPU, load=how,
                          wrap=lambda m: attach_lora(m, 4, 8.0, ["q_proj", "v_proj"], seed=0),
                          shard=lambda m: shard_units(m, "float32"))[0]

    model, stream_peak = tracked_peak(lambda: load("streamed"))
    _, settle_peak = tracked_peak(lambda: settle(model), model)
    reference = settle(load("transformers"))
else:
    overrides = ["model.quantize=int8", "model.dtype=bfloat16", "lora.rank=4",
                 "lora.targets=[q_proj,k_proj,v_proj,o_proj]"]

    def load(how):
        return load_model(model_dir, "bfloat16", CPU, load=how, quantize="int8",
                          wrap=lambda m: load_adapter(m, adapter))[0]

    model, stream_peak = tracked_peak(lambda: load("streamed"))
    settle_peak = 0
    reference = load("transformers")
mine, theirs = whole(model), whole(reference)
equal = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
cfg = load_config(plan_job_class(), None, [f"model.path={model_dir}", *overrides])
shape = ModelShape.from_folder(model_dir)
if case == "fsdp2-lora":
    from fgrpo.plan import load_phase
    phase = load_phase(shape, cfg, world.size)
else:
    from essa.plan import load_phase
    phase = load_phase(shape, cfg)
figures = {"rank": world.rank, "stream_peak": stream_peak, "settle_peak": settle_peak,
           "held": held(model), "equal": equal}
every = world.comm.gather(figures, root=0)
if world.is_root:
    with open(out, "w") as fh:
        json.dump({"ranks": every, "plan_load": phase.peak,
                   "plan_parts": [[label, b] for label, b in phase.parts],
                   "model_bytes": shape.parameters() * (4 if case == "fsdp2-lora" else 2),
                   "layer_parameters": shape.layer_parameters(),
                   "largest_linear": shape.largest_linear(),
                   "largest_tensor": shape.largest_tensor()}, fh, indent=1)
