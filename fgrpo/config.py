"""F-GRPO job configuration: the ``fgrpo`` section, split by concern into nested sections
(``fgrpo.sampling``, ``fgrpo.reward``, ``fgrpo.advantage``, ``fgrpo.loss``, ``fgrpo.optim``,
``fgrpo.parallel``); each surrogate of the loss brings its own section (``fgrpo.loss.clip``,
``fgrpo.loss.cispo``: :mod:`fgrpo.surrogates`). Option names follow TRL's GRPOConfig where one
exists. Keys of the flat section of earlier versions still work (:data:`RENAMED`).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from fgrpo.surrogates import surrogate_sections, surrogates
from hpc.job.config import JobConfig
from hpc.runtime.config import get_key, param, set_key
from hpc.runtime.errors import UserError

# Aggregations of the policy loss (implemented in fgrpo.loss; declared here so that the config,
# and with it `fgrpo --help`, needs no torch).
LOSS_TYPES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
              "seq-mean-token-sum-norm")

# fgrpo.algorithm: the keys (below fgrpo) each preset sets, unless the config file or command
# line sets them, each with its source: (key, value, source). A value is the key's value, or
# {"of": "section.key", "divided_by": n, "at_least": m} for max(m, that key's value // n).
# The F-GRPO paper (arXiv 2602.06717 v2, Tables 5 and 7) states per algorithm the clip range
# and gamma (chosen by in-domain pass@1 on Qwen2.5-7B); it is silent about DAPO's dynamic
# sampling and overlong shaping, which are DAPO's own (arXiv 2503.14476) as verl's recipe runs
# them: max_num_gen_batches=10 (9 refills), the soft overlong punishment over the last fifth of
# the length limit (4096 of 20480 there), penalty factor 1.
#
# CISPO's bound: the paper gives eps_low 1.0, eps_high 5.0. Two conventions exist: MiniMax-M1's
# (arXiv 2506.13585, also SkyRL and slime) clips the importance weight to
# [1 - eps_low, 1 + eps_high], so (1.0, 5.0) is [0, 6]; TRL's loss_type="cispo" clips it to
# [., epsilon_high] with no lower bound, so 5.0 there is [0, 5]. The paper's eps_low 1.0 has a
# meaning only in the first (1 - 1.0 = 0: no lower bound, as MiniMax-M1 runs it), so the preset
# reads the paper's pair in that convention, which is this package's (fgrpo.loss.cispo.*):
# [0, 6]. TRL's epsilon_high=5.0 is fgrpo.loss.cispo.epsilon_high=4.0 here.
PAPER = "F-GRPO paper, Tables 5 and 7"
DAPO = "DAPO's own (arXiv 2503.14476, verl's recipe); the F-GRPO paper is silent"
PRESET_TABLE = {
    "grpo": (("loss.surrogate", "clip", PAPER), ("loss.clip.epsilon", 0.2, PAPER),
             ("loss.clip.epsilon_high", 0.2, PAPER), ("advantage.gamma", 0.5, PAPER),
             ("sampling.dynamic_sampling", False, PAPER), ("reward.overlong_buffer", 0, PAPER),
             ("loss.overlong_filter", False, PAPER)),
    "dapo": (("loss.surrogate", "clip", PAPER), ("loss.aggregation", "token-mean", DAPO),
             ("loss.clip.epsilon", 0.2, PAPER), ("loss.clip.epsilon_high", 0.28, PAPER),
             ("advantage.gamma", 0.5, PAPER), ("sampling.dynamic_sampling", True, DAPO),
             ("sampling.max_refills", 9, DAPO),
             ("reward.overlong_buffer", {"of": "task.max_new_tokens", "divided_by": 5,
                                         "at_least": 1}, DAPO),
             ("reward.overlong_penalty", 1.0, DAPO), ("loss.overlong_filter", False, DAPO)),
    "cispo": (("loss.surrogate", "cispo", PAPER),
              ("loss.aggregation", "token-mean", "MiniMax-M1 (arXiv 2506.13585)"),
              ("loss.cispo.epsilon_low", 1.0, PAPER),
              ("loss.cispo.epsilon_high", 5.0, PAPER + ": [0, 6], MiniMax-M1's convention"),
              ("advantage.gamma", 1.0, PAPER), ("sampling.dynamic_sampling", False, PAPER),
              ("reward.overlong_buffer", 0, PAPER), ("loss.overlong_filter", False, PAPER)),
}
PRESETS = {name: {key: value for key, value, _ in rows} for name, rows in PRESET_TABLE.items()}

# What each preset set before it took the F-GRPO paper's values (run files and configs of
# earlier versions): a config that leaves one of these keys to the preset gets a note line.
EARLIER_PRESETS = {"grpo": {"loss.clip.epsilon_high": 0.28, "advantage.gamma": 1.0},
                   "dapo": {"advantage.gamma": 1.0},
                   "cispo": {"loss.cispo.epsilon_high": 4.0}}  # its gamma stays 1.0


def preset_text(name: str) -> str:
    """One preset's values with their sources, for ``fgrpo --help``."""
    by_source: dict[str, list[str]] = {}
    for key, value, source in PRESET_TABLE[name]:
        shown = (f"max({value['at_least']}, {value['of']} // {value['divided_by']})"
                 if isinstance(value, dict) else value)
        by_source.setdefault(source, []).append(f"{key}={shown}")
    return f"{name}: " + "; ".join(f"{', '.join(keys)} [{source}]"
                                   for source, keys in by_source.items())


