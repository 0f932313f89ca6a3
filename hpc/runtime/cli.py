"""What every console entry point shares: exit-code help, a tool parser, and the job command
that answers ``--help`` and config mistakes at once.

A job's ``--help`` is generated from its config dataclasses (torch-free modules) and lists every
section and key with its default and allowed values, then the exit codes. The job module itself
imports torch and transformers, which takes seconds, so it is imported only once the command
line is not a help request and its config is valid: that is the reason for the lazy imports in
this module.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
import typing

from hpc.runtime.config import config_keys, load_config, rule_text
from hpc.runtime.errors import (EXIT_USER_ERROR, PeerFailed, UserError, exit_agreed,
                                exit_user_error, launched)
from hpc.runtime.methods import MethodSpec, load_ref
from hpc.runtime.preempt import EXIT_PREEMPTED, stop_signals

EXIT_CODES_HELP = (f"exit codes: 0 done; {EXIT_USER_ERROR} user error (one line on stderr naming "
                   f"the problem)")
JOB_EXIT_CODES_HELP = (f"exit codes: 0 done; {EXIT_USER_ERROR} user error (one line on stderr "
                       f"naming the problem, before any model is loaded); {EXIT_PREEMPTED} "
                       f"preempted (checkpoint written; rerun with --resume, as the Slurm "
                       f"scripts do when they requeue)")
HELP_FLAGS = ("-h", "--help")


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`hpc.x` -> hpc.x


def plain(doc: str) -> str:
    """A module docstring as ``--help`` text: Sphinx roles and double backquotes removed."""
    return _ROLE.sub(r"\1", doc).replace("``", "")


def tool_parser(prog: str, doc: str) -> tuple:
    """(parser, subparsers) of a tool with subcommands (``hpc-report``, ``hpc-data``): the
    module docstring as plain description (:func:`plain`), the exit codes as epilog."""
    parser = OneLineParser(prog=prog, description=plain(doc), epilog=EXIT_CODES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser, parser.add_subparsers(dest="command", required=True)


class OneLineParser(argparse.ArgumentParser):
    """Every command's parser: a command-line mistake (a misspelt subcommand or flag, a missing
    argument) is a UserError, one line from rank 0 and exit 2, not usage on every rank; the
    usage is in the line where it is short, else ``--help`` is named."""

    def error(self, message):
        usage = self.format_usage().strip()[len("usage: "):]
        hint = f"usage: {usage}" if len(usage) <= 100 else f"see {self.prog} --help"
        raise UserError(f"{self.prog}: {message} ({hint})")


def parse_args(prog: str, argv=None, description: str = ""):
    """A job's command line: (config file or None, overrides, whether ``--resume``)."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                        help="an optional YAML config file, then overrides")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in run.out")
    # Intermixed: overrides may follow --resume (``essa cfg.yaml --resume x.y=1``).
    args = parser.parse_intermixed_args(argv)
    config_path = None
    overrides = []
    for item in args.items:
        if "=" not in item and item.endswith((".yaml", ".yml")) and config_path is None:
            config_path = item
        else:
            overrides.append(item)
    return config_path, overrides, args.resume


def job_help(prog: str, about: str, job_cls) -> str:
    """``--help`` text of a job: usage, every config key by section, exit codes."""
    lines = [f"usage: {prog} [CONFIG.yaml] [section.key=value ...] [--resume]", "", about, "",
             "CONFIG.yaml holds sections of keys; each section.key=value after it overrides one.",
             "--resume continues from the last checkpoint in run.out.", "",
             "config keys (default; allowed values; meaning):"]
    cfg = job_cls()
    for section_field in dataclasses.fields(cfg):
        lines.append(f"  [{section_field.name}]")
        for key, section, f in config_keys(getattr(cfg, section_field.name),
                                           f"{section_field.name}."):
            rule = rule_text(f.metadata)
            lines.append(f"    {key} = {getattr(section, f.name)!r}"
                         f"{'  (' + rule + ')' if rule else ''}")
            lines.append(textwrap.fill(f.metadata["help"], 96, initial_indent=" " * 8,
                                       subsequent_indent=" " * 8))
    lines += ["", "docs/config.md has the same keys as tables.",
              textwrap.fill(JOB_EXIT_CODES_HELP, 96, subsequent_indent="  ")]
    return "\n".join(lines)


# The jobs' check before their imports (hpc.job.inputs: data files, model and adapter folders,
# the run folder), named here by reference only: imported when a job starts, not when --help
# is answered.
JOB_INPUTS = "hpc.job.inputs:check_inputs"


def job_command(spec: MethodSpec) -> typing.Callable:
    """The console entry point of the job ``spec`` describes: ``--help`` from its job config
    class; anything else installs the preemption handler
    (:func:`hpc.runtime.preempt.stop_signals`: a signal from here on is honoured at the job's
    next safe point, however long the imports and the model loading take), reads the command
    line and the config and runs the torch-free check :data:`JOB_INPUTS` on it, the job's name
    (its run folder's and run file's) and whether it resumes: a mistake in any ends here, in
    about a second, before torch is imported, with exit 2 on every rank
    (:func:`agree_on_inputs`); then runs the spec's ``trainer`` (called with the arguments; it
    reads them again)."""

    def main(argv=None):
        argv = sys.argv[1:] if argv is None else list(argv)
        if any(arg in HELP_FLAGS for arg in argv):
            print(job_help(spec.command, spec.about, spec.job_class()))
            return 0
        stop_signals()
        cfg, failed = None, None
        try:
            config_path, overrides, resume = parse_args(spec.command, argv)
            cfg = load_config(spec.job_class(), config_path, overrides)
            load_ref(JOB_INPUTS)(cfg, spec.name, resume)
        except UserError as err:
            failed = err
        agree_on_inputs(failed, cfg)
        return load_ref(spec.trainer)(argv)

    main.__doc__ = f"``{spec.command}``: {spec.about}"
    return main


def agree_on_inputs(err: UserError | None, cfg=None) -> None:
    """The ranks' verdict on a job's command line, config and inputs, before torch is
    imported: ``err`` is this rank's mistake found (None: none). A process that is no
    launched rank ends alone for it (one line, exit 2). Launched ranks start MPI (the job
    would a moment later) and agree (:func:`hpc.runtime.world.stop_together`): where any rank
    found a mistake, rank 0 prints the line (or each rank that alone found one, its own), all
    wait for it and every rank exits 2 itself. (A rank leaving alone made the launcher kill
    the others as it went: mpirun SIGKILLs them 0.5 s later, so they recorded no exit code.)
    ``cfg``: the config, where it was read, for ``run.collective_timeout_s``."""
    if not launched():
        if err is not None:
            exit_user_error(err)
        return
    from hpc.runtime.world import get_world, stop_together  # MPI_Init: a launched rank's

    world = get_world()
    run = getattr(cfg, "run", None)
    world.timeout_s = getattr(run, "collective_timeout_s", world.timeout_s)
    try:
        stop_together(world, err)
    except UserError as agreed:
        exit_agreed(agreed, world.barrier)
    except PeerFailed:
        exit_agreed(None, world.barrier)
