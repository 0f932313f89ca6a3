"""ESSA job configuration (the ``essa`` section plus the shared sections)."""
from __future__ import annotations

from dataclasses import dataclass, field

from essa.optimizers import OPTIMIZERS
from hpc.job.config import JobConfig
from hpc.runtime.config import param, require_per_rank
from hpc.runtime.errors import UserError


@dataclass
class ESSAConfig:
    optimizer: str = param("cma", "cma (full covariance, pycma), sep-cma (diagonal), openai-es",
                           choices=OPTIMIZERS)
    space: str = param("sv", "sv: offsets to the adapter's singular values; lora: every "
                       "adapter entry (use with openai-es)", choices=["sv", "lora"])
    alpha: float = param(1.0, "searched fraction of each factor's singular values (top "
                         "ceil(alpha*r))", min=0.0, max=1.0)
    population: int = param(96, "population size P (paper: 24-128); must be >= ranks",
                            min=2, max=100_000)
    minibatch: int = param(100, "training prompts M scored per generation (paper: 100-500)",
                           min=1, max=1_000_000)
    sigma0: float = param(0.3, "initial step size of the search distribution",
                          above=0.0, max=100.0)
    sigma_scale: str = param("relative", "relative: the initial std of each offset is sigma0 "
                             "times its singular value (B's are ~10x smaller than A's); "
                             "absolute: sigma0 for every offset", choices=["relative", "absolute"])
    lr: float = param(0.01, "openai-es: Adam learning rate", above=0.0, max=10.0)
    generations: int = param(100, "stop after this many generations", min=1, max=1_000_000)
    target_accuracy: float = param(0.0, "stop once the mean's held-out accuracy reaches this "
                                   "(0 = off)", min=0.0, max=1.0)
    members_per_pass: int = param(1, "population members evaluated in one batched generation "
                                  "(k)", min=1, max=1024)
    keep_checkpoints: int = param(3, "newest checkpoints kept", min=1, max=1000)


@dataclass
class ESSAJobConfig(JobConfig):
    essa: ESSAConfig = field(default_factory=ESSAConfig)

    def validate(self):
        if self.essa.optimizer == "openai-es" and self.essa.population % 2:
            raise UserError(f"config key 'essa.population': openai-es uses antithetic pairs, "
                            f"so it must be even (got {self.essa.population})")
        if self.essa.space == "lora" and self.essa.optimizer != "openai-es":
            raise UserError("config key 'essa.space': the lora space has millions of "
                            "dimensions; use essa.optimizer=openai-es with it")
        if self.essa.sigma_scale == "relative" and (self.essa.optimizer == "openai-es" or
                                                    self.essa.space == "lora"):
            raise UserError("config key 'essa.sigma_scale': relative scaling is for the CMA "
                            "optimizers over singular values; use absolute with openai-es")
        if not self.lora.adapter:
            raise UserError("config key 'lora.adapter': ESSA starts from an SFT adapter; "
                            "give its folder (hpc-sft writes <run.out>/adapter)")

    def validate_world(self, world):
        require_per_rank("essa.population", self.essa.population, world,
                         ": every rank needs at least one member")
