"""F-GRPO job configuration. Option names follow TRL's GRPOConfig where one exists."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

from fgrpo.surrogates import surrogates
from hpc.runtime.config import JobConfig, param
from hpc.runtime.errors import UserError

# Aggregations of the policy loss (implemented in fgrpo.loss; declared here so that the config,
# and with it `fgrpo --help`, needs no torch).
LOSS_TYPES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
              "seq-mean-token-sum-norm")

# fgrpo.algorithm: the keys each preset sets, unless the config file or command line sets them;
# plain data: a value is the key's value, or {"of": "section.key", "divided_by": n, "at_least":
# m} for max(m, that key's value // n). grpo leaves the keys' defaults (clip surrogate, token-mean,
# clip 0.2 / 0.28). dapo: DAPO (arXiv 2503.14476) as verl's recipe runs it: clip-higher 0.2 /
# 0.28, token-mean, dynamic sampling (filter_groups, max_num_gen_batches=10: 9 refills) and the
# soft overlong punishment over the last fifth of the length limit (4096 of 20480 there),
# penalty factor 1. cispo: MiniMax-M1's CISPO (arXiv 2506.13585), token-mean, the importance
# weight clipped to [0, 5] (TRL's loss_type="cispo" with epsilon_high=5.0).
PRESETS = {
    "grpo": {"surrogate": "clip", "dynamic_sampling": False, "overlong_buffer": 0,
             "overlong_filter": False},
    "dapo": {"surrogate": "clip", "loss_type": "token-mean", "epsilon": 0.2,
             "epsilon_high": 0.28, "dynamic_sampling": True, "max_refills": 9,
             "overlong_buffer": {"of": "task.max_new_tokens", "divided_by": 5, "at_least": 1},
             "overlong_penalty": 1.0, "overlong_filter": False},
    "cispo": {"surrogate": "cispo", "loss_type": "token-mean", "cispo_epsilon_low": 1.0,
              "cispo_epsilon_high": 4.0, "clip_ratio_c": 0.0, "dynamic_sampling": False,
              "overlong_buffer": 0, "overlong_filter": False},
}


@dataclass
class FGRPOConfig:
    command: typing.ClassVar[str] = "fgrpo"  # the console command of the method
    algorithm: str = param("grpo", "preset of the loss and sampling keys (each still "
                           "overridable; the resolved values are in the run file's config): "
                           "grpo; dapo: dynamic sampling, overlong shaping, token-mean, clip "
                           "0.2/0.28; cispo: surrogate=cispo, token-mean. fgrpo.gamma=0 gives "
                           "the plain algorithm, gamma > 0 its focal (F-) variant",
                           choices=list(PRESETS))
    steps: int = param(50, "optimizer steps (each on a fresh batch of prompts)",
                       min=1, max=1_000_000)
    batch_prompts: int = param(32, "prompts per step, over all ranks", min=1, max=1_000_000)
    num_generations: int = param(8, "G: completions sampled per prompt (TRL num_generations); "
                                 "group advantages need G >= 2", min=2, max=1024)
    gamma: float = param(1.0, "focal exponent: advantages scaled by (1 - p)^gamma; 0 = plain "
                         "GRPO", min=0.0, max=100.0)
    success_threshold: float = param(1.0, "a completion with reward >= this is a success: p in "
                                     "the focal weight is the group's share of successes, and "
                                     "the logged success_rate counts the same",
                                     min=-1e6, max=1e6)
    scale_rewards: str = param("group", "advantage std scaling (TRL scale_rewards); none = "
                               "Dr. GRPO", choices=["group", "batch", "none"])
    advantage_epsilon: float = param(1e-4, "added to the reward std in the advantage "
                                     "denominator (TRL's 1e-4; verl uses 1e-6)", min=0.0,
                                     max=1.0)
    loss_type: str = param("token-mean", "aggregation: token-mean (DAPO), seq-mean-token-mean "
                           "(GRPO), seq-mean-token-sum (verl), seq-mean-token-sum-norm "
                           "(Dr. GRPO)", choices=list(LOSS_TYPES))
    epsilon: float = param(0.2, "lower clip of the importance ratio", min=0.0, max=10.0)
    epsilon_high: float = param(0.28, "upper clip (clip-higher as in DAPO)", min=0.0, max=10.0)
    clip_ratio_c: float = param(0.0, "dual-clip PPO (verl clip_ratio_c, 3 there): the loss of "
                                "a negative-advantage token A < 0 is capped at "
                                "-clip_ratio_c * A; 0 = off (as TRL), else > 1", min=0.0,
                                max=1000.0)
    surrogate: str = param("clip", "per-token policy objective: clip: PPO's clipped ratio "
                           "(GRPO, DAPO); cispo: -sg(clip(ratio)) * A * log pi, every token "
                           "keeps its gradient (MiniMax-M1); or another registered one "
                           "(fgrpo.surrogates entry points)", choices=sorted(surrogates()))
    cispo_epsilon_low: float = param(1.0, "surrogate=cispo: the importance weight's lower "
                                     "bound is 1 - this (1 = none)", min=0.0, max=1.0)
    cispo_epsilon_high: float = param(4.0, "surrogate=cispo: its upper bound is 1 + this "
                                      "(4: TRL's epsilon_high=5.0)", min=0.0, max=1000.0)
    dynamic_sampling: bool = param(False, "DAPO: drop groups whose rewards are all equal and "
                                   "roll out more prompts (drawn from the shared seed) until "
                                   "the step has fgrpo.batch_prompts informative groups")
    max_refills: int = param(9, "dynamic sampling: extra rounds of fgrpo.batch_prompts "
                             "prompts at most; then the step trains on what it has and logs "
                             "the shortfall (verl max_num_gen_batches - 1)", min=0, max=1000)
    filtered_share: float = param(0.0, "hpc-plan and the scaling model: the share of groups "
                                  "dynamic sampling is expected to filter (a pilot run's "
                                  "mean filtered_share metric), to count the extra rollouts",
                                  min=0.0, max=0.99)
    overlong_buffer: int = param(0, "DAPO soft overlong punishment: completions longer than "
                                 "task.max_new_tokens - this get a reward penalty rising "
                                 "linearly to fgrpo.overlong_penalty at the limit (tokens, "
                                 "0 = off)", min=0, max=32768)
    overlong_penalty: float = param(1.0, "penalty at the length limit (verl "
                                    "overlong_buffer.penalty_factor)", min=0.0, max=1000.0)
    overlong_filter: bool = param(False, "DAPO overlong filtering: completions cut by "
                                  "task.max_new_tokens are masked out of the loss")
    beta: float = param(0.0, "KL penalty to the reference (k3); under LoRA the reference is the "
                        "base model with the adapter disabled", min=0.0, max=1000.0)
    num_iterations: int = param(1, "mu: optimizer passes over the same rollouts", min=1, max=1000)
    learning_rate: float = param(2e-3, "AdamW learning rate", min=0.0, max=10.0)
    weight_decay: float = param(0.0, "AdamW weight decay", min=0.0, max=10.0)
    max_grad_norm: float = param(1.0, "gradient clipping (0 = off)", min=0.0, max=1e6)
    micro_batch: int = param(64, "sequences per forward/backward (gradient accumulation)",
                             min=1, max=65536)
    temperature: float = param(1.0, "rollout sampling temperature", min=0.0, max=100.0)
    top_p: float = param(1.0, "rollout nucleus sampling", min=0.0, max=1.0)
    full_finetune: bool = param(False, "train every weight instead of a LoRA (fp32 master "
                                "weights and AdamW state, model.dtype compute)")
    parallelism: str = param("ddp", "ddp: every rank holds the model, gradients all-reduced; "
                             "fsdp2: weights, gradients and AdamW state sharded over the ranks "
                             "(torch fully_shard per decoder layer), fp32 masters, model.dtype "
                             "compute; needs fgrpo.batch_prompts divisible by the ranks",
                             choices=["ddp", "fsdp2"])
    offload: str = param("auto", "training state moved to host memory while the GPU decodes "
                         "(rollouts, evaluations), for the gathered weights and KV cache: "
                         "none; optimizer: the AdamW moments and DDP's fp32 master copies; "
                         "state: also FSDP2's fp32 weight shards; auto: the first of these "
                         "under which the memory plan fits (none off CUDA); costs two "
                         "host-device copies of what moves per rollout (hpc-plan prints the "
                         "bytes and seconds)", choices=["auto", "none", "optimizer", "state"])
    space: str = param("lora", "what the gradient trains: lora: every LoRA entry; sv: only "
                       "offsets to the top singular values of each factor of the SFT adapter "
                       "lora.adapter (ESSA's search space, essa.space=sv)",
                       choices=["lora", "sv"])
    alpha: float = param(1.0, "space=sv: trained fraction of each factor's singular values "
                         "(top ceil(alpha*r), as essa.alpha)", above=0.0, max=1.0)
    keep_checkpoints: int = param(3, "newest checkpoints kept", min=1, max=1000)

    def resolve(self, job, given: frozenset) -> None:
        """Set the keys of ``algorithm``'s preset (:data:`PRESETS`) that the config file and
        command line left unset (``given``); a share of another key is read from ``job``."""
        for key, value in PRESETS[self.algorithm].items():
            if key in given:
                continue
            if isinstance(value, dict):
                section, name = value["of"].split(".")
                value = max(value["at_least"], getattr(getattr(job, section), name)
                            // value["divided_by"])
            setattr(self, key, value)


@dataclass
class FGRPOJobConfig(JobConfig):
    per_rank_key = "fgrpo.batch_prompts"
    fgrpo: FGRPOConfig = field(default_factory=FGRPOConfig)

    def validate_world(self, world) -> None:
        super().validate_world(world)
        if self.fgrpo.parallelism == "fsdp2" and self.fgrpo.batch_prompts % world.size:
            raise UserError(f"config key 'fgrpo.batch_prompts': {self.fgrpo.batch_prompts} "
                            f"prompts do not split evenly over {world.size} ranks; "
                            f"fgrpo.parallelism=fsdp2 runs every forward on all ranks "
                            f"together, so each needs the same number of rows")

    def validate(self):
        f = self.fgrpo
        if f.surrogate == "cispo" and f.clip_ratio_c:
            raise UserError(f"config key 'fgrpo.clip_ratio_c': {f.clip_ratio_c} is a dual clip "
                            f"of the clip surrogate; fgrpo.surrogate=cispo has none (set "
                            f"fgrpo.clip_ratio_c=0)")
        if f.overlong_buffer > self.task.max_new_tokens:
            raise UserError(f"config key 'fgrpo.overlong_buffer': {f.overlong_buffer} tokens "
                            f"exceed the length limit task.max_new_tokens="
                            f"{self.task.max_new_tokens}")
        if f.dynamic_sampling and f.parallelism == "fsdp2":
            raise UserError("config key 'fgrpo.dynamic_sampling': the informative groups a "
                            "rank keeps differ in number; fgrpo.parallelism=fsdp2 needs the "
                            "same rows on every rank (use parallelism=ddp)")
        if 0.0 < self.fgrpo.clip_ratio_c <= 1.0:
            raise UserError(f"config key 'fgrpo.clip_ratio_c': {self.fgrpo.clip_ratio_c} must "
                            f"be 0 (dual clip off) or > 1")
        if self.fgrpo.space == "sv" and self.fgrpo.full_finetune:
            raise UserError("config key 'fgrpo.space': sv trains offsets to a LoRA adapter's "
                            "singular values; it cannot be combined with fgrpo.full_finetune")
        if self.fgrpo.full_finetune and self.model.quantize != "none":
            raise UserError(f"config key 'model.quantize': {self.model.quantize} quantises a "
                            f"frozen base for rollouts; fgrpo.full_finetune trains the base "
                            f"weights (use LoRA, or model.quantize=none)")
        if self.fgrpo.space == "sv" and not self.lora.adapter:
            raise UserError("config key 'fgrpo.space': sv starts from an SFT adapter; give its "
                            "folder in lora.adapter (hpc-sft writes <run.out>/adapter)")
        if self.fgrpo.space == "sv" and self.fgrpo.parallelism == "fsdp2":
            raise UserError("config key 'fgrpo.parallelism': fsdp2 trains LoRA or full "
                            "fine-tuning; fgrpo.space=sv needs parallelism=ddp")
        if self.fgrpo.space != "sv" and self.fgrpo.alpha != 1.0:
            raise UserError(f"config key 'fgrpo.alpha': {self.fgrpo.alpha} applies only to "
                            f"fgrpo.space=sv")
