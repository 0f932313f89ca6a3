"""File tasks: a :class:`FileTask` reads jsonl rows as prompts, gold answers and SFT solutions
(and says how ``hpc-data prepare`` converts and filters a public set's rows, how ``hpc-data
check`` grades them); the math ones are here (``gsm8k``, ``math``, ``aime``, ``amc``, the
short-answer sets ``deepscaler``, ``minerva``, ``olympiadbench``), ``ifeval`` in
:mod:`hpc.data.ifeval`, each registered in :data:`hpc.data.registry.TASKS`.

Row formats (one JSON object per line; blank lines are skipped):

* gsm8k: ``question``, ``answer`` (worked solution ending in ``#### <number>``). The SFT
  solution drops the ``<<a*b=c>>`` calculator tags and ends with ``The answer is <number>.``
* math: ``question`` or ``problem``; ``solution`` or ``answer`` holding the worked LaTeX solution
  with the final answer in ``\\boxed{}``, optionally followed by ``The answer is: <answer>``,
  which then is the gold answer.
* aime, amc: ``question`` or ``problem``; ``answer`` (a number); optional ``solution``. The SFT
  solution is that text (if any) followed by ``The answer is \\boxed{<answer>}.``
* ifeval (:mod:`hpc.data.ifeval`): IFEval's ``prompt``, ``instruction_id_list`` and
  ``kwargs``, optional ``response`` (the gold is the JSON of the three, the reward the share of
  the instructions followed by IFEval's ``task.ifeval_check`` test; the SFT solution is
  ``response``, or empty).
* deepscaler, minerva, olympiadbench (the short-answer sets): ``question`` or
  ``problem``; the gold is the short ``answer`` (LaTeX or a number) where the row has one, else
  the final answer of the worked ``solution`` as for math (also where ``answer`` holds a worked
  solution: ``\\boxed{}`` or ``The answer is:`` in it), so MATH-500, AIME and AMC files read as
  these tasks too (a training job on DeepScaleR evaluates on any of them). The SFT solution is
  ``solution`` (if any) followed by ``The answer is \\boxed{<answer>}.``; graded by
  math-verify.

Every row is checked at load, and a bad one ends the job with one line naming the file and
line (UserError): the question must be a string; numeric golds (gsm8k's ``####`` line, aime
and amc answers) must be one finite number as :func:`hpc.data.rewards.to_number` reads it
(units such as '9 (apples)' allowed); math golds must be non-empty with balanced braces.

``task.eval_path`` is required. ``task.train_path`` may be empty (evaluation-only jobs); the
train split is then empty. Train rows are shuffled with ``task.seed`` before the first
``n_train`` are kept; eval keeps file order. Solutions start with a space, to follow the prompt.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from hpc.data.registry import TASKS, task_loader
from hpc.data.rewards import gsm8k_gold, last_boxed, math_reward, numeric_reward, to_number
from hpc.data.split import Split, Task
from hpc.runtime.errors import UserError
from hpc.runtime.readback import MAX_JSON_DEPTH, bounded_json

# The plain prompts of the file tasks (named presets in hpc.data.prompts).
GSM8K_TEMPLATE = "Question: {question}\nAnswer: Let's think step by step."
MATH_TEMPLATE = "Problem: {question}\nSolution:"

_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
_ANSWER_SUFFIX = "The answer is:"
_DOLLAR = re.compile(r"(?<!\\)\$")  # a math delimiter, not an escaped \$
MAX_ROW_CHARS = 2 ** 22  # one row: a problem and its worked solution, a few KiB


@dataclass(frozen=True)
class Preset:
    """What ``hpc-data prepare`` does to a task's rows after converting them."""

    dedup: bool = False  # drop repeated questions (whitespace collapsed), keeping the first
    max_prompt_tokens: int = 0  # drop longer prompts (0: no limit; --max-prompt-tokens)
    task: str = ""  # the one task a named preset (--preset) is for ("" = any)
    word_splits: bool = False  # a file's split: train or test where its name holds the word
    drop_test_from_train: bool = False  # drop training problems that are also test problems


