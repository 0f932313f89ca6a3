"""``hpc-toy`` and ``hpc-toy-chat``: build a built-in toy model if needed, print its folder and
held-out accuracy. Torch-free until the command line is parsed (``--help`` answers at once)."""
from __future__ import annotations

import importlib

from hpc.runtime.cli import EXIT_CODES_HELP, OneLineParser
from hpc.runtime.errors import user_errors_exit


def _toy_command(prog: str, module: str, description: str):
    """An entry point that parses ``--rebuild`` and calls ``module.show`` (imported then)."""

    @user_errors_exit
    def main(argv=None):
        parser = OneLineParser(prog=prog, epilog=EXIT_CODES_HELP, description=description)
        parser.add_argument("--rebuild", action="store_true", help="delete the cached model first")
        args = parser.parse_args(argv)
        return importlib.import_module(module).show(rebuild=args.rebuild)

    main.__doc__ = f"``{prog}``: {description}"
    return main


toy = _toy_command(
    "hpc-toy", "hpc.toys.toy",
    "Build (seeded steps until its held-out accuracy reaches 40%, 2-3 CPU minutes, once) or "
    "load the cached toy model (Qwen2 shape, character tokenizer, 2-digit additions) and print "
    "its folder.")
toy_chat = _toy_command(
    "hpc-toy-chat", "hpc.toys.toy_chat",
    "Build (several CPU minutes, once) or load the cached chat toy model (Qwen2 shape, "
    "byte-level BPE tokenizer, Qwen-style chat template, word problems) and print its folder.")