@dataclass
class SamplingConfig:
    """The rollouts of a step: how many, how sampled, DAPO's dynamic sampling."""

    num_generations: int = param(8, "G: completions sampled per prompt (TRL num_generations); "
                                 "group advantages need G >= 2", min=2, max=1024)
    temperature: float = param(1.0, "rollout sampling temperature", min=0.0, max=100.0)
    top_p: float = param(1.0, "rollout nucleus sampling", min=0.0, max=1.0)
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


@dataclass
class RewardConfig:
    """What counts as a success, and DAPO's soft overlong punishment of the rewards."""

    success_threshold: float = param(1.0, "a completion with reward >= this is a success: p in "
                                     "the focal weight is the group's share of successes, and "
                                     "the logged success_rate counts the same",
                                     min=-1e6, max=1e6)
    overlong_buffer: int = param(0, "DAPO soft overlong punishment: completions longer than "
                                 "task.max_new_tokens - this get a reward penalty rising "
                                 "linearly to fgrpo.reward.overlong_penalty at the limit "
                                 "(tokens, 0 = off)", min=0, max=32768)
    overlong_penalty: float = param(1.0, "penalty at the length limit (verl "
                                    "overlong_buffer.penalty_factor)", min=0.0, max=1000.0)


@dataclass
class AdvantageConfig:
    """Group advantages of the shaped rewards, scaled by the focal weight (1 - p)^gamma."""

    gamma: float = param(0.5, "focal exponent: advantages scaled by (1 - p)^gamma; 0 = plain "
                         "GRPO (each fgrpo.algorithm sets its paper value: 0.5 grpo and dapo, "
                         "1.0 cispo)", min=0.0, max=100.0)
    scale_rewards: str = param("group", "advantage std scaling (TRL scale_rewards); none = "
                               "Dr. GRPO", choices=["group", "batch", "none"])
    epsilon: float = param(1e-4, "added to the reward std in the advantage denominator (TRL's "
                           "1e-4; verl uses 1e-6)", min=0.0, max=1.0)


@dataclass
class LossKeys:
    """The policy loss: a surrogate (each registered one has its section beside these keys),
    its aggregation, the KL term."""

    surrogate: str = param("clip", "per-token policy objective: clip: PPO's clipped ratio "
                           "(GRPO, DAPO; keys fgrpo.loss.clip.*); cispo: -sg(clip(ratio)) * A * "
                           "log pi, every token keeps its gradient (MiniMax-M1; keys "
                           "fgrpo.loss.cispo.*); or another registered one (fgrpo.surrogates "
                           "entry points); each reads only its own section",
                           choices=sorted(surrogates()))
    aggregation: str = param("token-mean", "how per-token losses become the loss (TRL "
                             "loss_type's aggregation): token-mean (DAPO), seq-mean-token-mean "
                             "(GRPO), seq-mean-token-sum (verl), seq-mean-token-sum-norm "
                             "(Dr. GRPO)", choices=list(LOSS_TYPES))
    beta: float = param(0.0, "KL penalty to the reference (k3); under LoRA the reference is the "
                        "base model with the adapter disabled", min=0.0, max=1000.0)
    overlong_filter: bool = param(False, "DAPO overlong filtering: completions cut by "
                                  "task.max_new_tokens are masked out of the loss")


