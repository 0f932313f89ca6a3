"""hpc-data check: rows, rejected rows, unreadable golds and over-long prompts of a data file."""
import json
import os

import pytest

from conftest import hpc_data as run
from hpc.toys.toy import toy_model_path


@pytest.mark.toy
def test_gsm8k_test_file_is_clean(shared_data, capsys):
    path = os.path.join(shared_data, "gsm8k", "test.jsonl")
    code, out, _ = run(capsys, "check", path, "task.name=gsm8k", f"model.path={toy_model_path()}",
                       "plan.max_prompt_tokens=4096")
    assert code == 0
    for line in ["rows: 1319", "rows the loader rejects: 0", "golds the grader cannot read: 0",
                 "over plan.max_prompt_tokens=4096: 0"]:
        assert line in out


@pytest.mark.toy
def test_problems_are_counted_with_their_lines(tmp_path, capsys):
    rows = [{"question": "1+1?", "answer": "1+1=2\n#### 2"},
            {"question": "2+2?", "answer": "no final line"},
            {"question": "3+3?", "answer": "#### six"},
            {"question": "What is " + "very " * 40 + "big?", "answer": "#### 7"}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run(capsys, "check", str(path), "task.name=gsm8k",
                         f"model.path={toy_model_path()}", "plan.max_prompt_tokens=100")
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1
    assert "rows: 4" in out
    # "#### six": the loader itself refuses a non-numeric GSM8K gold (hpc.data.mathdata)
    assert "rows the loader rejects: 2 (lines 2, 3); first: " in out and "'#### <number>'" in out
    assert "golds the grader cannot read: 0" in out
    assert "over plan.max_prompt_tokens=100: 1 (lines 4)" in out


def test_without_tokenizer_lengths_are_not_checked(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"problem": "x?", "solution": "so \\boxed{\\frac{1}{2}}"}) + "\n")
    code, out, _ = run(capsys, "check", str(path), "task.name=math")
    assert code == 0 and "token lengths: not checked" in out


def test_arith_is_not_a_file_task(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    path.write_text("{}\n")
    code, _, err = run(capsys, "check", str(path))
    assert code == 2 and "'arith' is not a file task" in err


def test_missing_model_path_is_one_line(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    code, out, err = run(capsys, "check", str(path), "task.name=gsm8k",
                         f"model.path={tmp_path / 'no-model'}")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: ") and "model.path" in err and "no-model" in err


def test_built_in_names_are_the_served_ones():
    from hpc.models.folders import BUILT_IN_MODELS
    from hpc.runtime.methods import load_ref
    from hpc.toys import toy, toy_chat

    served = {name: load_ref(ref) for name, ref in BUILT_IN_MODELS.items()}
    assert served == {"toy": toy.toy_model_path, "toy-chat": toy_chat.toy_chat_model_path}


@pytest.mark.parametrize("line, words", [
    ('{"question": "x", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}",
     ["line 1", "nested 100001 levels deep"]),
    ('{"question": "' + "x" * (2 ** 22) + '", "answer": "#### 2"}', ["line 1", "longer than"]),
])
def test_oversized_rows_are_one_line(tmp_path, capsys, line, words):
    """Bounded before parsing: 100k nested arrays were a RecursionError."""
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    code, out, err = run(capsys, "check", str(path), "task.name=gsm8k")
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    for word in [str(path), *words]:
        assert word in err


def test_byte_order_mark_is_read_as_utf8(tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n",
                    encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    code, out, err = run(capsys, "check", str(path), "task.name=gsm8k")
    assert code == 0, err
    assert "rows: 1" in out and "rows the loader rejects: 0" in out
