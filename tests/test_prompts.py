"""Prompt formats: chat templates, presets, the SFT mask of a templated prompt, stop tokens, and
the one-line exit 2 for a model without a chat template. Uses a random tiny Qwen2 with the
toy-chat tokenizer design (BPE trained on generated word problems: no data files needed)."""
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from conftest import our_lines, run_cli, run_mpi
from hpc.data.prompts import QWEN_MATH_SYSTEM, completion_batch
from hpc.data.tasks import load_task
from hpc.data.wordproblems import word_problems
from hpc.models.chat import end_of_turn_id, stop_token_ids
from hpc.engine.generate import eos_ids
from hpc.data.config import TaskConfig
from hpc.toys.toy import tiny_model
from hpc.toys.toy_chat import IM_END, build_chat_tokenizer, chat_qwen2_config


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A random tiny Qwen2 with a BPE tokenizer and Qwen-style chat template, saved."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    texts = [q + "\n" + s for q, _, s in word_problems(300, seed=7)]
    tokenizer = build_chat_tokenizer(texts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(chat_qwen2_config(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def task_cfg(**kw):
    return TaskConfig(**dict({"name": "wordprob", "n_train": 20, "n_eval": 8}, **kw))


def test_stop_tokens_follow_the_template(chat_folder):
    tok = AutoTokenizer.from_pretrained(chat_folder)
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert tok.eos_token == "<|endoftext|>" and end_of_turn_id(tok) == im_end
    assert stop_token_ids(tok) == sorted({tok.eos_token_id, im_end})
    model = Qwen2ForCausalLM.from_pretrained(chat_folder)
    assert set(eos_ids(model, tok)) == {tok.eos_token_id, im_end}
    _, char_tok = tiny_model()
    assert end_of_turn_id(char_tok) is None and stop_token_ids(char_tok) == [char_tok.eos_token_id]


def test_chat_prompt_and_presets(chat_folder):
    plain = load_task(task_cfg())
    assert plain.eval.prompts[0].startswith("Question: ") and not plain.chat
    chat = load_task(task_cfg(prompt_format="chat"), chat_folder)
    question = plain.eval.questions[0]
    assert chat.chat and chat.eval.prompts[0] == (
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert chat.eval.solutions[0] == plain.eval.solutions[0].strip()
    cot = load_task(task_cfg(prompt_format="qwen25-math-cot"), chat_folder)
    assert cot.eval.prompts[0].startswith(f"<|im_start|>system\n{QWEN_MATH_SYSTEM}<|im_end|>\n")
    own = load_task(task_cfg(prompt_format="qwen25-math-cot", system_prompt="Be brief."),
                    chat_folder)
    assert own.eval.prompts[0].startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    gsm = load_task(task_cfg(prompt_format="gsm8k-plain"))
    assert gsm.eval.prompts[0] == f"Question: {question}\nAnswer: Let's think step by step."
    math = load_task(TaskConfig(n_train=4, n_eval=4, prompt_format="math-plain"))
    assert math.eval.prompts[0] == f"Problem: {math.eval.questions[0]}\nSolution:"


def test_sft_masks_the_templated_prompt(chat_folder):
    tok = AutoTokenizer.from_pretrained(chat_folder)
    task = load_task(task_cfg(prompt_format="chat"), chat_folder)
    prompts, solutions = task.train.prompts[:4], task.train.solutions[:4]
    ids, mask, labels = completion_batch(tok, prompts, solutions, "cpu", chat=True)
    im_end = tok.convert_tokens_to_ids(IM_END)
    for row in range(4):
        p = tok(prompts[row], add_special_tokens=False)["input_ids"]
        s = tok(solutions[row], add_special_tokens=False)["input_ids"]
        n = int(mask[row].sum())
        assert n == len(p) + len(s) + 1 and ids[row, :len(p)].tolist() == p
        assert (labels[row, :len(p)] == -100).all() and (labels[row, n:] == -100).all()
        assert labels[row, len(p):n].tolist() == s + [im_end]
    plain_ids, _, plain_labels = completion_batch(tok, ["Question: 1+1?"], [" 2"], "cpu")
    assert plain_labels[0, -1] == tok.eos_token_id


@pytest.mark.mpi
def test_chat_without_template_is_one_line_exit_2(tiny_models, tmp_path):
    model_dir, _, _ = tiny_models["small"]
    proc = run_cli(["-m", "hpc.evaluate", f"model.path={model_dir}", "task.prompt_format=chat",
                    "run.progress=false", f"run.out={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and "no chat template" in lines[0] and model_dir in lines[0], lines
    assert not (tmp_path / "run" / "eval.h5").exists()
    proc = run_mpi(2, ["-m", "sft", f"model.path={model_dir}", "task.prompt_format=chat",
                       "run.progress=false", f"run.out={tmp_path / 'run2'}"], timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all("no chat template" in line for line in our_lines(proc.stderr))
    assert not (tmp_path / "run2" / "sft.h5").exists()
