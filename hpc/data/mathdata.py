"""File tasks (``gsm8k``, ``math``, ``aime``, ``amc``, the short-answer sets ``deepscaler``,
``minerva``, ``olympiadbench``, and ``ifeval``): jsonl rows to prompts, gold answers and SFT
solutions.

Row formats (one JSON object per line; blank lines are skipped):

* gsm8k: ``question``, ``answer`` (worked solution ending in ``#### <number>``). The SFT
  solution drops the ``<<a*b=c>>`` calculator tags and ends with ``The answer is <number>.``
* math: ``question`` or ``problem``; ``solution`` or ``answer`` holding the worked LaTeX solution
  with the final answer in ``\\boxed{}``, optionally followed by ``The answer is: <answer>``,
  which then is the gold answer.
* aime, amc: ``question`` or ``problem``; ``answer`` (a number); optional ``solution``. The SFT
  solution is that text (if any) followed by ``The answer is \\boxed{<answer>}.``
* ifeval: IFEval's ``prompt``, ``instruction_id_list`` and ``kwargs``, optional ``response``
  (:mod:`hpc.data.ifeval`: the gold is the JSON of the three, the reward the share of the
  instructions followed by IFEval's ``task.ifeval_check`` test; the SFT solution is
  ``response``, or empty).
* deepscaler, minerva, olympiadbench (:data:`SHORT_ANSWER_TASKS`): ``question`` or
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

import functools
import json
import math
import os
import random
import re
from fractions import Fraction

from hpc.data.ifeval import IFEVAL_TEMPLATE, ifeval_reward, ifeval_row, require_nltk_data
from hpc.data.rewards import gsm8k_gold, last_boxed, math_reward, numeric_reward, to_number
from hpc.data.split import Split, Task
from hpc.runtime.errors import UserError
from hpc.runtime.readback import MAX_JSON_DEPTH, bounded_json

# The plain prompts of the file tasks (named presets in hpc.data.prompts).
GSM8K_TEMPLATE = "Question: {question}\nAnswer: Let's think step by step."
MATH_TEMPLATE = "Problem: {question}\nSolution:"

_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
_ANSWER_SUFFIX = "The answer is:"
MAX_ROW_CHARS = 2 ** 22  # one row: a problem and its worked solution, a few KiB


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
    worked = str(row.get("solution") or "").strip()
    final = f"The answer is \\boxed{{{gold}}}."
    solution = f" {worked}\n{final}" if worked else f" {final}"
    question = _text(row, ("question", "problem"), path, number)
    return question, MATH_TEMPLATE, gold, solution


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
    worked = str(row.get("solution") or "").strip()
    final = f"The answer is \\boxed{{{gold}}}."
    solution = f" {worked}\n{final}" if worked else f" {final}"
    question = _text(row, ("question", "problem"), path, number)
    return question, MATH_TEMPLATE, gold, solution


SHORT_ANSWER_TASKS = ("deepscaler", "minerva", "olympiadbench")
_ROW_READERS = {"gsm8k": _gsm8k, "math": _math, "aime": _competition, "amc": _competition,
                **dict.fromkeys(SHORT_ANSWER_TASKS, _short_answer), "ifeval": ifeval_row}
_REWARDS = {"gsm8k": numeric_reward, "math": math_reward, "aime": numeric_reward,
            "amc": numeric_reward, **dict.fromkeys(SHORT_ANSWER_TASKS, math_reward),
            "ifeval": ifeval_reward}
# the tasks whose gold is an answer a completion states (hpc-data check grades it)
ANSWER_TASKS = tuple(name for name in _ROW_READERS if name != "ifeval")
# The plain prompt of each file task (hpc-data prepare counts prompt tokens with it).
TEMPLATES = {**{name: GSM8K_TEMPLATE if name == "gsm8k" else MATH_TEMPLATE
                for name in ANSWER_TASKS}, "ifeval": IFEVAL_TEMPLATE}


def _split(name: str, path: str, n: int, rng: random.Random | None = None) -> Split:
    """All rows of ``path`` checked and converted; shuffled by ``rng`` if given; first ``n``."""
    items = [_ROW_READERS[name](row, path, number) for number, row in read_jsonl(path)]
    if rng is not None:
        rng.shuffle(items)
    items = items[:n or None]
    return Split([t.format(question=q) for q, t, _, _ in items], [a for _, _, a, _ in items],
                 [s for _, _, _, s in items], [q for q, _, _, _ in items])


def load_file_task(cfg) -> Task:
    """The file task ``cfg.name`` from ``cfg.train_path`` and ``cfg.eval_path`` (a TaskConfig)."""
    if cfg.name not in _ROW_READERS:
        raise UserError(f"config key 'task.name': {cfg.name!r} is not a file task "
                        f"({', '.join(_ROW_READERS)})")
    if not cfg.eval_path:
        raise UserError(f"config key 'task.eval_path' is required for task {cfg.name}")
    train = (_split(cfg.name, cfg.train_path, cfg.n_train, random.Random(cfg.seed))
             if cfg.train_path else Split([], [], []))
    evaluation = _split(cfg.name, cfg.eval_path, cfg.n_eval)
    reward = _REWARDS[cfg.name]
    if cfg.name == "ifeval":
        paths = (cfg.train_path, cfg.eval_path)
        require_nltk_data({i for gold in train.answers + evaluation.answers
                           for i in json.loads(gold)["instruction_id_list"]},
                          f"task.name=ifeval ({', '.join(filter(None, paths))})")
        reward = functools.partial(ifeval_reward, check=cfg.ifeval_check)
    return Task(cfg.name, train=train, eval=evaluation, reward_fn=reward)


def check_task_files(cfg) -> None:
    """Read and check every row of job config ``cfg``'s task files (a file task only), as
    :func:`load_file_task` does, torch-free: a job's entry point runs this before its imports,
    so a bad row ends the job in about a second, not after the model is loaded."""
    if cfg.task.name in _ROW_READERS:
        load_file_task(cfg.task)
