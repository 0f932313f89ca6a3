"""The built-in chat toy model (``model.path=toy-chat``): a small Qwen2 with a byte-level BPE
tokenizer, Qwen-style special tokens and chat template, half-taught the ``wordprob`` task.

It looks like a real model folder at toy size: ``AutoTokenizer`` and ``AutoModelForCausalLM``
load it, prompts go through its chat template (``<|im_start|>role\\n...<|im_end|>\\n``),
completions end at ``<|im_end|>`` (the end-of-turn; the tokenizer's EOS is ``<|endoftext|>``,
as in Qwen2.5 base models), digits are single tokens, and worked solutions run from about 15
to over 100 tokens.

Built once and cached in ``$HPC_CACHE/toy-chat-v2`` (default ``<repo>/.cache/toy-chat-v2``);
``toy_info.json`` records the version, steps, accuracy, weights hash and seconds (README: what
the build took here; :mod:`hpc.toys.cache`).
The tokenizer is trained on GSM8K text: the file named by ``$HPC_TOKENIZER_CORPUS``, default
``<repo>/../shared/data/gsm8k/train.jsonl`` (the repo never copies data).

Training: chat-format ``wordprob`` problems from the seed ``DATA_SEED`` stream, excluding the
first ``N_RESERVED`` problems of the seed-0 stream (the task's held-out split for
``task.seed=0``); loss on the assistant turn and its ``<|im_end|>``. Reserved problems
0..255 are the reported held-out set, 512..575 the probe, logged every ``PROBE_EVERY`` steps.
Training is ``STEPS`` seeded optimizer steps, few enough that the model stays far from
perfect; neither the clock nor the probe ends it early.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hpc.data.prompts import chat_messages, completion_batch
from hpc.data.rewards import math_reward
from hpc.data.wordproblems import MAX_STEPS as MAX_PROBLEM_STEPS, word_problems
from hpc.engine.generate import generate
from hpc.runtime.errors import UserError, user_errors_exit
from hpc.toys import TOY_CHAT_VERSION
from hpc.toys.cache import (build_into, cached_folder, check_built, read_info,
                            save_model_folder, train_steps)
from hpc.toys.pinned import kernels_pinned, pinned_description, train_pinned

VERSION = TOY_CHAT_VERSION
REBUILD = "hpc-toy-chat --rebuild"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VOCAB_SIZE = 2048
# Qwen2's pre-tokenizer split: words, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CORPUS_ENV = "HPC_TOKENIZER_CORPUS"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CORPUS = os.path.join(os.path.dirname(_REPO), "shared", "data", "gsm8k", "train.jsonl")

DATA_SEED = 1234
N_RESERVED = 1024
N_TRAIN = 20000
STEPS = 349  # optimizer steps of a build (the step cap of the earlier, probe-stopped builds)
BATCH = 16
LR = 3e-3
PROBE_EVERY = 100
MAX_NEW_TOKENS = 144
WAIT_S = 4 * 3600.0  # how long a local rank > 0 waits for local rank 0's build


def corpus_path() -> str:
    return os.environ.get(CORPUS_ENV) or DEFAULT_CORPUS


def gsm8k_text(path: str) -> list[str]:
    """Question and answer texts of a GSM8K jsonl file (UserError naming the file if absent)."""
    if not os.path.isfile(path):
        raise UserError(f"tokenizer corpus not found: {path} (set ${CORPUS_ENV} to a GSM8K "
                        f"train.jsonl to build the toy-chat model)")
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [text for row in rows for text in (row.get("question", ""), row.get("answer", ""))]


def build_chat_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (``VOCAB_SIZE`` ids) trained on ``texts``, with Qwen's special tokens
    (``<|endoftext|>`` 0 = EOS and pad, ``<|im_start|>`` 1, ``<|im_end|>`` 2), Qwen2's
    pre-tokenizer and the chat template; pads on the left."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[ENDOFTEXT, IM_START,
                                                                        IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=ENDOFTEXT,
                                   pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START, IM_END],
                                   chat_template=CHAT_TEMPLATE, padding_side="left")


def chat_qwen2_config(tokenizer) -> Qwen2Config:
    """A small Qwen2 (about 0.4M parameters, tied embeddings, 512 positions)."""
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                       max_position_embeddings=512, tie_word_embeddings=True,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=None)


def cache_dir() -> str:
    """``$HPC_CACHE/<VERSION>`` or ``<repo>/.cache/<VERSION>``."""
    return os.path.join(os.environ.get("HPC_CACHE") or os.path.join(_REPO, ".cache"), VERSION)


def _prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(chat_messages(question), tokenize=False,
                                         add_generation_prompt=True)


def greedy_accuracy(model, tokenizer, problems) -> float:
    """Fraction of ``(question, answer, solution)`` problems whose greedy chat completion
    scores 1 with :func:`math_reward`."""
    outs = generate(model, tokenizer, [_prompt(tokenizer, q) for q, _, _ in problems],
                    MAX_NEW_TOKENS, batch_size=64)
    return sum(math_reward(o, a) for o, (_, a, _) in zip(outs, problems)) / len(problems)


def train_toy_chat(out_dir: str, steps: int = STEPS, log=print) -> dict:
    """Train the tokenizer and the model (``steps`` optimizer steps) and save both (and
    ``toy_info.json``) in ``out_dir``. The same weights bitwise for a fixed torch build, CPU
    model and ``steps``, however long the steps take (the clock is only reported)."""
    start, threads = time.monotonic(), torch.get_num_threads()
    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar
    try:
        tokenizer = build_chat_tokenizer(gsm8k_text(corpus_path()))
        reserved = word_problems(N_RESERVED, seed=0)
        heldout, probe = reserved[:256], reserved[512:576]
        train = word_problems(N_TRAIN, DATA_SEED, skip={q for q, _, _ in reserved})
        prompts = [_prompt(tokenizer, q) for q, _, _ in train]
        by_steps = [[i for i, (_, _, s) in enumerate(train) if s.count("\n") == k + 1]
                    for k in range(MAX_PROBLEM_STEPS + 1)]  # batches of one length: no padding
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(DATA_SEED)
            model = Qwen2ForCausalLM(chat_qwen2_config(tokenizer))
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
            order = torch.Generator().manual_seed(DATA_SEED)

            def train_step() -> float:
                model.train()
                bucket = by_steps[int(torch.randint(len(by_steps), (1,), generator=order))]
                idx = [bucket[i] for i in torch.randint(len(bucket), (BATCH,), generator=order)]
                ids, mask, labels = completion_batch(
                    tokenizer, [prompts[i] for i in idx], [train[i][2] for i in idx], "cpu",
                    chat=True)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                schedule.step()
                return loss.item()

            _, probe_acc = train_steps(
                train_step, lambda: greedy_accuracy(model, tokenizer, probe), steps, PROBE_EVERY,
                lambda msg: log(f"toy-chat {msg} ({time.monotonic() - start:.0f} s)"))
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        info = {"version": VERSION, "parameters": sum(p.numel() for p in model.parameters()),
                "vocab_size": len(tokenizer), "steps": steps, "batch": BATCH, "lr": LR,
                "probe_accuracy": probe_acc,
                "heldout_accuracy": greedy_accuracy(model, tokenizer, heldout),
                "heldout": "wordprob, seed 0, first 256 problems, chat format, greedy",
                "tokenizer_corpus": os.path.basename(corpus_path()), "seed": DATA_SEED,
                "kernels": pinned_description() if kernels_pinned() else "native",
                "build_seconds": round(time.monotonic() - start, 1)}
        save_model_folder(out_dir, model, tokenizer, info)
        return info
    finally:
        torch.set_num_threads(threads)


def build_toy_chat(final: str, steps: int = STEPS, log=print) -> None:
    """Train the chat toy into ``final`` under the pinned kernels (the same bytes on every
    x86-64 CPU: :mod:`hpc.toys.pinned`); the corpus is checked here first (one line)."""
    gsm8k_text(corpus_path())
    build_into(final, lambda tmp: train_pinned("hpc.toys.toy_chat:train_toy_chat", tmp, steps,
                                               log))


def toy_chat_model_path(wait_s: float = WAIT_S, log=print) -> str:
    """Folder of the cached chat toy model, building it (several CPU minutes) if absent;
    UserError (one line: rebuild with ``hpc-toy-chat --rebuild``) if the cached one is not the
    intended build."""
    final = cached_folder(cache_dir(), lambda final: build_toy_chat(final, STEPS, log),
                          "the toy-chat model", wait_s, log)
    check_built(final, {"version": VERSION, "steps": STEPS}, REBUILD)
    return final


@user_errors_exit
def show(rebuild: bool = False) -> None:
    """``hpc-toy-chat``: build the model if needed (or anew with ``rebuild``); print its folder
    and held-out accuracy."""
    if rebuild:
        shutil.rmtree(cache_dir(), ignore_errors=True)
    path = toy_chat_model_path()
    info = read_info(path)
    print(f"{path}\nheld-out greedy accuracy {info['heldout_accuracy']:.3f} "
          f"({info['parameters']} parameters, vocab {info['vocab_size']}, {info['steps']} "
          f"steps, built in {info['build_seconds']} s)")


if __name__ == "__main__":
    from hpc.toys.commands import toy_chat

    toy_chat()
