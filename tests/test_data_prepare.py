"""hpc-data prepare: the public math sets as distributed (GSM8K parquet, MATH-500's problem /
solution / answer, AIME and AMC files) from a file, a folder or a Hub dataset id in the local
cache, written as the files the tasks read and checked as hpc-data check checks them; the
README's data example works after it."""
import json
import os
import shutil

import pandas
import pytest

from conftest import REPO, hf_cached as cached, hpc_data as run
from hpc.data.mathdata import load_file_task
from hpc.data.prepare import split_of, task_row
from hpc.data.config import TaskConfig


def rows(path) -> list:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def golds(task: str, path) -> list:
    return load_file_task(TaskConfig(name=task, eval_path=str(path))).eval.answers


@pytest.mark.parametrize("task, folder", [("gsm8k", "gsm8k"), ("math", "math500"),
                                          ("aime", "aime24"), ("amc", "amc23")])
def test_the_shared_files_become_task_files_with_the_same_golds(shared_data, tmp_path, capsys,
                                                                task, folder):
    source = os.path.join(shared_data, folder, "test.jsonl")
    code, out, err = run(capsys, "prepare", source, str(tmp_path), f"task.name={task}")
    assert code == 0, err
    written = tmp_path / "test.jsonl"
    assert f"wrote {written}: {len(rows(source))} rows from {source}" in out
    assert "rows the loader rejects: 0" in out and "golds the grader cannot read: 0" in out
    assert golds(task, written) == golds(task, source)


def test_math500_as_on_the_hub_keeps_its_answer_as_the_gold(shared_data, tmp_path, capsys):
    """HuggingFaceH4/MATH-500 ships problem, solution (worked, \\boxed{}) and answer."""
    hub = []
    for row in rows(os.path.join(shared_data, "math500", "test.jsonl"))[:50]:
        worked, _, answer = row["answer"].rpartition("The answer is:")
        hub.append({"problem": row["question"], "solution": worked.strip(),
                    "answer": answer.strip(), "subject": "x", "level": 1, "unique_id": "u"})
    pandas.DataFrame(hub).to_parquet(tmp_path / "test.parquet")
    code, _, err = run(capsys, "prepare", str(tmp_path / "test.parquet"), str(tmp_path / "out"),
                       "task.name=math")
    assert code == 0, err
    assert golds("math", tmp_path / "out" / "test.jsonl") == [r["answer"] for r in hub]


def test_aime_with_capitalised_fields_in_parquet(tmp_path, capsys):
    pandas.DataFrame([{"ID": "2024-I-1", "Problem": "Find 2+3.", "Solution": "2+3=5.",
                       "Answer": 5}]).to_parquet(tmp_path / "aime_2024_problems.parquet")
    code, out, err = run(capsys, "prepare", str(tmp_path / "aime_2024_problems.parquet"),
                         str(tmp_path / "out"), "task.name=aime")
    assert code == 0, err
    assert rows(tmp_path / "out" / "aime.jsonl") == [
        {"question": "Find 2+3.", "answer": 5, "solution": "2+3=5."}]


def test_splits_and_shards_of_a_folder(tmp_path):
    assert split_of("train-00000-of-00002.parquet") == "train"
    assert split_of(os.path.join("data", "test", "part-0.parquet")) == "test"
    assert split_of("aime_2024_problems.parquet") == "aime"