# fgrpo.loss: LossKeys plus one nested section per registered surrogate that has parameters,
# named as registered (fgrpo.loss.clip, fgrpo.loss.cispo), its class its own declaration.
SURROGATE_SECTIONS = surrogate_sections()
LossConfig = dataclasses.make_dataclass(
    "LossConfig", [(name, cls, field(default_factory=cls))
                   for name, cls in SURROGATE_SECTIONS.items()], bases=(LossKeys,))
LossConfig.__module__ = __name__


@dataclass
class OptimConfig:
    """The gradient steps: AdamW, clipping, passes over a step's rollouts, micro-batches."""

    learning_rate: float = param(2e-3, "AdamW learning rate (after the warm-up)", min=0.0,
                                 max=10.0)
    warmup_steps: int = param(0, "linear learning-rate warm-up over this many steps: step i "
                              "(from 0) trains at learning_rate * min(1, i / warmup_steps), "
                              "so step 0 at 0, as verl's optim.lr_warmup_steps (transformers' "
                              "constant schedule with warm-up); 0 = off", min=0, max=1_000_000)
    weight_decay: float = param(0.0, "AdamW weight decay (decoupled, torch.optim.AdamW)",
                                min=0.0, max=10.0)
    max_grad_norm: float = param(1.0, "gradient clipping of each update (0 = off)", min=0.0,
                                 max=1e6)
    num_iterations: int = param(1, "PPO epochs (TRL num_iterations, verl ppo_epochs): passes "
                                "over the same rollouts, each of fgrpo.batch_prompts / "
                                "mini_batch_prompts optimizer updates", min=1, max=1000)
    mini_batch_prompts: int = param(0, "prompts (with their G completions, over all ranks) "
                                    "per optimizer update (verl ppo_mini_batch_size): a step's "
                                    "batch gives fgrpo.batch_prompts / this updates a pass, "
                                    "the clip acting between them; group i of the batch "
                                    "goes to update i mod that count (the same on any number "
                                    "of ranks); 0 = fgrpo.batch_prompts: one update a pass",
                                    min=0, max=1_000_000)
    micro_batch: int = param(64, "sequences per forward/backward (gradient accumulation)",
                             min=1, max=65536)


