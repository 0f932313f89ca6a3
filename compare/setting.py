"""From ``hpc-scaling``'s options (:class:`compare.options.ScalingOptions`) to the model's
inputs: the workload, the cost source (the roofline, run files or a GPU check), the network,
the F-GRPO layout, where the steps to target come from, and the assumption lines these add.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from compare.gpu_check import GpuCheck
from compare.measured import Measured
from compare.model import Workload
from compare.network import GPUS, Network, cluster_network
from compare.options import ScalingOptions
from compare.paper import PAPER_WORKLOAD
from compare.plan_terms import (essa_decoding, fgrpo_decoding, host_offload, model_shape,
                                plan_config)
from compare.roofline import QWEN25_32B, Model, Roofline
from compare.sharding import LoraFsdp, Sharding
from fgrpo.config import SamplingConfig
from fgrpo.plan import expected_rounds
from hpc.engine.shape import ModelShape
from hpc.runtime.errors import UserError


@dataclass(frozen=True)
class Setting:
    workload: Workload
    cost: object                 # Roofline, Measured or GpuCheck (compare.model's interface)
    network: Network
    steps_source: str            # where the steps to target come from
    notes: list                  # assumption lines of the runs, the GPU check and the layout
    sharding: Sharding | LoraFsdp | None  # the F-GRPO layout beyond a replica a GPU


def build_setting(o: ScalingOptions) -> Setting:
    """The model's inputs the options ``o`` describe."""
    mode = o.layout
    measured = Measured(o.runs) if o.runs else None
    notes = []
    if o.gpu_check:
        cost = GpuCheck(o.gpu_check, o.gpu_check_model)
    elif measured:
        cost = measured
    defaults = measured.workload_defaults() if measured else PAPER_WORKLOAD
    values = {k: getattr(o, k) if getattr(o, k) is not None else v
              for k, v in defaults.items()}
    if not o.measured:
        model = Model(o.params, o.layers, o.hidden, o.intermediate, o.kv_dim, o.lora_rank)
        cost = Roofline(model, GPUS[o.gpu], o.prompt_tokens, o.completion_tokens,
                        o.max_new_tokens, o.full_finetune or mode == "full", o.decode_mfu,
                        o.train_mfu, gen_tps=o.gen_tps, gen_batch=o.gen_batch,
                        train_tps=o.train_tps, decoding=planned_decoding(o, values["minibatch"]),
                        mode=mode)
    if o.filtered_share is not None:
        values["fgrpo_rounds"] = float(expected_rounds(o.filtered_share,
                                                       SamplingConfig().max_refills))
    if measured:
        essa_steps, fgrpo_steps, _, notes = measured.steps_to_target(o.target)
        source = "median over each method's runs, listed above"
        if cost is not measured:
            notes.append(f"workload (population, minibatch, GRPO batch, G, updates a step) "
                         f"from the runs' configs; CMA-ES update "
                         f"{values['essa_update_s']:.3g} s a generation "
                         f"{'as given' if o.essa_update_s is not None else 'from the runs'}"
                         f" (the GPU check does not time it; its model's search dimension is "
                         f"{cost.result.get('search_dim', '?')}: benchmarks/optimizer_cost.py "
                         "times the update there, for --essa-update-s)")
    else:
        essa_steps, fgrpo_steps = o.essa_steps, o.fgrpo_steps
        source = "inputs, not taken from the paper"
    w = Workload(essa_steps=essa_steps, fgrpo_steps=fgrpo_steps, fgrpo_fixed_s=o.fgrpo_fixed_s,
                 **values)
    if isinstance(cost, GpuCheck):
        notes += rows_a_gpu_holds(o.gpus, w, cost)
    sharding, layout_notes = fgrpo_layout(o, mode, w, cost)
    notes += layout_notes
    if w.fgrpo_fixed_s:
        notes.append(f"GRPO fixed cost: {w.fgrpo_fixed_s:g} s a step whatever N "
                     f"(--grpo-fixed-s)")
    return Setting(w, cost, cluster_network(o.network, o.intra, o.gpus_per_node), source,
                   notes, sharding)


def rows_a_gpu_holds(gpus: list, w: Workload, cost: GpuCheck) -> list:
    """Lines: the rows a GPU holds at the fewest and most ``gpus`` against the rows the GPU
    check measured, and the decode batch effect there (:meth:`GpuCheck.batch_effect`)."""
    ends = sorted({min(gpus), max(gpus)})
    essa_rows = {n: math.ceil(w.population / n) * w.minibatch for n in ends}
    fgrpo_rows = {n: math.ceil(w.fgrpo_batch / n) * w.fgrpo_generations for n in ends}
    return ["rows a GPU holds: " + "; ".join(
        f"{n} GPUs: ESSA {essa_rows[n]}, F-GRPO {fgrpo_rows[n]}" for n in ends) +
        f" (the GPU check measured {cost.essa_best['rows']} and {cost.fgrpo_rows})",
        cost.batch_effect(essa_rows, fgrpo_rows)]


