"""The ifeval task: IFEval's instruction checkers (lm-eval's) as the reward, strict and loose;
hpc-data prepare for google/IFEval and the IFEval-like training set argilla/ifeval-like-data;
the refusal of instructions that need NLTK data a machine lacks; ESSA and F-GRPO jobs on it."""
import json

import h5py
import pandas
import pytest

from conftest import hf_cached, hpc_data, our_lines, require, run_cli, run_mpi
from hpc.data.mathdata import load_file_task
from hpc.data.config import TaskConfig
from hpc.runtime.errors import UserError


@pytest.fixture(autouse=True)
def lm_eval():
    """lm-eval's checkers, the extra 'ifeval' that `make venv` installs: skipped without it,
    a failure in CI (HPC_TEST_STRICT=1)."""
    import importlib.util

    require(importlib.util.find_spec("lm_eval") is not None, "lm-eval (the extra 'ifeval')")


def gold(ids: list, kwargs: list, prompt: str = "Write a note.") -> str:
    from hpc.data.ifeval import ifeval_row

    return ifeval_row({"prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs},
                      "test", 1)[2]


NOTE = gold(["punctuation:no_comma", "change_case:english_lowercase",
             "detectable_content:postscript", "keywords:existence"],
            [{}, {}, {"postscript_marker": "P.S."}, {"keywords": ["river"]}])


@pytest.mark.parametrize("completion, strict, loose", [
    ("the river runs low\np.s. see you", 1.0, 1.0),  # all four followed
    ("The river runs low, slowly.", 0.25, 0.25),  # only the keyword
    ("the river runs low\nP.S. see you", 0.75, 1.0),  # 'P.S.' breaks lowercase; loose drops it
    ("**the river** runs low\np.s. bye", 1.0, 1.0),
    ("Sure:\nthe river runs low\np.s. bye", 0.75, 1.0),  # loose drops the first line
    ("", 0.0, 0.0),
])
def test_the_reward_is_the_share_of_instructions_followed_strict_and_loose(completion, strict,
                                                                            loose):
    from hpc.data.ifeval import ifeval_reward

    assert ifeval_reward(completion, NOTE) == strict
    assert ifeval_reward(completion, NOTE, "loose") == loose


def test_more_kinds_of_instructions_and_a_checker_that_raises(monkeypatch):
    from hpc.data.ifeval import checkers, ifeval_reward

    words = gold(["length_constraints:number_words", "detectable_format:title",
                  "startend:end_checker"],
                 [{"relation": "less than", "num_words": 8}, {}, {"end_phrase": "Done."}])
    assert ifeval_reward("<<Plan>> one two Done.", words) == 1.0
    assert ifeval_reward("<<Plan>> " + "word " * 10 + "Done.", words) == pytest.approx(2 / 3)
    assert ifeval_reward("Plan: one two. Finished.", words) == pytest.approx(1 / 3)
    for odd in ("\x00\udcff", "{" * 10_000, "é" * 50_000):  # no raise on any completion
        assert 0.0 <= ifeval_reward(odd, words) <= 1.0
    # a checker that raises on a completion counts that instruction as not followed
    title = checkers().instructions_registry.INSTRUCTION_DICT["detectable_format:title"]
    monkeypatch.setattr(title, "check_following", lambda self, value: 1 / 0)
    assert ifeval_reward("<<Plan>> one two Done.", words) == pytest.approx(2 / 3)


def ifeval_rows(n: int, start: int = 0, hub_style: bool = False) -> list:
    """IFEval rows whose instructions need no NLTK data; ``hub_style``: every argument name in
    every kwargs dict, unused ones None, as google/IFEval's Hub copy has them."""
    names = ("postscript_marker", "keywords", "num_words", "relation", "end_phrase")
    kinds = [(["punctuation:no_comma"], [{}]),
             (["detectable_content:postscript", "punctuation:no_comma"],
              [{"postscript_marker": "P.S."}, {}]),
             (["keywords:existence"], [{"keywords": ["1"]}]),  # one item: a list still
             (["length_constraints:number_words"], [{"relation": "at least", "num_words": 3}])]
    out = []
    for key in range(start, start + n):
        ids, kwargs = kinds[key % len(kinds)]
        if hub_style:
            kwargs = [{name: k.get(name) for name in names} for k in kwargs]
        out.append({"key": key, "prompt": f"Add {key} and {key + 1}, then say why.",
                    "instruction_id_list": ids, "kwargs": kwargs})
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path) -> list:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.mark.parametrize("name", ["ifeval_input_data.jsonl", "data/train-00000.parquet"])
def test_prepare_google_ifeval_from_the_cache_drops_unused_arguments(tmp_path, capsys,
                                                                     monkeypatch, name):
    """google/IFEval as its jsonl file or a parquet copy (whose one-item lists pandas reads as
    arrays) in the local Hugging Face cache."""
    cache = tmp_path / "hub"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    source = ifeval_rows(5, hub_style=True)
    if name.endswith(".parquet"):
        pandas.DataFrame(source).to_parquet(tmp_path / "copy.parquet")
        content = (tmp_path / "copy.parquet").read_bytes()
    else:
        content = "".join(json.dumps(r) + "\n" for r in source).encode()
    hf_cached(cache, "google/IFEval", {name: content}, kind="datasets")
    out = tmp_path / "ifeval"
    code, printed, err = hpc_data(capsys, "prepare", "google/IFEval", str(out), "task.name=ifeval")
    assert code == 0, err
    assert "rows the loader rejects: 0" in printed
    path = out / ("ifeval.jsonl" if name.endswith(".jsonl") else "train.jsonl")
    written = read_jsonl(path)
    assert written[1] == {"key": 1, "prompt": source[1]["prompt"],
                          "instruction_id_list": ["detectable_content:postscript",
                                                  "punctuation:no_comma"],
                          "kwargs": [{"postscript_marker": "P.S."}, {}]}
    assert written[2]["kwargs"] == [{"keywords": ["1"]}]
    task = load_file_task(TaskConfig(name="ifeval", eval_path=str(path), n_eval=0))
    assert task.eval.prompts[0] == source[0]["prompt"] + "\n" and task.eval.solutions[0] == ""
    assert task.rewards(["it is 1", "it is 1, or 2"], task.eval.answers[:2]) == [1.0, 0.0]


