"""File task loaders: real benchmark files, subsets and seeds, and one-line errors for bad files."""
import json
import os

import pytest

from hpc.data.config import TaskConfig
from hpc.runtime.errors import UserError
from hpc.data.mathdata import GSM8K_TEMPLATE, MATH_TEMPLATE, load_file_task
from hpc.data.rewards import math_reward, numeric_reward
from hpc.data.tasks import load_task


def cfg(name, train="", evaluation="", **kw):
    return TaskConfig(name=name, train_path=train, eval_path=evaluation, **kw)


def first_row(path):
    with open(path, encoding="utf-8") as fh:
        return json.loads(fh.readline())


def write(tmp_path, text, name="data.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_gsm8k_loads_with_subsets_and_seeded_shuffle(shared_data):
    train, test = (os.path.join(shared_data, "gsm8k", f) for f in ("train.jsonl", "test.jsonl"))
    task = load_task(cfg("gsm8k", train, test, n_train=100, n_eval=50, seed=3))
    assert (len(task.train), len(task.eval)) == (100, 50)
    assert task.reward_fn is numeric_reward
    row = first_row(test)
    assert task.eval.prompts[0] == GSM8K_TEMPLATE.format(question=row["question"])
    assert task.eval.answers[0] == "18"
    assert task.eval.solutions[0].startswith(" Janet sells 16 - 3 - 4 = 9 duck eggs")
    assert task.eval.solutions[0].endswith("\nThe answer is 18.")
    assert not any("<<" in s or "####" in s for s in task.train.solutions + task.eval.solutions)
    again = load_file_task(cfg("gsm8k", train, test, n_train=100, n_eval=50, seed=3))
    other = load_file_task(cfg("gsm8k", train, test, n_train=100, n_eval=50, seed=4))
    assert again.train == task.train and again.eval == task.eval
    assert other.train.prompts != task.train.prompts and other.eval == task.eval
    assert task.train.prompts[0] != GSM8K_TEMPLATE.format(question=first_row(train)["question"])
    full = load_file_task(cfg("gsm8k", train, test, n_train=0, n_eval=0))
    assert (len(full.train), len(full.eval)) == (7473, 1319)
    assert set(task.train.prompts) < set(full.train.prompts)
    rate = sum(full.rewards(full.eval.solutions, full.eval.answers)) / len(full.eval)
    assert rate == 1.0, f"gsm8k SFT solutions accepted at {rate:.4f}"


def test_math500_loads_with_gold_from_the_answer_line(shared_data):
    path = os.path.join(shared_data, "math500", "test.jsonl")
    task = load_file_task(cfg("math", evaluation=path, n_eval=0))
    assert len(task.train) == 0 and len(task.eval) == 500
    assert task.reward_fn is math_reward
    row = first_row(path)
    assert task.eval.prompts[0] == MATH_TEMPLATE.format(question=row["question"])
    assert task.eval.answers[0] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert all("The answer is:" not in s and "\\boxed" in s for s in task.eval.solutions)
    rate = sum(task.rewards(task.eval.solutions, task.eval.answers)) / len(task.eval)
    assert rate >= 0.95, f"math500 SFT solutions accepted at {rate:.4f} < 0.95"


@pytest.mark.parametrize("name, relpath, rows, gold0", [
    ("aime", "aime24/test.jsonl", 30, "204"), ("amc", "amc23/test.jsonl", 40, "27")])
def test_competition_sets_load(shared_data, name, relpath, rows, gold0):
    task = load_file_task(cfg(name, evaluation=os.path.join(shared_data, relpath), n_eval=256))
    assert len(task.train) == 0 and len(task.eval) == rows
    assert task.eval.answers[0] == gold0
    assert all(a.lstrip("-").isdigit() and not a.startswith("0") for a in task.eval.answers)
    assert all(s.endswith(f"The answer is \\boxed{{{a}}}.")
               for s, a in zip(task.eval.solutions, task.eval.answers))
    assert sum(task.rewards(task.eval.solutions, task.eval.answers)) == rows


def test_subset_counts_and_order(tmp_path):
    lines = [json.dumps({"question": f"q{i}", "answer": f"step\n#### {i}"}) for i in range(10)]
    path = write(tmp_path, "\n".join(lines) + "\n\n")
    task = load_file_task(cfg("gsm8k", path, path, n_train=4, n_eval=3, seed=0))
    assert task.eval.answers == ["0", "1", "2"]
    assert len(task.train) == 4 and set(task.train.answers) <= {str(i) for i in range(10)}
    assert task.train.answers != ["0", "1", "2", "3"]
    assert len(load_file_task(cfg("gsm8k", path, path, n_train=50, n_eval=0)).train) == 10


@pytest.mark.parametrize("name, text, expected", [
    ("gsm8k", "", "has no rows"),
    ("gsm8k", "\n  \n", "has no rows"),
    ("gsm8k", '{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": \n',
     "line 2: not valid JSON"),
    ("gsm8k", '[1, 2]\n', "line 1: expected a JSON object"),
    ("gsm8k", '{"question": "q"}\n', "line 1: missing field 'answer'"),
    ("gsm8k", '{"question": "q", "answer": "no final line"}\n', "line 1: the 'answer' has no"),
    ("math", '{"question": "q", "answer": "no box"}\n', "line 1: the solution has no"),
    ("math", '{"answer": "\\\\boxed{1}"}\n', "line 1: missing field 'question' or 'problem'"),
    ("aime", '{"problem": "p", "solution": "s"}\n', "line 1: missing field 'answer'"),
    # unreadable golds and badly typed fields: one line, never a silent zero reward
    ("gsm8k", '{"question": "q", "answer": "step ####  "}\n', "line 1: the gold answer is empty"),
    ("gsm8k", '{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "#### nine"}\n',
     "line 2: the gold answer 'nine' is not a number"),
    ("gsm8k", '{"question": "q", "answer": "#### 1e400"}\n', "line 1: the gold answer '1e400' is "
     "not a finite number"),
    ("gsm8k", '{"question": 5, "answer": "#### 1"}\n', "line 1: field 'question' must be a string"),
    ("gsm8k", '{"question": {"text": "q"}, "answer": "#### 1"}\n',
     "line 1: field 'question' must be a string, got dict"),
    ("gsm8k", '{"question": "q", "answer": ["#### 1"]}\n',
     "line 1: field 'answer' must be a string"),
    ("math", '{"question": ["q"], "answer": "\\\\boxed{1}"}\n',
     "line 1: field 'question' must be a string"),
    ("math", '{"question": "q", "answer": "x The answer is: \\\\frac{1}{2"}\n',
     "line 1: the gold answer '\\\\frac{1}{2' is unreadable"),
    ("aime", '{"problem": "p", "answer": 1e400}\n', "line 1: the gold answer inf is not a finite"),
    ("aime", '{"problem": "p", "answer": "12 or 13"}\n',
     "line 1: the gold answer '12 or 13' is not"),
    ("amc", '{"problem": "p", "answer": true}\n',
     "line 1: the 'answer' must be a number, got bool"),
    ("amc", '{"problem": "p", "answer": {"v": 1}}\n', "line 1: the 'answer' must be a number"),
])
def test_bad_files_give_one_line_user_errors(tmp_path, name, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_file_task(cfg(name, evaluation=path))
    message = str(err.value)
    assert path in message and expected in message and "\n" not in message


def test_golds_with_units_and_notation_load_and_grade(tmp_path):
    rows = [{"question": "q", "answer": "step\n#### 9 (apples)"},
            {"question": "q", "answer": "step\n#### 4.5e33"}]
    path = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows))
    task = load_file_task(cfg("gsm8k", evaluation=path))
    assert task.eval.answers == ["9 (apples)", "4.5e33"]
    assert task.rewards(["The answer is 9.", "The answer is 4.5 \\times 10^{33}."],
                        task.eval.answers) == [1.0, 1.0]


def test_missing_and_unset_paths(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="not found: .*nope.jsonl"):
        load_file_task(cfg("math", evaluation=missing))
    good = write(tmp_path, '{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(UserError, match="not found: .*nope.jsonl"):
        load_file_task(cfg("gsm8k", missing, good))
    with pytest.raises(UserError, match="task.eval_path' is required"):
        load_file_task(cfg("gsm8k", good, ""))
