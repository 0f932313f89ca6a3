"""Console entry points of the shared floor: ``hpc-eval`` (its ``--help`` from the torch-free
config classes, the job imported only to run) and ``hpc-plan``, whose config carries the
sections of every planned method (:func:`hpc.job.config.plan_job_class`). Each method has its
own command in its ``__main__.py``. :func:`config_reference` writes the config reference page,
``docs/config.md``, from the same config classes, every installed method's section found by its
registration."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from hpc.models.hub import local_or_cached
from hpc.evaluate import EVAL
from hpc.runtime.cli import EXIT_CODES_HELP, OneLineParser, job_command
from hpc.job.config import JobConfig
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError, user_errors_exit

evaluate = job_command(EVAL)


@user_errors_exit
def plan(argv=None):
    """``hpc-plan``: print the memory plan of a config's model for every planned method
    (:mod:`hpc.plan.registry`)."""
    parser = OneLineParser(
        prog="hpc-plan", epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Memory per GPU of every planned method (ESSA, F-GRPO) for model.path (a "
                    "folder, or a Hub id in the local Hugging Face cache), from its config.json "
                    "alone (no weights are read).\nKeys used: the shared sections' model, lora, "
                    "task, eval, plan and reward keys, and each planned method's own section "
                    "(docs/config.md).")
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks of the job (ESSA members and F-GRPO prompts per rank)")
    args = parser.parse_intermixed_args(argv)  # keys may follow --ranks
    if args.ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {args.ranks}")
    from hpc.job.config import plan_job_class
    from hpc.plan.registry import plan_text

    config_path = next((i for i in args.items if "=" not in i), None)
    renamed = []
    cfg = load_config(plan_job_class(), config_path, [i for i in args.items if "=" in i],
                      notes=renamed)
    for note in renamed:
        print(note, file=sys.stderr)
    cfg.model.path = local_or_cached(cfg.model.path, "config key 'model.path'").path
    print(plan_text(cfg, args.ranks))


CONFIG_REFERENCE_INTRO = """\
# Config reference

Every key of every job, with its default and allowed range; an unknown key, a wrong type or an
out-of-range value ends the job with one line naming the key and exit code 2 on every rank,
before any model is loaded. A job takes `[CONFIG.yaml] [section.key=value ...] [--resume]`;
one YAML file may hold the sections of every method (a job skips the other methods' sections).
The effective config is stored in the run file (attribute `config`) and can be passed back as a
config file. `hpc-plan` reads the shared sections and those of every planned method.

This page is generated from the config classes, the same source as each job's `--help`
(`make docs` rewrites it; `tests/test_docs.py` fails when it is out of date).
"""


def config_reference() -> str:
    """The text of ``docs/config.md``: the sections every job shares once, then one table per
    installed method of its own section (:func:`hpc.runtime.config.reference_markdown`, the
    rows ``--help`` prints), headed by the method's command. ``make docs`` writes it."""
    from hpc.runtime.config import reference_markdown
    from hpc.runtime.methods import methods

    shared = [f.name for f in dataclasses.fields(JobConfig)]
    parts = [CONFIG_REFERENCE_INTRO,
             f"## Shared sections (every job: {', '.join(f'`{name}`' for name in shared)})\n",
             "`hpc-eval` has these sections only.\n", reference_markdown(JobConfig) + "\n"]
    for name, spec in methods().items():
        section = spec.section_class()
        job_cls = dataclasses.make_dataclass(
            f"{name}Job", [(name, section, dataclasses.field(default_factory=section))],
            bases=(JobConfig,))
        parts += [f"## `{spec.command}`: `{name}`\n", reference_markdown(job_cls, [name]) + "\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    plan()