def test_prepare_the_ifeval_like_training_set_with_json_kwargs_and_responses(tmp_path, capsys):
    """argilla/ifeval-like-data as the Hub lays it out: the unfiltered rows in data/, the
    filtered ones (kwargs a JSON string, a response lm-eval's checkers passed) in filtered/."""
    root = tmp_path / "ifeval-like"
    for folder in ("data", "filtered"):
        (root / folder).mkdir(parents=True)
    filtered = [dict(r, kwargs=json.dumps(r["kwargs"]), response=f"it is {2 * r['key'] + 1}",
                     prompt_level_strict_acc=True)
                for r in ifeval_rows(6, start=10)]
    pandas.DataFrame(filtered).to_parquet(root / "filtered" / "train-00000-of-00001.parquet")
    pandas.DataFrame([{"instruction": "x"}]).to_parquet(root / "data" / "train.parquet")
    code, _, err = hpc_data(capsys, "prepare", str(root), str(tmp_path / "out"),
                            "task.name=ifeval")
    assert code == 2 and "--subset" in err
    code, printed, err = hpc_data(capsys, "prepare", str(root), str(tmp_path / "out"),
                                  "task.name=ifeval", "--subset", "filtered")
    assert code == 0, err
    train = str(tmp_path / "out" / "train.jsonl")
    written = read_jsonl(train)
    assert written[4] == {"key": 14, "prompt": filtered[4]["prompt"],
                          "instruction_id_list": ["keywords:existence"],
                          "kwargs": [{"keywords": ["1"]}], "response": "it is 29"}
    task = load_file_task(TaskConfig(name="ifeval", train_path=train, eval_path=train,
                                     n_eval=0))
    assert sorted(task.train.solutions) == sorted(f" it is {2 * k + 1}" for k in range(10, 16))


