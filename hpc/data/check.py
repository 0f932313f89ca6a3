"""``hpc-data check FILE [CONFIG.yaml] [section.key=value ...]``: check a task data file before a
cluster job reads it. ``hpc-data prepare SOURCE FOLDER [CONFIG.yaml] [section.key=value ...]
[--subset NAME]``: write a public math set as distributed (a parquet or jsonl file, a folder,
or a Hugging Face Hub dataset id in the local cache) as the task's jsonl files
``FOLDER/<split>.jsonl`` (:mod:`hpc.data.prepare`), then check each as ``check`` does.

Counts the rows, the rows the loader rejects (a job stops at the first), the golds the task's
grader cannot read (``The answer is \\boxed{<gold>}.`` must score 1 against its own gold), the
SFT solutions the grader marks wrong, and, when ``model.path`` is a folder with a
``tokenizer.json``, the prompt lengths in tokens against ``plan.max_prompt_tokens`` (what the
memory plan assumed) and the solution lengths against ``task.max_new_tokens``. The task is
``task.name`` (a file task: gsm8k, math, aime, amc, deepscaler, minerva, olympiadbench,
ifeval, whose golds are instructions, not answers, and are checked as the loader reads them). A
task's preset may filter the rows ``prepare`` writes (deepscaler: duplicates, and prompts over
``--max-prompt-tokens``, 1024 unless given, as :func:`hpc.data.prepare.prompt_lengths` counts
them); it prints what each filter removed. Exit code 2 when a row is rejected, a gold
is unreadable or a prompt is too long; 0 otherwise.
"""
from __future__ import annotations

import os
import statistics
import sys

from hpc.data.mathdata import FileTask, file_task, read_jsonl
from hpc.models.hub import local_or_cached
from hpc.runtime.cli import EXIT_CODES_HELP, tool_parser
from hpc.job.config import JobConfig
from hpc.models.folders import BUILT_IN_MODELS
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError, user_errors_exit

SHOWN = 3  # line numbers shown per kind of problem


def _lines(numbers: list) -> str:
    more = f", ... ({len(numbers) - SHOWN} more)" if len(numbers) > SHOWN else ""
    return f" (lines {', '.join(map(str, numbers[:SHOWN]))}{more})" if numbers else ""