@dataclass(frozen=True)
class FileTask:
    """A task read from jsonl files (``task.train_path``, ``task.eval_path``): its loader
    (:meth:`__call__`, as :data:`hpc.data.registry.TASKS` names it) and what ``hpc-data
    prepare`` and ``hpc-data check`` need of it."""

    # (row, path, line number) -> (question, prompt template, gold, SFT solution); UserError
    # naming the file and line for a row it cannot use
    read_row: Callable
    reward: Callable  # (completion, gold) -> reward in [0, 1]
    template: str  # the plain prompt of its rows, with {question} (prepare counts its tokens)
    # hpc-data prepare: (a public set's row, keys lower-cased; where) -> the fields read_row
    # reads; UserError naming ``where`` for a row without them
    convert: Callable
    preset: Preset = Preset()  # what hpc-data prepare filters from each split it writes
    graded: bool = True  # the gold is an answer a completion states (hpc-data check grades it)

    def job_reward(self, cfg, splits: tuple) -> Callable:
        """The reward function of a job whose ``task`` section is ``cfg`` on ``splits`` (its
        train and eval :class:`Split`): :attr:`reward`."""
        return self.reward

    def __call__(self, cfg) -> Task:
        """The task ``cfg.name`` from ``cfg.train_path`` and ``cfg.eval_path`` (a TaskConfig;
        the module docstring)."""
        if not cfg.eval_path:
            raise UserError(f"config key 'task.eval_path' is required for task {cfg.name}")
        train = (self._split(cfg.train_path, cfg.n_train, random.Random(cfg.seed))
                 if cfg.train_path else Split([], [], []))
        evaluation = self._split(cfg.eval_path, cfg.n_eval)
        return Task(cfg.name, train=train, eval=evaluation,
                    reward_fn=self.job_reward(cfg, (train, evaluation)))

    def _split(self, path: str, n: int, rng: random.Random | None = None) -> Split:
        """All rows of ``path`` checked and converted; shuffled by ``rng`` if given; first
        ``n``."""
        items = [self.read_row(row, path, number) for number, row in read_jsonl(path)]
        if rng is not None:
            rng.shuffle(items)
        items = items[:n or None]
        return Split([t.format(question=q) for q, t, _, _ in items],
                     [a for _, _, a, _ in items], [s for _, _, _, s in items],
                     [q for q, _, _, _ in items])


def read_jsonl(path: str) -> list:
    """``(line number, object)`` for each non-blank line of ``path``; UserError naming the file.

    UTF-8, with or without a leading byte-order mark (``utf-8-sig``). Each line is bounded
    before it is parsed: at most MAX_ROW_CHARS characters, JSON nested at most
    :data:`hpc.runtime.readback.MAX_JSON_DEPTH` levels (a row of 100k nested arrays would
    otherwise end in RecursionError)."""
    if not os.path.isfile(path):
        raise UserError(f"task data file not found: {path}")
    rows = []
    try:
        with open(path, encoding="utf-8-sig") as fh:
            for number, line in enumerate(iter(lambda: fh.readline(MAX_ROW_CHARS + 1), ""), 1):
                if len(line) > MAX_ROW_CHARS:
                    raise UserError(f"{path} line {number}: longer than {MAX_ROW_CHARS} "
                                    f"characters; a row holds one problem and its answer")
                if not line.strip():
                    continue
                try:
                    row = _row(line)
                except ValueError as err:  # json.JSONDecodeError is one
                    raise UserError(f"{path} line {number}: not valid JSON "
                                    f"({getattr(err, 'msg', err)})") from None
                if not isinstance(row, dict):
                    raise UserError(f"{path} line {number}: expected a JSON object")
                if "\\u" in line:  # only a JSON escape can make text that is not Unicode
                    _check_unicode(row, line, path, number)
                rows.append((number, row))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read task data file {path}: {err}") from None
    if not rows:
        raise UserError(f"task data file {path} has no rows")
    return rows


_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)")