def gsm8k_dataset(shared_data, root, subsets=("main", "socratic"), n=20) -> dict:
    """GSM8K as openai/gsm8k lays it out: <subset>/<split>-0000x-of-0000y.parquet, the train
    split in two shards; {relative path: file} of parquet files written under ``root``."""
    files = {}
    for split in ("train", "test"):
        data = rows(os.path.join(shared_data, "gsm8k", f"{split}.jsonl"))[:n]
        for subset in subsets:
            shards = [data[:n // 2], data[n // 2:]] if split == "train" else [data]
            for i, shard in enumerate(shards):
                name = f"{subset}/{split}-{i:05d}-of-{len(shards):05d}.parquet"
                path = os.path.join(root, name.replace("/", "-"))
                pandas.DataFrame(shard).to_parquet(path)
                files[name] = path
    return files


def test_a_folder_of_subsets_needs_subset(shared_data, tmp_path, capsys):
    folder = tmp_path / "gsm8k"
    for name, path in gsm8k_dataset(shared_data, tmp_path).items():
        os.makedirs(folder / os.path.dirname(name), exist_ok=True)
        shutil.copy(path, folder / name)
    code, _, err = run(capsys, "prepare", str(folder), str(tmp_path / "out"), "task.name=gsm8k")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "subsets main, socratic" in lines[0], lines
    assert not (tmp_path / "out").exists()
    code, out, err = run(capsys, "prepare", str(folder), str(tmp_path / "out"),
                         "task.name=gsm8k", "--subset", "main")
    assert code == 0, err
    assert len(rows(tmp_path / "out" / "train.jsonl")) == 20  # both shards, in order
    assert rows(tmp_path / "out" / "train.jsonl")[10] == \
        rows(os.path.join(shared_data, "gsm8k", "train.jsonl"))[10]


@pytest.mark.parametrize("source, words", [
    ("org/nothing", ["holds no snapshot of the dataset org/nothing",
                     "`hf download org/nothing --repo-type dataset`"]),
    ("/no/such/file.jsonl", ["/no/such/file.jsonl is no file, folder or Hub dataset id"]),
])
def test_a_source_not_there_is_one_line(tmp_path, capsys, monkeypatch, source, words):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    code, _, err = run(capsys, "prepare", source, str(tmp_path / "out"), "task.name=gsm8k")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and all(w in lines[0] for w in words), lines


def test_a_row_without_its_field_is_one_line_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n'
                                         '{"query": "2+2?", "answer": "#### 4"}\n')
    code, _, err = run(capsys, "prepare", str(tmp_path / "test.jsonl"), str(tmp_path / "out"),
                       "task.name=gsm8k")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"{tmp_path / 'test.jsonl'} row 2: no field 'question' or 'problem' (its fields: " \
           f"answer, query)" in lines[0]
    assert not (tmp_path / "out").exists()
    code, _, err = run(capsys, "prepare", str(tmp_path / "test.jsonl"), str(tmp_path / "out"))
    assert code == 2 and "'arith' is not a file task" in err


def test_math_rows_without_a_short_answer_keep_their_solution():
    row = task_row("math", {"problem": "p", "solution": "s \\boxed{1}"}, "x")
    assert row == {"question": "p", "solution": "s \\boxed{1}"}
    worked = task_row("math", {"question": "p", "answer": "w The answer is: 1"}, "x")
    assert worked == {"question": "p", "solution": "w The answer is: 1"}


def word_tokenizer(path):
    """A tokenizer.json of one word a token, as a model folder holds one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def test_the_readme_data_example_works_after_prepare(shared_data, tmp_path, capsys, monkeypatch):
    """The README: `hf download` puts the model and GSM8K in the cache (here: laid out by
    hand), `hpc-data prepare` writes data/gsm8k, then `hpc-data check` on it passes with the
    cluster config as it is."""
    cache = tmp_path / "hub"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    word_tokenizer(tmp_path / "tokenizer.json")
    cached(cache, "Qwen/Qwen2.5-7B-Instruct", {"config.json": b"{}",
                                               "model.safetensors": b"w",
                                               "tokenizer.json": str(tmp_path / "tokenizer.json")})
    cached(cache, "openai/gsm8k", gsm8k_dataset(shared_data, tmp_path), kind="datasets")
    monkeypatch.chdir(tmp_path)
    config = os.path.join(REPO, "configs", "cluster", "math.yaml")
    code, out, err = run(capsys, "prepare", "openai/gsm8k", "data/gsm8k", config,
                         "--subset", "main")
    assert code == 0, err
    assert "prompt tokens: min" in out  # the model's tokenizer, found by its id
    code, out, err = run(capsys, "check", "data/gsm8k/test.jsonl", config)
    assert code == 0, err
    assert "rows: 20" in out and "rows the loader rejects: 0" in out
