"""What every console entry point shares: exit-code help, a tool parser, and the job command
that answers ``--help`` at once.

A job's ``--help`` is generated from its config dataclasses (torch-free modules) and lists every
section and key with its default and allowed values, then the exit codes. The job module itself
imports torch and transformers, which takes seconds, so it is imported only once the command
line is not a help request: that is the reason for the lazy imports in this module.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import textwrap

from hpc.runtime.config import rule_text
from hpc.runtime.errors import EXIT_USER_ERROR
from hpc.runtime.preempt import EXIT_PREEMPTED, stop_signals

EXIT_CODES_HELP = (f"exit codes: 0 done; {EXIT_USER_ERROR} user error (one line on stderr naming "
                   f"the problem)")
JOB_EXIT_CODES_HELP = (f"exit codes: 0 done; {EXIT_USER_ERROR} user error (one line on stderr "
                       f"naming the problem, before any model is loaded); {EXIT_PREEMPTED} "
                       f"preempted (checkpoint written; rerun with --resume, as the Slurm "
                       f"scripts do when they requeue)")
HELP_FLAGS = ("-h", "--help")


def tool_parser(prog: str, doc: str) -> tuple:
    """(parser, subparsers) of a tool with subcommands (``hpc-report``, ``hpc-data``): the
    module docstring as description, the exit codes as epilog."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, epilog=EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser, parser.add_subparsers(dest="command", required=True)


def _load(ref: str):
    """The object named by ``'module:attribute'`` (imported now, not at start-up)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def job_help(prog: str, about: str, job_cls) -> str:
    """``--help`` text of a job: usage, every config key by section, exit codes."""
    lines = [f"usage: {prog} [CONFIG.yaml] [section.key=value ...] [--resume]", "", about, "",
             "CONFIG.yaml holds sections of keys; each section.key=value after it overrides one.",
             "--resume continues from the last checkpoint in run.out.", "",
             "config keys (default; allowed values; meaning):"]
    cfg = job_cls()
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        lines.append(f"  [{section_field.name}]")
        for f in dataclasses.fields(section):
            rule = rule_text(f.metadata)
            lines.append(f"    {section_field.name}.{f.name} = {getattr(section, f.name)!r}"
                         f"{'  (' + rule + ')' if rule else ''}")
            lines.append(textwrap.fill(f.metadata["help"], 96, initial_indent=" " * 8,
                                       subsequent_indent=" " * 8))
    lines += ["", "docs/config.md has the same keys as tables.",
              textwrap.fill(JOB_EXIT_CODES_HELP, 96, subsequent_indent="  ")]
    return "\n".join(lines)


def job_command(prog: str, config_ref: str, run_ref: str, about: str):
    """A console entry point: ``--help`` from the config class at ``config_ref``; anything else
    installs the preemption handler (:func:`hpc.runtime.preempt.stop_signals`: a signal from
    here on is honoured at the job's next safe point, however long the imports and the model
    loading take), then runs ``run_ref`` (``'module:function'``, called with the arguments)."""

    def main(argv=None):
        argv = sys.argv[1:] if argv is None else list(argv)
        if any(arg in HELP_FLAGS for arg in argv):
            print(job_help(prog, about, _load(config_ref)))
            return 0
        stop_signals()
        return _load(run_ref)(argv)

    main.__doc__ = f"``{prog}``: {about}"
    return main