def _check_unicode(row: dict, line: str, path: str, number: int) -> None:
    """UserError naming the file, line and column of a lone surrogate in ``row`` (a JSON
    ``\\ud800`` escape without its pair): Python keeps it in the string, and the tokenizer
    refuses it (a TypeError) after the run file exists."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    column, high = None, None  # the column of an unpaired high surrogate escape
    for escape in _ESCAPE.finditer(line):
        code = int(escape.group(1), 16) if escape.group(1) else None
        is_low = code is not None and 0xDC00 <= code <= 0xDFFF
        if high is not None and not (is_low and escape.start() == high[1]):
            column, code = high[0], high[2]
            break
        high = None
        if code is not None and 0xD800 <= code <= 0xDBFF:
            high = (escape.start() + 1, escape.end(), code)
        elif is_low:
            column = escape.start() + 1
            break
    if column is None and high is not None:
        column, code = high[0], high[2]
    where = f"column {column}: \\u{code:04x}" if column else "a \\u escape"
    raise UserError(f"{path} line {number}, {where} is a lone surrogate (half of a UTF-16 "
                    f"pair), which no tokenizer takes; write the character itself, or both "
                    f"halves of its pair")


def _row(line: str):
    """One JSON value; nesting is bounded first (:func:`bounded_json`) unless the line has too
    few brackets to nest that deep (counting them is ~100x cheaper than the bounded parse)."""
    if line.count("[") + line.count("{") <= MAX_JSON_DEPTH:
        return json.loads(line)
    return bounded_json(line)


def _field(row: dict, names: tuple, path: str, number: int):
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    raise UserError(f"{path} line {number}: missing field {' or '.join(map(repr, names))}")


def _text(row: dict, names: tuple, path: str, number: int) -> str:
    """The first present field of ``names``, which must be a string."""
    value = _field(row, names, path, number)
    if not isinstance(value, str):
        name = next(n for n in names if row.get(n) not in (None, ""))
        raise UserError(f"{path} line {number}: field {name!r} must be a string, got "
                        f"{type(value).__name__} {value!r:.40}")
    return value


def _numeric_gold(gold: str, path: str, number: int) -> str:
    """``gold`` if it is one finite number, else UserError naming the file and line."""
    if not gold:
        raise UserError(f"{path} line {number}: the gold answer is empty")
    value = to_number(gold)
    if value is None:
        raise UserError(f"{path} line {number}: the gold answer {gold!r:.60} is not a number")
    try:
        finite = math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        raise UserError(f"{path} line {number}: the gold answer {gold!r:.60} is not a finite "
                        f"number")
    return gold


def _math_gold(gold: str, path: str, number: int) -> str:
    """``gold`` if it is non-empty with balanced (unescaped) braces, else UserError."""
    depth = 0
    for token in re.findall(r"\\[{}]|[{}]", gold):
        depth += {"{": 1, "}": -1}.get(token, 0)
        if depth < 0:
            break
    if not gold.strip() or depth != 0:
        raise UserError(f"{path} line {number}: the gold answer {gold!r:.60} is unreadable "
                        f"(empty or unbalanced braces)")
    return gold


def _gsm8k(row: dict, path: str, number: int):
    text = _text(row, ("answer",), path, number)
    if "####" not in text:
        raise UserError(f"{path} line {number}: the 'answer' has no '#### <number>' final line")
    gold = _numeric_gold(gsm8k_gold(text), path, number)
    body = _CALCULATOR_RE.sub("", text.rsplit("####", 1)[0]).strip()
    solution = f" {body}\nThe answer is {gold}." if body else f" The answer is {gold}."
    question = _text(row, ("question",), path, number)
    return question, GSM8K_TEMPLATE, gold, solution


def _math(row: dict, path: str, number: int):
    text = _text(row, ("solution", "answer"), path, number)
    worked, suffix, stated = text.rpartition(_ANSWER_SUFFIX)
    if not suffix:
        worked, stated = text, ""
    gold = stated.strip() or last_boxed(worked)
    if not gold:
        raise UserError(f"{path} line {number}: the solution has no \\boxed{{}} final answer")
    gold = _math_gold(gold, path, number)
    question = _text(row, ("question", "problem"), path, number)
    return question, MATH_TEMPLATE, gold, " " + worked.strip()


def _number_text(value) -> str:
    """An answer as a string; integral numbers plainly ('27.0' and '027' -> '27')."""
    text = str(value).strip()
    try:
        number = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text
    return str(number.numerator) if number.denominator == 1 else text


def _competition(row: dict, path: str, number: int):
    answer = _field(row, ("answer",), path, number)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{path} line {number}: the 'answer' must be a number, got "
                        f"{type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):  # JSON 1e400 reads as inf
        raise UserError(f"{path} line {number}: the gold answer {answer} is not a finite number")
    gold = _numeric_gold(_number_text(answer), path, number)
    return _boxed_row(row, gold, path, number)


def _boxed_row(row: dict, gold: str, path: str, number: int):
    """(question, MATH_TEMPLATE, gold, SFT solution) of a row whose gold answer is ``gold``: its
    worked ``solution`` (if any) followed by the boxed answer."""
    worked = str(row.get("solution") or "").strip()
    final = f"The answer is \\boxed{{{gold}}}."
    solution = f" {worked}\n{final}" if worked else f" {final}"
    return _text(row, ("question", "problem"), path, number), MATH_TEMPLATE, gold, solution


def _short_answer(row: dict, path: str, number: int):
    """A row of a short-answer set (module docstring): its ``answer``, else as :func:`_math`."""
    answer = row.get("answer")
    if answer in (None, "") or (isinstance(answer, str) and (
            _ANSWER_SUFFIX in answer or last_boxed(answer))):  # a worked solution (PRM800K's)
        return _math(row, path, number)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{path} line {number}: the 'answer' must be a string or a number, got "
                        f"{type(answer).__name__}")
    text = answer.strip() if isinstance(answer, str) else _number_text(answer)  # '3.83e35' kept
    gold = _math_gold(text, path, number)
    return _boxed_row(row, gold, path, number)


def row_field(row: dict, names: tuple, where: str):
    """The first of the fields ``names`` that ``row`` (a public set's) holds, not None or
    empty; UserError naming ``where`` and the row's fields when none is."""
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    raise UserError(f"{where}: no field {' or '.join(map(repr, names))} (its fields: "
                    f"{', '.join(sorted(row))[:200]})")


def _question(row: dict, where: str) -> tuple:
    """(question, row) of a public math set's row; PRM800K's labelled solutions, whose problem
    is nested in ``question``, unnested first (a missing solution: the boxed answer)."""
    if isinstance(row.get("question"), dict):
        nested = {k.lower(): v for k, v in row["question"].items()}
        answer = nested.get("ground_truth_answer")
        row = {"problem": nested.get("problem"), "answer": answer,
               "solution": nested.get("ground_truth_solution") or (
                   f"$\\boxed{{{answer}}}$" if answer not in (None, "") else None)}
    return row_field(row, ("question", "problem"), where), row


def _gsm8k_fields(row: dict, where: str) -> dict:
    question, row = _question(row, where)
    return {"question": question, "answer": row_field(row, ("answer",), where)}


def _math_fields(row: dict, where: str) -> dict:
    """The worked solution, with ``The answer is: <answer>`` after it where the row also has a
    short ``answer`` (MATH-500); a row with only ``answer`` holds the solution there."""
    question, row = _question(row, where)
    if row.get("solution") not in (None, ""):
        solution, gold = row["solution"], row.get("answer")
        if gold not in (None, "") and _ANSWER_SUFFIX not in str(solution):
            solution = f"{str(solution).rstrip()}\nThe answer is: {gold}"
        return {"question": question, "solution": solution}
    return {"question": question, "solution": row_field(row, ("answer",), where)}


def _competition_fields(row: dict, where: str) -> dict:
    question, row = _question(row, where)
    out = {"question": question, "answer": row_field(row, ("answer",), where)}
    if row.get("solution") not in (None, ""):
        out["solution"] = row["solution"]
    return out


def _answer_text(value):
    """A short answer: a list's items joined with ', ', ``$`` delimiters dropped (``$3$, $5$``
    is ``3, 5``); numbers as they are."""
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(_answer_text(v)) for v in value)
    return _DOLLAR.sub("", value).strip() if isinstance(value, str) else value