@dataclass
class ParallelConfig:
    """How the training state is spread over the ranks and where it waits during decoding."""

    strategy: str = param("ddp", "ddp: every rank holds the model, gradients all-reduced; "
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


# The keys of the flat fgrpo section of earlier versions, at their place today: read there
# from an old config file, command line or run file, with a line naming the new key.
RENAMED = {
    "num_generations": "sampling.num_generations", "temperature": "sampling.temperature",
    "top_p": "sampling.top_p", "dynamic_sampling": "sampling.dynamic_sampling",
    "max_refills": "sampling.max_refills", "filtered_share": "sampling.filtered_share",
    "success_threshold": "reward.success_threshold",
    "overlong_buffer": "reward.overlong_buffer", "overlong_penalty": "reward.overlong_penalty",
    "gamma": "advantage.gamma", "scale_rewards": "advantage.scale_rewards",
    "advantage_epsilon": "advantage.epsilon",
    "surrogate": "loss.surrogate", "loss_type": "loss.aggregation", "beta": "loss.beta",
    "overlong_filter": "loss.overlong_filter", "epsilon": "loss.clip.epsilon",
    "epsilon_high": "loss.clip.epsilon_high", "clip_ratio_c": "loss.clip.ratio_c",
    "cispo_epsilon_low": "loss.cispo.epsilon_low",
    "cispo_epsilon_high": "loss.cispo.epsilon_high",
    "learning_rate": "optim.learning_rate", "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm", "num_iterations": "optim.num_iterations",
    "micro_batch": "optim.micro_batch",
    "parallelism": "parallel.strategy", "offload": "parallel.offload",
}


@dataclass
class FGRPOConfig:
    RENAMED: typing.ClassVar[dict] = RENAMED
    algorithm: str = param("grpo", "preset of the loss, sampling and gamma keys (each still "
                           "overridable; the resolved values are in the run file's config). "
                           + " | ".join(preset_text(name) for name in PRESET_TABLE) +
                           ". fgrpo.advantage.gamma=0 gives the plain algorithm, gamma > 0 its "
                           "focal (F-) variant", choices=list(PRESETS))
    steps: int = param(50, "optimizer steps (each on a fresh batch of prompts)",
                       min=1, max=1_000_000)
    batch_prompts: int = param(32, "prompts per step, over all ranks", min=1, max=1_000_000)
    full_finetune: bool = param(False, "train every weight instead of a LoRA (fp32 master "
                                "weights and AdamW state, model.dtype compute)")
    space: str = param("lora", "what the gradient trains: lora: every LoRA entry; sv: only "
                       "offsets to the top singular values of each factor of the SFT adapter "
                       "lora.adapter (ESSA's search space, essa.space=sv)",
                       choices=["lora", "sv"])
    alpha: float = param(1.0, "space=sv: trained fraction of each factor's singular values "
                         "(top ceil(alpha*r), as essa.alpha)", above=0.0, max=1.0)
    keep_checkpoints: int = param(3, "newest checkpoints kept", min=1, max=1000)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def resolve(self, job, given: frozenset, notes: list | None = None) -> None:
        """Set the keys of ``algorithm``'s preset (:data:`PRESETS`) that the config file and
        command line left unset (``given``); a share of another key is read from ``job``. A
        key whose preset value changed (:data:`EARLIER_PRESETS`) adds one line to ``notes``."""
        for key, value in PRESETS[self.algorithm].items():
            if key in given:
                continue
            if isinstance(value, dict):
                value = max(value["at_least"], get_key(job, value["of"]) // value["divided_by"])
            set_key(self, key, value)
        changed = {k: v for k, v in EARLIER_PRESETS[self.algorithm].items() if k not in given}
        if changed and notes is not None:
            notes.append(f"note: fgrpo.algorithm={self.algorithm} now sets the F-GRPO paper's "
                         + ", ".join(f"fgrpo.{k}={PRESETS[self.algorithm][k]}" for k in changed)
                         + " (earlier versions: " + ", ".join(f"{v}" for v in changed.values())
                         + "); set the keys to keep the earlier values")


@dataclass
class FGRPOJobConfig(JobConfig):
    per_rank_key = "fgrpo.batch_prompts"
    fgrpo: FGRPOConfig = field(default_factory=FGRPOConfig)

    def validate_world(self, world) -> None:
        super().validate_world(world)
        if self.fgrpo.parallel.strategy == "fsdp2" and self.fgrpo.batch_prompts % world.size:
            raise UserError(f"config key 'fgrpo.batch_prompts': {self.fgrpo.batch_prompts} "
                            f"prompts do not split evenly over {world.size} ranks; "
                            f"fgrpo.parallel.strategy=fsdp2 runs every forward on all ranks "
                            f"together, so each needs the same number of rows")

    def validate(self):
        f = self.fgrpo
        mini = f.optim.mini_batch_prompts
        if mini and (mini > f.batch_prompts or f.batch_prompts % mini):
            raise UserError(f"config key 'fgrpo.optim.mini_batch_prompts': {mini} prompts do not "
                            f"divide fgrpo.batch_prompts={f.batch_prompts} into whole "
                            f"optimizer updates (0 = one update of the whole batch)")
        for name in SURROGATE_SECTIONS:
            section = getattr(f.loss, name)
            if hasattr(section, "check"):
                section.check(f"fgrpo.loss.{name}")
        if f.reward.overlong_buffer > self.task.max_new_tokens:
            raise UserError(f"config key 'fgrpo.reward.overlong_buffer': "
                            f"{f.reward.overlong_buffer} tokens exceed the length limit "
                            f"task.max_new_tokens={self.task.max_new_tokens}")
        if f.space == "sv" and f.full_finetune:
            raise UserError("config key 'fgrpo.space': sv trains offsets to a LoRA adapter's "
                            "singular values; it cannot be combined with fgrpo.full_finetune")
        if f.full_finetune and self.model.quantize != "none":
            raise UserError(f"config key 'model.quantize': {self.model.quantize} quantises a "
                            f"frozen base for rollouts; fgrpo.full_finetune trains the base "
                            f"weights (use LoRA, or model.quantize=none)")
        if f.space == "sv" and not self.lora.adapter:
            raise UserError("config key 'fgrpo.space': sv starts from an SFT adapter; give its "
                            "folder in lora.adapter (hpc-sft writes <run.out>/adapter)")
        if f.space == "sv" and f.parallel.strategy == "fsdp2":
            raise UserError("config key 'fgrpo.parallel.strategy': fsdp2 trains LoRA or full "
                            "fine-tuning; fgrpo.space=sv needs strategy=ddp")
        if f.space != "sv" and f.alpha != 1.0:
            raise UserError(f"config key 'fgrpo.alpha': {f.alpha} applies only to "
                            f"fgrpo.space=sv")