@pytest.mark.parametrize("row, words", [
    ({"prompt": "p", "instruction_id_list": ["punctuation:semicolon"], "kwargs": [{}]},
     ["row 1", "'punctuation:semicolon' is not an IFEval instruction id"]),
    ({"prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]},
     ["row 1", "'kwargs' must be a list of 1 objects"]),
    ({"prompt": "p", "instruction_id_list": ["keywords:existence"], "kwargs": [{"word": "a"}]},
     ["row 1", "keywords:existence does not take the arguments"]),
    ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
     ["row 1", "no field 'prompt' or 'instruction'"]),
])
def test_a_bad_row_is_one_line_and_nothing_is_written(tmp_path, capsys, row, words):
    source = write_jsonl(tmp_path / "ifeval.jsonl", [row])
    code, _, err = hpc_data(capsys, "prepare", source, str(tmp_path / "out"), "task.name=ifeval")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert not (tmp_path / "out").exists()


def test_instructions_that_need_nltk_data_are_refused_at_load_without_it(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # no punkt_tab there
    rows = ifeval_rows(2) + [{"prompt": "Three sentences, please.",
                              "instruction_id_list": ["length_constraints:number_sentences"],
                              "kwargs": [{"relation": "less than", "num_sentences": 3}]}]
    path = write_jsonl(tmp_path / "ifeval.jsonl", rows)
    with pytest.raises(UserError) as caught:
        load_file_task(TaskConfig(name="ifeval", eval_path=path, n_eval=0))
    message = str(caught.value)
    assert "\n" not in message and "length_constraints:number_sentences" in message
    assert "python -m nltk.downloader -d DIR punkt_tab" in message and "NLTK_DATA" in message
    load_file_task(TaskConfig(name="ifeval", eval_path=path, n_eval=2))  # those two need none


@pytest.mark.subprocess
def test_the_checkers_import_offline_silently_and_a_job_refuses_in_one_line(tmp_path):
    env = {"NLTK_DATA": str(tmp_path), "HOME": str(tmp_path)}  # no punkt_tab anywhere
    proc = run_cli(["-c", "from hpc.data.ifeval import checkers; checkers()"], env=env)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    path = write_jsonl(tmp_path / "ifeval.jsonl", [{
        "prompt": "Use few capitals.",
        "instruction_id_list": ["change_case:capital_word_frequency"],
        "kwargs": [{"capital_relation": "less than", "capital_frequency": 3}]}])
    proc = run_cli(["-m", "fgrpo", "task.name=ifeval", f"task.eval_path={path}",
                    f"task.train_path={path}", f"run.out={tmp_path / 'run'}"], env=env)
    lines = our_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "change_case:capital_word_frequency" in lines[0] and "punkt_tab" in lines[0]
    assert "Traceback" not in proc.stderr and "nltk_data" not in proc.stderr


JOB = ["model.path=toy", "task.name=ifeval", "task.n_train=16", "task.n_eval=8",
       "task.max_new_tokens=6", "eval.every=0", "eval.n_samples=2", "run.progress=false"]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.parametrize("method, extra", [
    ("essa", ["essa.population=4", "essa.minibatch=8", "essa.generations=2"]),
    ("fgrpo", ["fgrpo.steps=2", "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=2",
               "task.ifeval_check=loose"]),
])
def test_a_job_trains_on_ifeval_on_two_ranks(tmp_path, toy_adapter, method, extra):
    train = write_jsonl(tmp_path / "train.jsonl", ifeval_rows(16))
    test = write_jsonl(tmp_path / "test.jsonl", ifeval_rows(8, start=100))
    out = tmp_path / method
    proc = run_mpi(2, ["-m", method, *JOB, f"task.train_path={train}", f"task.eval_path={test}",
                       f"lora.adapter={toy_adapter}", *extra, f"run.out={out}"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with h5py.File(out / f"{method}.h5", "r") as f:
        assert f.attrs["status"] == "complete"
        assert "name: ifeval" in f.attrs["config"]
        rewards = [f["metrics"][name][()] for name in f["metrics"]
                   if name in ("fitness_mean", "reward_mean")]
    # shares of instructions followed; the toy's digits follow some (no commas)
    assert len(rewards) == 1 and ((0 <= rewards[0]) & (rewards[0] <= 1)).all(), rewards
    assert rewards[0].max() > 0, rewards
