"""The real-model path end to end on the built-in chat toy (BPE tokenizer, chat template,
``<|im_end|>``), 2 ranks under the real mpirun: SFT, hpc-eval, ESSA and F-GRPO in chat format.
Completions of very different lengths share a batch and end at the end-of-turn token, and the
exported adapters, loaded by plain transformers + peft, score what the jobs logged."""
import os
import time

import numpy as np
import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SHARED_DATA, charge_shared_build, require, run_mpi
from hpc.data.prompts import chat_messages
from hpc.data.rewards import math_reward
from hpc.data.wordproblems import word_problems
from hpc.models.chat import stop_token_ids
from hpc.engine.generate import generate_tokens
from hpc.toys.toy_chat import CORPUS_ENV, IM_END, toy_chat_model_path
from hpc.runtime.runstore import RunFile
from hpc.runtime.world import split_evenly

# one worker: the module's chat model and its SFT run are built once
pytestmark = [pytest.mark.mpi, pytest.mark.toy, pytest.mark.xdist_group("toy_chat")]

N_EVAL, EVAL_BATCH, MAX_NEW = 32, 16, 144
CHAT = ["model.path=toy-chat", "task.name=wordprob", "task.prompt_format=chat",
        "task.n_train=400", f"task.n_eval={N_EVAL}", f"task.max_new_tokens={MAX_NEW}",
        "eval.every=0", "eval.n_samples=2", f"eval.batch_size={EVAL_BATCH}",
        "run.progress=false"]


@pytest.fixture(scope="module")
def toy_chat():
    """The cached toy-chat model folder (built from the shared GSM8K text if absent; the
    module-scoped twin of conftest's ``shared_data`` fixture)."""
    require(os.path.isdir(SHARED_DATA), f"the shared data folder {SHARED_DATA}")
    os.environ[CORPUS_ENV] = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")
    began = time.monotonic()
    folder = toy_chat_model_path()  # built once per machine, like the toy model
    charge_shared_build(time.monotonic() - began)
    return folder


@pytest.fixture(scope="module")
def chat_sft(toy_chat, tmp_path_factory):
    """A 2-rank chat-format LoRA SFT run on the toy-chat model; its output folder."""
    out = tmp_path_factory.mktemp("chat-sft")
    proc = run_mpi(2, ["-m", "sft", *CHAT, "lora.rank=8", "lora.alpha=16", "sft.steps=20",
                       "sft.batch_size=16", "sft.lr=0.003", f"run.out={out}"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def held_out_prompts(tokenizer):
    """The jobs' held-out split (wordprob, task.seed 0): chat prompts and gold answers."""
    problems = word_problems(N_EVAL, seed=0)
    prompts = [tokenizer.apply_chat_template(chat_messages(q), tokenize=False,
                                             add_generation_prompt=True) for q, _, _ in problems]
    return prompts, [a for _, a, _ in problems]


def plain_peft_completions(toy_chat, adapter_dir):
    """Greedy completion ids of the held-out prompts by plain transformers + peft, each rank's
    share as one batch (as the 2-rank job generated them); also the tokenizer and answers."""
    tok = AutoTokenizer.from_pretrained(toy_chat)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(toy_chat),
                                      str(adapter_dir)).eval()
    prompts, answers = held_out_prompts(tok)
    ids, lo = [], 0
    for count in split_evenly(N_EVAL, 2):
        ids += generate_tokens(model, tok, prompts[lo:lo + count], MAX_NEW,
                               batch_size=EVAL_BATCH)
        lo += count
    return ids, tok, answers


def accuracy_of(ids, tok, answers) -> float:
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    return float(np.mean([math_reward(t, a) for t, a in zip(texts, answers)]))


def test_sft_in_chat_format(toy_chat, chat_sft):
    """SFT learns (its loss falls; held-out accuracy on 32 problems does not drop by more than
    two: the CPU-built toy-chat sits at near ties, 0.375 -> 0.344 on AMD EPYC, up on Intel);
    its completions end at <|im_end|> at very different lengths within one batch; the adapter
    in plain transformers + peft scores the logged accuracy."""
    run = RunFile(str(chat_sft / "sft.h5"))
    acc, loss = run.group("eval")["accuracy"], run.group("metrics")["loss"]
    ids, tok, answers = plain_peft_completions(toy_chat, chat_sft / "adapter")
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert im_end in stop_token_ids(tok) and tok.eos_token_id != im_end
    ended = [row for row in ids if row and row[-1] == im_end]
    lengths = sorted(len(row) for row in ended)
    print(f"held-out accuracy base {acc[0]:.3f} -> SFT {acc[-1]:.3f}; {len(ended)}/{len(ids)} "
          f"completions end at <|im_end|>, lengths {lengths[0]}..{lengths[-1]} tokens")
    assert len(ended) >= 0.9 * len(ids)
    assert lengths[-1] - lengths[0] >= 50
    assert accuracy_of(ids, tok, answers) == acc[-1]
    assert np.mean(loss[-5:]) < np.mean(loss[:5])
    assert acc[-1] >= acc[0] - 2 / N_EVAL


def test_hpc_eval_in_chat_format(chat_sft, tmp_path):
    out = tmp_path / "eval"
    proc = run_mpi(2, ["-m", "hpc.evaluate", *CHAT, f"lora.adapter={chat_sft / 'adapter'}",
                       f"run.out={out}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = RunFile(str(out / "eval.h5")).group("eval")
    sft = RunFile(str(chat_sft / "sft.h5")).group("eval")
    assert result["accuracy"][-1] == sft["accuracy"][-1]
    assert np.array_equal(result["pass_at_k"][-1], sft["pass_at_k"][-1])


def test_essa_in_chat_format(toy_chat, chat_sft, tmp_path):
    out = tmp_path / "essa"
    proc = run_mpi(2, ["-m", "essa", *CHAT, f"lora.adapter={chat_sft / 'adapter'}",
                       "essa.population=4", "essa.minibatch=8", "essa.generations=2",
                       "essa.sigma0=0.3", f"run.out={out}"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "essa.h5"))
    assert run.group("essa")["fitness"].shape == (2, 4)
    ids, tok, answers = plain_peft_completions(toy_chat, out / "adapter-mean")
    assert accuracy_of(ids, tok, answers) == run.group("eval")["accuracy"][-1]


def test_fgrpo_in_chat_format(toy_chat, chat_sft, tmp_path):
    out = tmp_path / "fgrpo"
    proc = run_mpi(2, ["-m", "fgrpo", *CHAT, f"lora.adapter={chat_sft / 'adapter'}",
                       "fgrpo.steps=2", "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=4",
                       f"run.out={out}"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    ids, tok, answers = plain_peft_completions(toy_chat, out / "adapter")
    assert accuracy_of(ids, tok, answers) == run.group("eval")["accuracy"][-1]