def _tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from ``path/tokenizer.json`` (``path``: a folder, or a Hub id
    in the local cache), or None if there is none (or ``path`` names a built-in model);
    UserError if ``path`` is no folder at all."""
    if path in BUILT_IN_MODELS:
        return None
    path = local_or_cached(path, "config key 'model.path'").path
    if not os.path.isdir(path):
        raise UserError(f"config key 'model.path': model folder not found: {path} (hpc-data "
                        f"reads its tokenizer.json; built-in models: "
                        f"{', '.join(BUILT_IN_MODELS)})")
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


def job_file_task(cfg) -> FileTask:
    """The file task ``cfg.task.name`` names, else UserError."""
    try:
        return file_task(cfg.task.name)
    except UserError as err:
        raise UserError(f"{err}; give the job's config or task.name=") from None


def check_file(path: str, cfg, tokenizer) -> tuple:
    """(report lines, problem count) for the data file ``path`` read as task ``cfg.task.name``,
    with ``tokenizer`` (:func:`_tokenizer` of model.path; None: lengths not counted)."""
    name, task = cfg.task.name, job_file_task(cfg)
    rows = read_jsonl(path)
    items, rejected, unreadable, wrong = [], [], [], []
    first_error = ""
    for number, row in rows:
        try:
            question, template, gold, solution = task.read_row(row, path, number)
            prompt = template.format(question=question)
        except UserError as err:
            rejected.append(number)
            first_error = first_error or str(err)
            continue
        items.append((number, prompt, solution))
        if not task.graded:
            continue
        if task.reward(f"The answer is \\boxed{{{gold}}}.", gold) < 1.0:
            unreadable.append(number)
        elif task.reward(solution, gold) < 1.0:
            wrong.append(number)
    lines = [f"{path} (task {name})", f"rows: {len(rows)}",
             f"rows the loader rejects: {len(rejected)}{_lines(rejected)}"
             + (f"; first: {first_error}" if first_error else ""),
             f"golds the grader cannot read: {len(unreadable)}{_lines(unreadable)}",
             f"SFT solutions the grader marks wrong: {len(wrong)}{_lines(wrong)}"]
    problems = len(rejected) + len(unreadable)
    if tokenizer is None or not items:
        why = ("a built-in model" if cfg.model.path in BUILT_IN_MODELS else
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


CONFIG_HELP = ("the job's config (task.name, model.path for the tokenizer, "
               "plan.max_prompt_tokens, task.max_new_tokens), then overrides")


@user_errors_exit
def main(argv=None):
    """``hpc-data``: see the module docstring."""
    parser, sub = tool_parser("hpc-data", __doc__)
    check = sub.add_parser("check", help="count rows, unreadable golds and over-long prompts",
                           epilog=EXIT_CODES_HELP)
    check.add_argument("file", metavar="FILE.jsonl")
    check.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                       help=CONFIG_HELP)
    prepare = sub.add_parser(
        "prepare", epilog=EXIT_CODES_HELP,
        help="write a public math or IFEval set (a parquet/jsonl file, a folder or a Hub "
             "dataset id in the local cache) as the task's jsonl files, then check them",
        description="Write SOURCE (a .parquet/.jsonl/.json file, a folder of them, or a Hugging "
                    "Face Hub dataset id found in the local cache) as FOLDER/<split>.jsonl in "
                    "the fields task.name reads (gsm8k, math, aime, amc, deepscaler, minerva, "
                    "olympiadbench, ifeval), filtered by the task's preset (deepscaler: duplicate "
                    "questions and prompts over --max-prompt-tokens), then check each file as "
                    "hpc-data check does. Nothing is downloaded.")
    prepare.add_argument("source", metavar="SOURCE")
    prepare.add_argument("folder", metavar="FOLDER")
    prepare.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                         help=CONFIG_HELP)
    prepare.add_argument("--subset", help="the subfolder of a source that holds several "
                                          "(GSM8K: main or socratic)")
    prepare.add_argument("--preset", metavar="NAME",
                         help="filter by this preset instead of the task's: prm800k (task "
                              "math: PRM800K's problems, train and test split by file name, "
                              "duplicates and test problems dropped from train)")
    prepare.add_argument("--max-prompt-tokens", type=int, metavar="N",
                         help="drop the rows whose prompt, as task.prompt_format renders it, is "
                              "longer than N tokens of model.path's tokenizer (default: the "
                              "preset's, 1024 for deepscaler, else no limit; 0: no limit)")
    args = parser.parse_args(argv)
    config_path = next((i for i in args.items if "=" not in i), None)
    cfg = load_config(JobConfig, config_path, [i for i in args.items if "=" in i])
    job_file_task(cfg)
    tokenizer = _tokenizer(cfg.model.path)  # a wrong model.path before the data: the config's
    if args.command == "check":
        files = [args.file]
    else:
        from hpc.data.prepare import prepare as write_task_files

        if args.max_prompt_tokens is not None and args.max_prompt_tokens < 0:
            raise UserError(f"hpc-data prepare: --max-prompt-tokens {args.max_prompt_tokens}: "
                            f"give a number of tokens, or 0 for no limit")
        files = []
        for path, rows, sources, notes in write_task_files(
                args.source, args.folder, cfg.task.name, args.subset, cfg, args.max_prompt_tokens,
                args.preset):
            print(f"wrote {path}: {rows} rows from {', '.join(sources)}", flush=True)
            for line in notes:
                print(f"  {line}", flush=True)
            files.append(path)
    problems = 0
    for path in files:
        lines, found = check_file(path, cfg, tokenizer)
        print("\n  ".join(lines), flush=True)
        problems += found
    if problems:
        raise UserError(f"{' '.join(files)}: {problems} problem(s) above; a job would stop "
                        f"on a rejected row, score an unreadable gold 0, or exceed the memory "
                        f"plan with a long prompt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
