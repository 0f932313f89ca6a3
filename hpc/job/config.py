"""The sections every job has, composed: ``model`` (:mod:`hpc.engine.config`), ``lora``
(:mod:`hpc.models.config`), ``task``, ``reward`` (:mod:`hpc.data.config`), ``plan``
(:mod:`hpc.plan.config`) and the two a job's loop owns, ``eval`` (held-out evaluation and pass@k) and ``run`` (output, budgets, checkpoints). A
method's job config subclasses :class:`JobConfig` and adds its own section. Torch-free."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from hpc.data.config import RewardModelConfig, TaskConfig
from hpc.engine.config import ModelConfig
from hpc.models.config import LoraConfig
from hpc.plan.config import PlanConfig
from hpc.runtime.config import get_key, param, require_per_rank
from hpc.runtime.methods import methods


@dataclass
class EvalConfig:
    every: int = param(10, "held-out evaluation every this many steps/generations (0 = end "
                       "only); the last step is always evaluated, also when a budget ends the run",
                       min=0, max=1_000_000)
    sampled_every: int = param(0, "also a sampled evaluation (pass@k from n_samples, group "
                               "eval of the run file, as at the start and the end) every this "
                               "many steps/generations: the checkpoints hpc-report reproduce "
                               "--checkpoint paper chooses from (0 = start and end only)",
                               min=0, max=1_000_000)
    n_samples: int = param(8, "sampled completions per prompt for pass@k (k = 1..n)",
                           min=1, max=1024)
    temperature: float = param(1.0, "sampling temperature for pass@k", min=0.0, max=100.0)
    top_p: float = param(1.0, "nucleus sampling for pass@k", min=0.0, max=1.0)
    batch_size: int = param(64, "prompts per decoding batch of held-out evaluation (greedy and "
                            "pass@k; model.decode_batch is training's)", min=1, max=4096)
    sample_chunk: int = param(0, "pass@k: samples per prompt decoded at a time; each chunk is "
                              "graded and only its per-problem success counts kept, so long "
                              "completions of all n_samples are never held at once (0 = all "
                              "n_samples at once)", min=0, max=1024)


@dataclass
class RunConfig:
    out: str = param("runs/{method}-{jobid}", "output folder; {method} and {jobid} (Slurm's "
                     "job id, else the start time) are filled in; --resume outside Slurm with "
                     "{jobid} in it resumes the newest unfinished run of the method it names")
    seed: int = param(0, "training seed", min=0, max=2**32 - 1)
    max_time_s: float = param(0.0, "stop after this wall time in seconds (0 = no limit)",
                              min=0.0, max=1e8)
    max_train_s: float = param(0.0, "stop after this much training time in seconds: wall time "
                               "less held-out evaluations and checkpoints, the same budget for "
                               "methods that evaluate differently (0 = no limit)",
                               min=0.0, max=1e8)
    max_generated_tokens: int = param(0, "stop once the training steps have generated this many "
                                      "completion tokens, all ranks together (0 = no limit)",
                                      min=0, max=10**15)
    checkpoint_every: int = param(0, "checkpoint every this many steps (0 = end only)",
                                  min=0, max=1_000_000)
    progress: bool = param(True, "progress bar on rank 0")
    min_free_mb: float = param(512.0, "refuse to start when the output folder's disk has less "
                               "free space than this (MiB): checkpoints and logs need room",
                               min=0.0, max=1e12)
    report_to: list = param(["none"], "training jobs: where the run file's scalars also go, "
                            "rank 0 only: tensorboard (<run.out>/tensorboard), wandb (offline "
                            "unless WANDB_MODE says otherwise, <run.out>/wandb), both (a list), "
                            "or none; each needs the package extra of its name",
                            choices=["none", "tensorboard", "wandb"])
    collective_timeout_s: float = param(600.0, "a rank that has not reached a step's exchange "
                                        "after this many seconds is named and the job aborted",
                                        min=1.0, max=604800.0)


@dataclass
class JobConfig:
    """The sections every job has; a method's job config subclasses it and adds its own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    reward: RewardModelConfig = field(default_factory=RewardModelConfig)
    # "section.key" of a count every rank needs at least one of ("" = none): a method sets it
    per_rank_key: typing.ClassVar[str] = ""

    def validate_world(self, world) -> None:
        """The checks that need the world (run on every rank before any loading)."""
        if self.per_rank_key:
            require_per_rank(self.per_rank_key, get_key(self, self.per_rank_key), world)


def plan_job_class() -> type:
    """A job config with the sections of every planned method (``hpc-plan``,
    ``hpc-scaling``): one file configures them all."""
    from hpc.plan.registry import planned_methods  # the plan modules, only when asked

    sections = {name: methods()[name].section_class() for name in planned_methods()}
    fields = [(name, cls, field(default_factory=cls)) for name, cls in sections.items()]
    return dataclasses.make_dataclass("PlanJobConfig", fields, bases=(JobConfig,))
