"""The policy F-GRPO trains and its reference: building them, and :class:`TrainedPolicy`,
everything of the job-loop method but its step (the log-probs without gradient are
:mod:`fgrpo.step`'s)."""
from __future__ import annotations

import contextlib
import copy

import torch

from hpc.gradient_method import GradientMethod
from hpc.job.lifecycle import on_all_ranks, stop_if_preempted
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import attach_lora, load_adapter, load_model
from fgrpo.plan import fgrpo_rollout_rows
from hpc.models.parallelize import (TrainedWeights, decoding, load_dtype, load_sharded_state,
                                    save_full_model, save_gathered_adapter, settle, shard_units,
                                    sharded_state)
from hpc.runtime.dist import init_process_group
from hpc.runtime.readback import count


def build_model(cfg, device):
    """(policy, reference or None, tokenizer): LoRA (fresh or from lora.adapter) or full FT,
    in fp32 and sharded as it loads under fgrpo.parallel.strategy=fsdp2 (see
    :mod:`hpc.models.parallelize`; the process group must exist). With ``model.quantize`` the
    LoRA policy decodes from a quantised copy of its frozen base linears, made as each arrives
    (:class:`hpc.models.quantize.GenerationCopy`), and trains on its own."""
    sharded = cfg.fgrpo.parallel.strategy == "fsdp2"

    def load(wrap=None, quantize="none"):
        return load_model(cfg.model.path, load_dtype(cfg.fgrpo.parallel.strategy,
                                                     cfg.model.dtype), device,
                          load=cfg.model.load, wrap=wrap, quantize=quantize, quantized_copy=True,
                          shard=(lambda m: shard_units(m, cfg.model.dtype)) if sharded else None)

    if cfg.fgrpo.full_finetune:
        model, tok = load()
        ref = None
        if cfg.fgrpo.loss.beta > 0:  # sharded: loaded again, never a whole copy
            ref = (load()[0] if sharded else copy.deepcopy(model)).eval()
        return model, ref, tok
    if cfg.lora.adapter:
        wrap = lambda base: load_adapter(base, cfg.lora.adapter, is_trainable=True)  # noqa: E731
    else:
        wrap = lambda base: attach_lora(base, cfg.lora.rank, cfg.lora.alpha,  # noqa: E731
                                        cfg.lora.targets, 0.0, seed=cfg.run.seed)
    policy, tok = load(wrap, cfg.model.quantize)
    return policy, None, tok


class TrainedPolicy(GradientMethod):
    """The F-GRPO job-loop method without its step: the policy built, sharded (FSDP2) and
    parametrised (``fgrpo.space``), decoded with the weights gathered and the training state
    offloaded, exported and checkpointed. :class:`fgrpo.trainer.FGRPO` adds the step."""

    def build_policy(self) -> None:
        """``model``, ``ref_model``, ``tok``, ``params`` and ``weights`` (fp32 masters and AdamW,
        :class:`hpc.models.parallelize.TrainedWeights`) on every rank."""
        job, cfg, world, f = self.job, self.job.cfg, self.job.world, self.job.cfg.fgrpo
        torch.manual_seed(cfg.run.seed)
        init_process_group(world, job.device)  # FSDP2 shards the model as it loads
        self.model, self.ref_model, self.tok = on_all_ranks(world, lambda: build_model(
            cfg, job.device))
        stop_if_preempted(job, "model and adapter loading")
        self.checkpointed = self.checkpoint_activations()
        self.sharded = f.parallel.strategy == "fsdp2"
        if self.sharded:
            for m in (self.model, self.ref_model):
                if m is not None:
                    settle(m)
        self.space = None
        if f.space == "sv":  # ESSA's search space, trained by gradient
            self.space = SingularValueSpace.from_peft(self.model, f.alpha, cfg.lora.targets)
            self.params = self.space.parametrize(self.model)
        else:
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.weights = TrainedWeights(self.params, f.optim.learning_rate, f.optim.weight_decay)
        self.offload = job.plan.choice("offload")
        self.keep_engine = job.plan.choice("rollout_engine_kept")
        self.collective_export = f.full_finetune or self.sharded  # gathers, rank 0 writes

    @contextlib.contextmanager
    def decoding(self, phase: str | None = "gather_weights"):
        """The rollout's or evaluation's weights (:func:`hpc.models.parallelize.decoding`):
        gathered under FSDP2, with the training state ``fgrpo.parallel.offload`` names in host
        memory; gathering and offloading, there and back, are timed as ``phase`` (None: the caller's
        phase, as the job loop's ``eval``)."""
        timed = self.timer.phase if phase else lambda _: contextlib.nullcontext()
        with contextlib.ExitStack() as stack:
            with timed(phase):
                stack.enter_context(decoding(self.model, self.weights, self.offload,
                                             self.job.decoder, self.ref_model))
            yield
            with timed(phase):
                stack.close()

    def step_decode(self) -> tuple:
        """A rollout: min(model.decode_batch, this rank's prompts) x G rows, the own adapter."""
        cfg = self.job.cfg
        return fgrpo_rollout_rows(cfg, self.job.world.size), 0 if self.f.full_finetune else 1

    def evaluate(self, sampled: bool):
        with self.decoding(phase=None):
            return super().evaluate(sampled)

    def export(self, out_dir: str, step: int) -> None:
        """LoRA: the peft adapter ``<out_dir>/adapter``; full fine-tuning: the model
        ``<out_dir>/model``. Full fine-tuning or FSDP2: every rank calls this
        (``collective_export``) to gather the weights, rank 0 writes."""
        is_root = self.job.world.is_root
        if self.f.full_finetune:
            save_full_model(self.model, self.tok, f"{out_dir}/model", self.job.cfg.model.dtype,
                            is_root)
        elif self.sharded:
            save_gathered_adapter(self.model, f"{out_dir}/adapter", is_root)
        elif self.space is not None:
            self.space.save_parametrized(self.model, f"{out_dir}/adapter")
        else:
            super().export(out_dir, step)

    def state_dict(self) -> dict:
        """Replicated state: the step-skip count, and under DDP the trained weights."""
        weights = {} if self.sharded else self.weights.state_dict()
        return dict(weights, skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        skipped = count(state["skipped"], "F-GRPO checkpoint", "skipped")
        if not self.sharded:
            self.weights.load_state_dict(state)
        self.skipped = skipped

    def sharded_state_dict(self) -> dict:
        """FSDP2: the sharded fp32 masters and AdamW moments (saved and resharded by DCP)."""
        return sharded_state(self.model, self.weights)

    def load_sharded_state_dict(self, state: dict) -> None:
        load_sharded_state(self.model, self.weights, state)
