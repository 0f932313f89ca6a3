"""hpc-data prepare --preset prm800k: PRM800K's problems for the ESSA paper's split, from files
shaped like github.com/openai/prm800k's (its labelled solutions in prm800k/data, one row a
solution with the problem nested in ``question``, and prm800k/math_splits); duplicates and test
(MATH500) problems leave the training file, and task.n_train with task.sft_split then give
disjoint SFT and training problems."""
import json

from conftest import hpc_data as run, our_lines
from hpc.data.tasks import load_task
from hpc.data.config import TaskConfig


def labelled(problem, answer, solution="", rating=1):
    """One line of prm800k/data/phase*_*.jsonl: a labelled solution of ``problem``."""
    return {"labeler": "340d89bc", "timestamp": "2023-01-22T04:34:27", "generation": 9,
            "is_quality_control_question": False, "is_initial_screening_question": False,
            "question": {"problem": problem, "ground_truth_answer": answer,
                         "ground_truth_solution": solution or None,
                         "pre_generated_steps": ["step"], "pre_generated_answer": answer},
            "label": {"steps": [{"completions": [{"text": "step", "rating": rating}]}],
                      "finish_reason": "solution"}}


def write_jsonl(path, items):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in items))


def problem(i):
    return f"What is ${i} + {i}$?"


def prm800k_folder(tmp_path):
    """prm800k/data: 30 training problems (each labelled twice across the phases, one of them
    also a test problem) and 3 test problems."""
    root = tmp_path / "prm800k"
    train = [labelled(problem(i), str(2 * i), f"${i}+{i}={2 * i}$, so $\\boxed{{{2 * i}}}$.")
             for i in range(30)]
    write_jsonl(root / "data" / "phase1_train.jsonl", train[:20])
    write_jsonl(root / "data" / "phase2_train.jsonl",  # again, phase 2 without solutions
                [labelled(problem(i), str(2 * i), rating=-1) for i in range(30)] +
                [labelled(problem(100), "200")])
    write_jsonl(root / "data" / "phase1_test.jsonl", [labelled(problem(100), "200")])
    write_jsonl(root / "data" / "phase2_test.jsonl",
                [labelled(problem(101), "202"), labelled(problem(102), "204")] * 2)
    return root


def test_the_preset_writes_the_problems_once_and_test_problems_only_in_test(tmp_path, capsys):
    source = prm800k_folder(tmp_path)
    out = tmp_path / "data"
    code, printed, err = run(capsys, "prepare", str(source), str(out), "task.name=math",
                             "--preset", "prm800k", "--subset", "data")
    assert code == 0, err
    train = [json.loads(line) for line in open(out / "train.jsonl")]
    test = [json.loads(line) for line in open(out / "test.jsonl")]
    assert [r["question"] for r in train] == [problem(i) for i in range(30)]
    assert [r["question"] for r in test] == [problem(i) for i in (100, 101, 102)]
    assert "duplicates removed: 20 of 51 rows" in printed
    assert "test problems removed: 1 of 31 rows" in printed
    # the worked solution of phase 1 first; the gold follows it as the math task reads it
    assert train[0]["solution"] == "$0+0=0$, so $\\boxed{0}$.\nThe answer is: 0"
    assert test[1]["solution"] == "$\\boxed{202}$\nThe answer is: 202"  # no solution shipped

    # the paper's split, scaled: n_train of the problems, sft_split of them held apart for SFT
    cfg = TaskConfig(name="math", train_path=str(out / "train.jsonl"),
                     eval_path=str(out / "test.jsonl"), n_train=25, n_eval=0, sft_split=8)
    sft, rest = load_task(cfg, part="held"), load_task(cfg)
    assert (len(sft.train), len(rest.train), len(rest.eval)) == (8, 17, 3)
    assert not set(sft.train.questions) & set(rest.train.questions)
    assert not set(rest.train.questions) & set(rest.eval.questions)
    assert [rest.reward_fn(f"\\boxed{{{a}}}", a) for a in rest.train.answers[:3]] == [1.0] * 3


def test_math_splits_rows_are_read_as_they_are(tmp_path, capsys):
    root = tmp_path / "prm800k" / "math_splits"
    row = {"problem": problem(1), "solution": "$\\boxed{2}$", "answer": "2",
           "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}
    write_jsonl(root / "train.jsonl", [row, dict(row, problem=problem(2), answer="4"), row])
    write_jsonl(root / "test.jsonl", [dict(row, problem=problem(2), answer="4")])
    code, printed, err = run(capsys, "prepare", str(root), str(tmp_path / "out"),
                             "task.name=math", "--preset", "prm800k")
    assert code == 0, err
    train = [json.loads(line) for line in open(tmp_path / "out" / "train.jsonl")]
    assert [r["question"] for r in train] == [problem(1)]
    assert "test problems removed: 1 of 2 rows" in printed


def test_the_preset_is_refused_for_another_task_or_a_name_it_does_not_know(tmp_path, capsys):
    source = prm800k_folder(tmp_path)
    for args, words in ((["task.name=gsm8k", "--preset", "prm800k"], ["prm800k", "math"]),
                        (["task.name=math", "--preset", "nope"], ["nope", "prm800k"])):
        code, _, err = run(capsys, "prepare", str(source), str(tmp_path / "x"), *args,
                           "--subset", "data")
        errors = [line for line in our_lines(err) if line.startswith("error")]
        assert code == 2 and len(errors) == 1, err
        assert all(word in errors[0] for word in words), errors[0]
