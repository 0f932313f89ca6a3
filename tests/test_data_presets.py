"""hpc-data prepare's presets for the F-GRPO paper's data: DeepScaleR (duplicates dropped, prompts
over 1024 tokens dropped, counted as the job renders them), Minerva math and OlympiadBench
(evaluation sets graded by math-verify), from files shaped like their Hub copies; a training
job's task loads what it writes."""
import json
import os

import pandas
import pytest

from conftest import hpc_data as run
from hpc.data.mathdata import load_file_task
from hpc.data.rewards import math_reward
from hpc.data.config import TaskConfig

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


def rows(path) -> list:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture
def model_dir(tmp_path):
    """A model folder whose tokenizer counts one token a word or run of punctuation, with a
    chat template (config, weights and tokenizer files, as a model folder holds them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "model"
    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>",
         "chat_template": CHAT_TEMPLATE}))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w")
    return str(folder)


def words(n: int) -> str:
    return " ".join(["word"] * n)


# DeepScaleR as agentica-org/DeepScaleR-Preview-Dataset ships it: one JSON list, problem /
# answer / solution (an empty solution on some rows).
DEEPSCALER = [
    {"problem": "What is 1+1?", "answer": "2", "solution": "1+1=2."},
    {"problem": "  What is   1+1?\n", "answer": "2", "solution": ""},  # the same, spaced
    {"problem": "Find $x$ if $2x=6$.", "answer": "3", "solution": "x = 6/2 = 3."},
    {"problem": "Find $x$ if $2x=6$.", "answer": "3", "solution": "Divide."},  # exact repeat
    {"problem": f"Sum {words(60)}.", "answer": "60", "solution": ""},  # long however rendered
    {"problem": f"Count {words(30)}.", "answer": "30", "solution": ""},  # long only as a chat
    {"problem": "Simplify $\\frac{\\sqrt{12}}{4}$.", "answer": "\\frac{\\sqrt{3}}{2}",
     "solution": ""},
    {"problem": "Solve $x^2=4$, $x>0$.", "answer": 2, "solution": "x = 2."},
]
LIMIT = 40  # the raw 'Count ...' problem has 32 tokens; with the system prompt it has 56


def test_deepscaler_drops_duplicates_and_prompts_too_long_as_the_job_renders_them(
        tmp_path, capsys, model_dir):
    source = tmp_path / "deepscaler.json"
    source.write_text(json.dumps(DEEPSCALER))
    out = tmp_path / "out"
    config = [f"model.path={model_dir}", "task.prompt_format=qwen25-math-cot"]
    code, printed, err = run(capsys, "prepare", str(source), str(out), "task.name=deepscaler",
                             *config, "--max-prompt-tokens", str(LIMIT))
    assert code == 0, err
    written = out / "deepscaler.jsonl"
    assert f"wrote {written}: 4 rows from {source}" in printed
    assert "duplicates removed: 2 of 8 rows" in printed
    assert (f"prompts over {LIMIT} tokens removed: 2 of 6 rows (task.prompt_format="
            f"qwen25-math-cot, model.path={model_dir}'s tokenizer)") in printed
    assert "rows the loader rejects: 0" in printed and "golds the grader cannot read: 0" in printed
    kept = rows(written)
    assert [r["question"] for r in kept] == [DEEPSCALER[i]["problem"] for i in (0, 2, 6, 7)]
    assert kept[0] == {"question": "What is 1+1?", "answer": "2", "solution": "1+1=2."}
    assert kept[2] == {"question": DEEPSCALER[6]["problem"], "answer": "\\frac{\\sqrt{3}}{2}"}

    # the lengths the filter used are those of the prompts a job of this config decodes
    code, _, err = run(capsys, "prepare", str(source), str(tmp_path / "all"),
                       "task.name=deepscaler", *config, "--max-prompt-tokens", "0")
    assert code == 0, err
    from hpc.data.tasks import load_task
    from hpc.models.loading import load_tokenizer

    every = str(tmp_path / "all" / "deepscaler.jsonl")
    task = load_task(TaskConfig(name="deepscaler", train_path=every, eval_path=every, n_eval=0,
                                prompt_format="qwen25-math-cot"), model_dir)
    lengths = [len(ids) for ids in load_tokenizer(model_dir)(task.eval.prompts)["input_ids"]]
    assert [q for q, n in zip(task.eval.questions, lengths) if n <= LIMIT] == \
        [r["question"] for r in kept]
    raw = load_tokenizer(model_dir)([r["question"] for r in rows(every)])["input_ids"]
    assert sum(len(ids) > LIMIT for ids in raw) == 1  # the raw text would have kept 'Count'


def test_the_default_limit_is_1024_for_deepscaler_and_none_for_the_others(tmp_path, capsys,
                                                                          model_dir):
    source = tmp_path / "deepscaler.json"
    source.write_text(json.dumps(DEEPSCALER + [{"problem": words(1100), "answer": "1"}]))
    code, printed, err = run(capsys, "prepare", str(source), str(tmp_path / "out"),
                             "task.name=deepscaler", f"model.path={model_dir}")
    assert code == 0, err
    assert ("prompts over 1024 tokens removed: 1 of 7 rows (task.prompt_format=plain, "
            f"model.path={model_dir}'s tokenizer)") in printed
    assert len(rows(tmp_path / "out" / "deepscaler.jsonl")) == 6
    code, printed, err = run(capsys, "prepare", str(source), str(tmp_path / "minerva"),
                             "task.name=minerva")  # no preset: nothing dropped, no tokenizer
    assert code == 0, err
    assert "removed" not in printed and len(rows(tmp_path / "minerva" / "deepscaler.jsonl")) == 9


def test_a_training_job_reads_deepscaler_and_evaluates_on_math500(tmp_path, capsys, model_dir,
                                                                   shared_data):
    from fgrpo.config import FGRPOJobConfig
    from hpc.data.tasks import load_task
    from hpc.runtime.config import load_config

    (tmp_path / "deepscaler.json").write_text(json.dumps(DEEPSCALER))
    code, _, err = run(capsys, "prepare", str(tmp_path / "deepscaler.json"),
                       str(tmp_path / "data"), "task.name=deepscaler", f"model.path={model_dir}")
    assert code == 0, err
    math500 = os.path.join(shared_data, "math500", "test.jsonl")
    cfg = load_config(FGRPOJobConfig, None, [
        "task.name=deepscaler", f"task.train_path={tmp_path / 'data' / 'deepscaler.jsonl'}",
        f"task.eval_path={math500}", "task.n_train=0", "task.n_eval=0",
        f"model.path={model_dir}", "task.prompt_format=chat"])
    task = load_task(cfg.task, cfg.model.path)
    assert sorted(task.train.questions) == sorted(DEEPSCALER[i]["problem"]
                                                  for i in (0, 2, 4, 5, 6, 7))
    assert task.train.prompts[0].startswith("[user] ") and task.chat
    math_golds = load_file_task(TaskConfig(name="math", eval_path=math500, n_eval=0)).eval.answers
    assert task.eval.answers == math_golds and len(math_golds) == 500
    assert task.reward_fn is math_reward


# Minerva math as math-ai/minervamath ships it (question, answer), and a copy with problem and a
# worked \boxed{} solution instead.
MINERVA = [
    {"question": "Find the luminosity in erg/s.", "answer": "3.83e35"},
    {"question": "What fraction of the light passes?", "answer": "0.3"},
    {"question": "Give the angular frequency.", "answer": "\\frac{2 \\pi c}{\\lambda}"},
    {"question": "Give the rate.", "answer": "7.5 \\times 10^{-11}"},
]


def test_minerva_from_parquet_and_from_worked_solutions(tmp_path, capsys):
    pandas.DataFrame(MINERVA).to_parquet(tmp_path / "test-00000-of-00001.parquet")
    code, printed, err = run(capsys, "prepare", str(tmp_path / "test-00000-of-00001.parquet"),
                             str(tmp_path / "out"), "task.name=minerva")
    assert code == 0, err
    assert "rows the loader rejects: 0" in printed and "golds the grader cannot read: 0" in printed
    written = tmp_path / "out" / "test.jsonl"
    assert rows(written) == MINERVA
    task = load_file_task(TaskConfig(name="minerva", eval_path=str(written), n_eval=0))
    assert task.eval.answers == [r["answer"] for r in MINERVA] and len(task.train) == 0
    assert all(math_reward(f"So it is \\boxed{{{a}}}.", a) == 1.0 for a in task.eval.answers)

    worked = [{"problem": r["question"], "solution": f"Work. \\boxed{{{r['answer']}}}"}
              for r in MINERVA]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in worked))
    code, _, err = run(capsys, "prepare", str(tmp_path / "test.jsonl"), str(tmp_path / "out2"),
                       "task.name=minerva")
    assert code == 0, err
    again = load_file_task(TaskConfig(name="minerva", eval_path=str(tmp_path / "out2" /
                                                                    "test.jsonl"), n_eval=0))
    assert again.eval.answers == task.eval.answers


def test_olympiadbench_final_answer_lists_and_other_field_names(tmp_path, capsys):
    hub = [  # math-ai/olympiadbench, Hothan/OlympiadBench: final_answer and solution as lists
        {"id": 1, "question": "Find $a$.", "final_answer": ["$\\frac{1}{2}$"],
         "solution": ["Step one.", "So $a=\\frac{1}{2}$."], "is_multiple_answer": False,
         "unit": None, "answer_type": "Numerical"},
        {"id": 2, "question": "Find all $n$.", "final_answer": ["$3$", "$5$"],
         "solution": ["Check."], "is_multiple_answer": True, "unit": None,
         "answer_type": "Numerical"},
        {"id": 3, "question": "Find the triples.", "final_answer": ["$(2,2,2),(3,4,3)$"],
         "solution": [], "is_multiple_answer": True, "unit": None, "answer_type": "Tuple"},
    ]
    pandas.DataFrame(hub).to_parquet(tmp_path / "test.parquet")
    code, printed, err = run(capsys, "prepare", str(tmp_path / "test.parquet"),
                             str(tmp_path / "out"), "task.name=olympiadbench")
    assert code == 0, err
    assert "rows the loader rejects: 0" in printed and "golds the grader cannot read: 0" in printed
    written = rows(tmp_path / "out" / "test.jsonl")
    assert [r["answer"] for r in written] == ["\\frac{1}{2}", "3, 5", "(2,2,2),(3,4,3)"]
    assert written[0]["solution"] == "Step one.\n\nSo $a=\\frac{1}{2}$."
    assert "solution" not in written[2]
    task = load_file_task(TaskConfig(name="olympiadbench",
                                     eval_path=str(tmp_path / "out" / "test.jsonl"), n_eval=0))
    assert math_reward("The answer is \\boxed{5, 3}.", task.eval.answers[1]) == 1.0
    assert math_reward("The answer is \\boxed{3}.", task.eval.answers[1]) == 0.0

    (tmp_path / "olympiad.jsonl").write_text(json.dumps({"problem": "Find $b$.",
                                                         "answer": "$-1$"}) + "\n")
    code, _, err = run(capsys, "prepare", str(tmp_path / "olympiad.jsonl"), str(tmp_path / "o"),
                       "task.name=olympiadbench")
    assert code == 0, err
    assert rows(tmp_path / "o" / "olympiad.jsonl") == [{"question": "Find $b$.", "answer": "-1"}]


@pytest.mark.parametrize("args, words", [
    (["task.name=deepscaler"], ["row 2: no field 'answer' or 'final_answer' or 'solution'"]),
    (["task.name=olympiad"], ["task.name", "olympiad", "olympiadbench"]),
    (["task.name=deepscaler", "model.path={empty}", "--max-prompt-tokens", "8"],
     ["the prompt-length filter counts tokens with model.path's tokenizer",
      "cannot load the tokenizer in {empty}", "--max-prompt-tokens 0"]),
    (["task.name=deepscaler", "--max-prompt-tokens", "-1"], ["--max-prompt-tokens -1"]),
])
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, args, words):
    data = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "hint": "4"}]
    if "row 2" not in words[0]:
        data = data[:1]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / "empty").mkdir()  # a folder without a tokenizer
    args = [a.replace("{empty}", str(tmp_path / "empty")) for a in args]
    words = [w.replace("{empty}", str(tmp_path / "empty")) for w in words]
    code, _, err = run(capsys, "prepare", str(tmp_path / "train.jsonl"), str(tmp_path / "out"),
                       *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert not (tmp_path / "out").exists()
