"""Console entry points that stand above the methods: ``hpc-sft`` and ``hpc-eval`` (their
``--help`` from the torch-free config classes, the job imported only to run), and ``hpc-plan``,
whose config carries the sections of both ESSA and F-GRPO. ``essa`` and ``fgrpo`` have theirs
in ``essa/__main__.py`` and ``fgrpo/__main__.py``. :func:`config_reference` writes the
config reference page, ``docs/config.md``, from the same config classes."""
from __future__ import annotations

import argparse
import dataclasses
import os

from hpc.runtime.cli import EXIT_CODES_HELP, JOB_INPUTS, OneLineParser, job_command
from hpc.runtime.config import JobConfig, load_config
from hpc.runtime.errors import UserError, user_errors_exit

sft = job_command("hpc-sft", "hpc.sft_config:SFTJobConfig", "hpc.sft:main",
                  "LoRA SFT stage: writes <run.out>/adapter (peft format) and sft.h5.",
                  check_ref=JOB_INPUTS)
evaluate = job_command("hpc-eval", "hpc.runtime.config:JobConfig", "hpc.evaluate:main",
                       "Greedy accuracy and pass@k of model.path (+ lora.adapter) on the "
                       "task's held-out split: writes eval.h5.",
                       check_ref=JOB_INPUTS)


def plan_job_class():
    """A job config with the sections of both methods (``hpc-plan``, ``hpc-scaling``)."""
    from essa.config import ESSAConfig
    from fgrpo.config import FGRPOConfig, FGRPOJobConfig

    return dataclasses.make_dataclass(
        "PlanJobConfig", [("essa", ESSAConfig, dataclasses.field(default_factory=ESSAConfig)),
                          ("fgrpo", FGRPOConfig, dataclasses.field(default_factory=FGRPOConfig))],
        bases=(JobConfig,), namespace={"validate": FGRPOJobConfig.resolve_algorithm})


@user_errors_exit
def plan(argv=None):
    """``hpc-plan``: print the memory plan of a config's model for ESSA and F-GRPO
    (:mod:`hpc.plan.memory_plan`)."""
    parser = OneLineParser(
        prog="hpc-plan", epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Memory per GPU of ESSA and F-GRPO for model.path, from its config.json "
                    "alone (no weights are read).\nKeys used: model.path, model.dtype, lora.rank, "
                    "lora.targets, task.max_new_tokens, eval.batch_size,\nplan.gpu_memory_gib, "
                    "plan.max_prompt_tokens, essa.population, essa.minibatch,\n"
                    "essa.members_per_pass, fgrpo.batch_prompts, fgrpo.num_generations, "
                    "fgrpo.micro_batch,\nfgrpo.full_finetune, fgrpo.beta, fgrpo.algorithm, "
                    "fgrpo.dynamic_sampling, fgrpo.max_refills, fgrpo.filtered_share.")
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks of the job (ESSA members and F-GRPO prompts per rank)")
    args = parser.parse_intermixed_args(argv)  # keys may follow --ranks
    if args.ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {args.ranks}")
    config_path = next((i for i in args.items if "=" not in i), None)
    cfg = load_config(plan_job_class(), config_path, [i for i in args.items if "=" in i])
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise UserError(f"model.path={cfg.model.path!r} is not a folder with a config.json")
    from hpc.plan.memory_plan import plan_text

    print(plan_text(cfg, args.ranks))


CONFIG_REFERENCE_INTRO = """\
# Config reference

Every key of every job, with its default and allowed range; an unknown key, a wrong type or an
out-of-range value ends the job with one line naming the key and exit code 2 on every rank,
before any model is loaded. A job takes `[CONFIG.yaml] [section.key=value ...] [--resume]`;
one YAML file may hold the sections of every method (a job skips the other methods' sections).
The effective config is stored in the run file (attribute `config`) and can be passed back as a
config file. `hpc-plan` reads the shared sections and both `essa` and `fgrpo`.

This page is generated from the config classes, the same source as each job's `--help`
(`make docs` rewrites it; `tests/test_docs.py` fails when it is out of date).
"""


def config_reference() -> str:
    """The text of ``docs/config.md``: the sections every job shares once, then one table per
    job of its own section (:func:`hpc.runtime.config.reference_markdown`, the rows ``--help``
    prints). ``make docs`` writes it."""
    from essa.config import ESSAJobConfig
    from fgrpo.config import FGRPOJobConfig
    from hpc.runtime.config import reference_markdown
    from hpc.sft_config import SFTJobConfig

    shared = [f.name for f in dataclasses.fields(JobConfig)]
    parts = [CONFIG_REFERENCE_INTRO,
             f"## Shared sections (every job: {', '.join(f'`{name}`' for name in shared)})\n",
             "`hpc-eval` has these sections only.\n", reference_markdown(JobConfig) + "\n"]
    for command, job_cls in (("hpc-sft", SFTJobConfig), ("essa", ESSAJobConfig),
                             ("fgrpo", FGRPOJobConfig)):
        own = [f.name for f in dataclasses.fields(job_cls) if f.name not in shared]
        parts += [f"## `{command}`: {', '.join(f'`{name}`' for name in own)}\n",
                  reference_markdown(job_cls, own) + "\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    plan()