def fgrpo_layout(o: ScalingOptions, mode: str, w: Workload, cost) -> tuple:
    """(the F-GRPO layout of ``mode`` beyond a whole replica a GPU, or None for "replica";
    its assumption lines)."""
    if mode == "full":
        host, host_note = sharded_host_offload(o, w)
        sharding = Sharding(o.params, o.micro_batch,
                            grad_bytes=4.0 if o.reduce_dtype == "float32" else 2.0,
                            host_seconds=host)
        return sharding, [host_note, (
            f"sharded full-parameter GRPO (FSDP2 over all N GPUs): per micro-batch of "
            f"{sharding.micro_batch} sequences the {sharding.weight_bytes * o.params / 1e9:.0f}"
            f" GB of bf16 weights are all-gathered for the forward and again for the backward, "
            f"and {sharding.grad_bytes * o.params / 1e9:.0f} GB of {o.reduce_dtype} "
            f"gradients reduce-scattered; the rollout gathers the bf16 weights once a step; "
            f"ring cost (N-1)/N bytes/bw + (N-1) latency over the slowest link; AdamW on 1/N "
            f"of the state; nothing overlapped with compute")]
    if mode == "lora-fsdp":
        sharding = LoraFsdp(o.params, cost.model.lora_params, o.micro_batch,
                            sync=o.weight_sync, hbm=cost.gpu.hbm)
        return sharding, [
            f"LoRA GRPO as the paper ran it (verl, FSDP over all N GPUs): the frozen base's "
            f"{sharding.gather_bytes / 1e9:.0f} GB of bf16 weights are all-gathered per "
            f"micro-batch of {sharding.micro_batch} sequences for the forward and again for "
            f"the backward; {sharding.lora_grad_bytes / 1e6:.0f} MB of fp32 LoRA gradients "
            f"all-reduced per optimizer update; each step the rollout engine (a whole bf16 "
            f"model a GPU) is fed {sharding.sync_bytes / 1e9:.3g} GB of new weights "
            + ("(the whole model with the LoRA folded in, gathered from the shards)" if
               o.weight_sync == "model" else "(the adapter alone)") +
            " and copies them in at HBM speed (--weight-sync); ring cost (N-1)/N bytes/bw + "
            "(N-1) latency over the slowest link; the old log-probs' forward pass is in the "
            "training FLOPs but gathers nothing more; nothing overlapped with compute"]
    return None, []


def sharded_host_offload(o: ScalingOptions, w: Workload) -> tuple:
    """:func:`compare.plan_terms.host_offload` of the options' setting, computed for the
    Qwen2.5-32B shape the model defaults to; other shapes get no term, and a note saying so."""
    m = QWEN25_32B
    if (o.params, o.layers, o.hidden, o.intermediate, o.kv_dim) != (
            m.params, m.layers, m.hidden, m.intermediate, m.kv_dim):
        return (), ("host offload of the training state during rollouts: not computed for a "
                    "model other than Qwen2.5-32B (hpc-plan gives it for a config.json)")
    return host_offload(ModelShape.qwen25("32B"), o.gpus, gpu_gb=GPUS[o.gpu].memory / 1e9,
                        micro_batch=o.micro_batch, batch_prompts=w.fgrpo_batch,
                        generations=w.fgrpo_generations, max_new=o.max_new_tokens,
                        prompt=o.prompt_tokens)


def planned_decoding(o: ScalingOptions, minibatch: int) -> dict:
    """{"essa", "fgrpo": Decoding} from the memory plan (:mod:`compare.plan_terms`) for
    ``--concurrency plan`` (at the smallest of ``--gpus``: FSDP2's shards shrink with more),
    {} for the reference ``kv``."""
    if o.concurrency == "kv":
        return {}
    shape = model_shape(o.layers, o.hidden, o.intermediate, o.kv_dim)
    cfg = plan_config(o.config, lora_rank=o.lora_rank, prompt=o.prompt_tokens,
                      max_new=o.max_new_tokens, gpu_gb=GPUS[o.gpu].memory / 1e9,
                      minibatch=minibatch, essa_quantize=o.essa_quantize,
                      full=o.full_finetune, sharded=o.layout == "full",
                      micro_batch=o.micro_batch)
    gpus = min(o.gpus)
    terms = {"essa": essa_decoding(shape, cfg, gpus), "fgrpo": fgrpo_decoding(shape, cfg, gpus)}
    for d in terms.values():
        if d.concurrency < 1:
            raise UserError(f"{d.method}: the memory plan's engine holds no sequence of "
                            f"{o.prompt_tokens}+{o.max_new_tokens} tokens on a "
                            f"{GPUS[o.gpu].memory / 1e9:.0f} GB GPU (hpc-plan says why)")
    return terms