def _short_answer_fields(row: dict, where: str) -> dict:
    """The gold from ``answer`` or ``final_answer``, the solution (a list joined by blank
    lines) where present, and the gold's source where no answer is."""
    question, row = _question(row, where)
    row_field(row, ("answer", "final_answer", "solution"), where)  # one of them, else UserError
    out = {"question": question}
    gold = next((_answer_text(row[n]) for n in ("answer", "final_answer")
                 if row.get(n) not in (None, "", [])), "")
    if gold not in (None, ""):
        out["answer"] = gold
    solution = row.get("solution")
    if isinstance(solution, (list, tuple)):
        solution = "\n\n".join(str(s) for s in solution)
    if solution not in (None, ""):
        out["solution"] = solution
    return out


GSM8K = FileTask(_gsm8k, numeric_reward, GSM8K_TEMPLATE, _gsm8k_fields)
MATH = FileTask(_math, math_reward, MATH_TEMPLATE, _math_fields)
AIME = AMC = FileTask(_competition, numeric_reward, MATH_TEMPLATE, _competition_fields)
MINERVA = OLYMPIADBENCH = FileTask(_short_answer, math_reward, MATH_TEMPLATE,
                                   _short_answer_fields)
DEEPSCALER = FileTask(_short_answer, math_reward, MATH_TEMPLATE, _short_answer_fields,
                      Preset(dedup=True, max_prompt_tokens=1024))


def file_task(name: str) -> FileTask:
    """Task ``name``'s :class:`FileTask`; UserError naming the file tasks when it is none."""
    loader = task_loader(name)
    if not isinstance(loader, FileTask):
        names = [n for n in TASKS if isinstance(task_loader(n), FileTask)]
        raise UserError(f"config key 'task.name': {name!r} is not a file task "
                        f"({', '.join(names)})")
    return loader


def load_file_task(cfg) -> Task:
    """The file task ``cfg.name`` from ``cfg.train_path`` and ``cfg.eval_path`` (a TaskConfig)."""
    return file_task(cfg.name)(cfg)


def check_task_files(cfg) -> None:
    """Read and check every row of job config ``cfg``'s task files (a file task only), as
    :func:`load_file_task` does, torch-free: a job's entry point runs this before its imports,
    so a bad row ends the job in about a second, not after the model is loaded."""
    loader = task_loader(cfg.task.name)
    if isinstance(loader, FileTask):
        loader(cfg.task)
