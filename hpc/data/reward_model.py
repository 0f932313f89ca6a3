"""A reward model's score as the reward (``reward.*``): a sequence-classification model, loaded
once per rank on the job's device in ``model.dtype``, reads each (prompt, completion) and its
head gives the reward (ESSA's fitness, F-GRPO's rewards, the held-out evaluation).

The text it reads: with a chat template of its own, ``[user: prompt, assistant: completion]``
rendered by it; else ``prompt + completion`` with the tokenizer's special tokens. Rows of
``reward.batch_size`` are right-padded (positions as in a row alone) and keep their last
``reward.max_tokens`` tokens. Heads (``reward.head``): ``score``: the output's ``.score``
(ArmoRM's preference score) where it has one, else ``.logits[:, 0]`` of a one-label model;
``objective:<i>``: ``.rewards[:, i]`` (ArmoRM's i-th objective). A head the model does not give
is refused in one line after a one-row probe, before any scoring; the folder's own checks
(:func:`hpc.plan.terms.reward_model_folder`) come before the load.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hpc.data.split import ScoredTask, Split
from hpc.models.loading import DTYPES
from hpc.plan.terms import REWARD_HEADS, reward_head, reward_model_folder
from hpc.runtime.errors import UserError, first_line


class RewardModel:
    """``score(prompts, completions) -> rewards`` of a loaded sequence-classification model and
    its tokenizer; ``index``: :func:`hpc.plan.terms.reward_head`'s (None: ``score``)."""

    def __init__(self, model, tokenizer, index: int | None, batch_size: int, max_tokens: int,
                 name: str):
        self.model, self.tok, self.index, self.name = model, tokenizer, index, name
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        self.score(["probe"], ["probe"])  # refuses a head the model does not give

    def texts(self, prompts: list, completions: list) -> list:
        """The text the model reads for each (prompt, completion) (module docstring)."""
        if not self.chat:
            return [p + c for p, c in zip(prompts, completions)]
        return [self.tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
            tokenize=False) for p, c in zip(prompts, completions)]

    def head(self, out) -> torch.Tensor:
        """The rewards (B,) in ``out`` (the model's output for B rows) under ``reward.head``;
        UserError naming what the model gives when it has no such head."""
        if self.index is None:
            score = getattr(out, "score", None)
            if score is not None:
                return score.reshape(len(score), -1)[:, 0]
            logits = getattr(out, "logits", None)
            if logits is not None and logits.shape[-1] == 1:
                return logits[:, 0]
            labels = "no .logits" if logits is None else f"{logits.shape[-1]} labels"
            raise UserError(f"reward.head=score: the reward model {self.name} gives {labels} "
                            f"and no .score; supported: {REWARD_HEADS}")
        rewards = getattr(out, "rewards", None)
        if rewards is None:
            raise UserError(f"reward.head=objective:{self.index}: the reward model {self.name} "
                            f"gives no .rewards (ArmoRM's objectives); supported: {REWARD_HEADS}")
        if self.index >= rewards.shape[-1]:
            raise UserError(f"reward.head=objective:{self.index}: the reward model {self.name} "
                            f"has {rewards.shape[-1]} objectives (objective:0 to "
                            f"objective:{rewards.shape[-1] - 1})")
        return rewards[:, self.index]

    @torch.no_grad()
    def score(self, prompts: list, completions: list) -> list:
        """The reward of each completion of its prompt (floats), ``batch_size`` rows a
        forward."""
        texts, out = self.texts(prompts, completions), []
        device = next(self.model.parameters()).device
        for first in range(0, len(texts), self.batch_size):
            batch = self.tok(texts[first:first + self.batch_size], padding=True,
                             truncation=True, max_length=self.max_tokens,
                             add_special_tokens=not self.chat, return_tensors="pt").to(device)
            result = self.model(input_ids=batch["input_ids"],
                                attention_mask=batch["attention_mask"])
            out += self.head(result).float().cpu().tolist()
        return out


def load_reward_model(reward, dtype: str, device) -> RewardModel:
    """The :class:`RewardModel` of the ``reward`` section, in ``dtype`` on ``device``."""
    folder, _ = reward_model_folder(reward)
    trust = reward.trust_remote_code
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=trust)
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=DTYPES[dtype], local_files_only=True, trust_remote_code=trust)
    except Exception as err:  # noqa: BLE001 - any loader failure is a bad reward model folder
        raise UserError(f"cannot load the reward model in {folder}: {first_line(err)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    if model.config.pad_token_id is None:  # the row's last token is found by its padding
        model.config.pad_token_id = tok.pad_token_id
    return RewardModel(model.to(device).eval(), tok, reward_head(reward.head), reward.batch_size,
                       reward.max_tokens, folder)


def reward_prompts(split: Split, chat: bool) -> list:
    """What the reward model reads as the prompt of each problem of ``split``: the question
    where the prompts are chat-templated for the policy (``chat``), else the prompt itself."""
    return list(split.questions) if chat and split.questions else list(split.prompts)


def with_reward_model(task, reward, dtype: str, device):
    """``task`` itself without ``reward.model``; else a :class:`ScoredTask` whose rewards are
    the reward model's scores and whose splits' answers are :func:`reward_prompts`."""
    if not reward.model:
        return task
    scorer = load_reward_model(reward, dtype, device)

    def scored(split: Split) -> Split:
        return Split(split.prompts, reward_prompts(split, task.chat), split.solutions,
                     split.questions)

    return ScoredTask(task.name, scored(task.train), scored(task.eval), None, task.chat,
                      scorer=scorer.score)
