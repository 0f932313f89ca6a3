"""``hpc-data check FILE [CONFIG.yaml] [section.key=value ...]``: check a task data file before a
cluster job reads it.

Counts the rows, the rows the loader rejects (a job stops at the first), the golds the task's
grader cannot read (``The answer is \\boxed{<gold>}.`` must score 1 against its own gold), the
SFT solutions the grader marks wrong, and, when ``model.path`` is a folder with a
``tokenizer.json``, the prompt lengths in tokens against ``plan.max_prompt_tokens`` (what the
memory plan assumed) and the solution lengths against ``task.max_new_tokens``. The task is
``task.name`` (a file task: gsm8k, math, aime, amc). Exit code 2 when a row is rejected, a gold
is unreadable or a prompt is too long; 0 otherwise.
"""
from __future__ import annotations

import os
import statistics
import sys

from hpc.data.mathdata import _REWARDS, _ROW_READERS, read_jsonl
from hpc.models.hub import local_or_cached
from hpc.runtime.cli import EXIT_CODES_HELP, tool_parser
from hpc.runtime.config import BUILT_IN_MODEL_NAMES, JobConfig, load_config
from hpc.runtime.errors import UserError, user_errors_exit

SHOWN = 3  # line numbers shown per kind of problem


def _lines(numbers: list) -> str:
    more = f", ... ({len(numbers) - SHOWN} more)" if len(numbers) > SHOWN else ""
    return f" (lines {', '.join(map(str, numbers[:SHOWN]))}{more})" if numbers else ""


def _tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from ``path/tokenizer.json`` (``path``: a folder, or a Hub id
    in the local cache), or None if there is none (or ``path`` names a built-in model);
    UserError if ``path`` is no folder at all."""
    if path in BUILT_IN_MODEL_NAMES:
        return None
    path = local_or_cached(path, "config key 'model.path'").path
    if not os.path.isdir(path):
        raise UserError(f"config key 'model.path': model folder not found: {path} (hpc-data "
                        f"reads its tokenizer.json; built-in models: "
                        f"{', '.join(BUILT_IN_MODEL_NAMES)})")
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer  # only when a tokenizer is there to read

    tokenizer = Tokenizer.from_file(file)
    tokenizer.no_padding()  # lengths of the texts themselves, not of a padded batch
    tokenizer.no_truncation()
    return tokenizer


def _length_line(what: str, lengths: list, limit: int, key: str, numbers: list) -> tuple:
    over = [n for n, length in zip(numbers, lengths) if length > limit]
    text = (f"{what} tokens: min {min(lengths)}, median {statistics.median(lengths):.0f}, "
            f"max {max(lengths)}; over {key}={limit}: {len(over)}{_lines(over)}")
    return text, over


def check_file(path: str, cfg) -> tuple:
    """(report lines, problem count) for the data file ``path`` read as task ``cfg.task.name``."""
    name = cfg.task.name
    if name not in _ROW_READERS:
        raise UserError(f"config key 'task.name': {name!r} is not a file task "
                        f"({', '.join(_ROW_READERS)})")
    tokenizer = _tokenizer(cfg.model.path)  # a wrong model.path first: it is the config's
    rows = read_jsonl(path)
    reward = _REWARDS[name]
    items, rejected, unreadable, wrong = [], [], [], []
    first_error = ""
    for number, row in rows:
        try:
            question, template, gold, solution = _ROW_READERS[name](row, path, number)
            prompt = template.format(question=question)
        except UserError as err:
            rejected.append(number)
            first_error = first_error or str(err)
            continue
        items.append((number, prompt, solution))
        if reward(f"The answer is \\boxed{{{gold}}}.", gold) < 1.0:
            unreadable.append(number)
        elif reward(solution, gold) < 1.0:
            wrong.append(number)
    lines = [f"{path} (task {name})", f"rows: {len(rows)}",
             f"rows the loader rejects: {len(rejected)}{_lines(rejected)}"
             + (f"; first: {first_error}" if first_error else ""),
             f"golds the grader cannot read: {len(unreadable)}{_lines(unreadable)}",
             f"SFT solutions the grader marks wrong: {len(wrong)}{_lines(wrong)}"]
    problems = len(rejected) + len(unreadable)
    if tokenizer is None or not items:
        why = ("a built-in model" if cfg.model.path in BUILT_IN_MODEL_NAMES else
               "no tokenizer.json" if tokenizer is None else "no rows the loader accepts")
        lines.append(f"token lengths: not checked (model.path={cfg.model.path!r}: {why})")
    else:
        numbers = [n for n, _, _ in items]
        count = [len(e.ids) for e in tokenizer.encode_batch([p for _, p, _ in items],
                                                            add_special_tokens=False)]
        text, over = _length_line("prompt", count, cfg.plan.max_prompt_tokens,
                                  "plan.max_prompt_tokens", numbers)
        lines.append(text)
        problems += len(over)
        count = [len(e.ids) for e in tokenizer.encode_batch([s for _, _, s in items],
                                                            add_special_tokens=False)]
        lines.append(_length_line("SFT solution", count, cfg.task.max_new_tokens,
                                  "task.max_new_tokens", numbers)[0])
    return lines, problems


@user_errors_exit
def main(argv=None):
    """``hpc-data``: see the module docstring."""
    parser, sub = tool_parser("hpc-data", __doc__)
    check = sub.add_parser("check", help="count rows, unreadable golds and over-long prompts",
                           epilog=EXIT_CODES_HELP)
    check.add_argument("file", metavar="FILE.jsonl")
    check.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                       help="the job's config (task.name, model.path for the tokenizer, "
                            "plan.max_prompt_tokens, task.max_new_tokens), then overrides")
    args = parser.parse_args(argv)
    config_path = next((i for i in args.items if "=" not in i), None)
    cfg = load_config(JobConfig, config_path, [i for i in args.items if "=" in i])
    lines, problems = check_file(args.file, cfg)
    print("\n  ".join(lines), flush=True)
    if problems:
        raise UserError(f"{args.file}: {problems} problem(s) above; a job would stop on a "
                        f"rejected row, score an unreadable gold 0, or exceed the memory plan "
                        f"with a long prompt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
