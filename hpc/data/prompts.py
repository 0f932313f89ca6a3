"""Prompt formats (``task.prompt_format``) and the SFT batch that masks a prompt of any format.

* ``plain``: the task's own text template (arith ``{question}=``, GSM8K ``Question: ...``,
  MATH ``Problem: ... Solution:``, wordprob ``Question: ... Answer:``).
* ``chat``: the tokenizer's own chat template; ``task.system_prompt`` (if set) as the system
  message, the question as the user message, and the generation prompt added.
* presets: ``qwen25-math-cot`` (chat with Qwen2.5-Math's system prompt), ``gsm8k-plain`` and
  ``math-plain`` (the GSM8K and MATH text templates, whatever the task).

In chat formats the SFT target is the solution (stripped) followed by the template's end-of-turn
token (``<|im_end|>``), which also ends generation (:func:`hpc.models.chat.stop_token_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc.data.mathdata import GSM8K_TEMPLATE, MATH_TEMPLATE
from hpc.models.chat import chat_tokenizer, end_of_turn_id

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptFormat:
    chat: bool
    system: str = ""  # chat: system message ('' = none)
    template: str = ""  # plain: text template with {question} ('' = the task's own)


PROMPT_FORMATS = {
    "plain": PromptFormat(chat=False),
    "chat": PromptFormat(chat=True),
    "qwen25-math-cot": PromptFormat(chat=True, system=QWEN_MATH_SYSTEM),
    "gsm8k-plain": PromptFormat(chat=False, template=GSM8K_TEMPLATE),
    "math-plain": PromptFormat(chat=False, template=MATH_TEMPLATE),
}


def chat_messages(question: str, system: str = "") -> list[dict]:
    """The conversation a chat prompt renders: optional system message, then the question."""
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]


def apply_prompt_format(task, task_cfg, model_path: str):
    """Re-render ``task``'s prompts (both splits) in ``task_cfg.prompt_format`` and return it.

    Chat formats load the tokenizer of ``model_path`` (UserError, exit 2, if it has no chat
    template) and strip the solutions' leading space (the assistant turn starts fresh).
    ``task_cfg.system_prompt``, when set, replaces the format's system message.
    """
    fmt = PROMPT_FORMATS[task_cfg.prompt_format]
    if fmt == PROMPT_FORMATS["plain"]:
        return task
    if fmt.chat:
        tokenizer = chat_tokenizer(model_path, task_cfg.prompt_format)
        system = task_cfg.system_prompt or fmt.system

        def render(question):
            return tokenizer.apply_chat_template(chat_messages(question, system), tokenize=False,
                                                 add_generation_prompt=True)
    else:
        def render(question):
            return fmt.template.format(question=question)
    for split in (task.train, task.eval):
        split.prompts = [render(q) for q in split.questions]
        if fmt.chat:
            split.solutions = [s.strip() for s in split.solutions]
    task.chat = fmt.chat
    return task


def completion_batch(tokenizer, prompts: list, completions: list, device, chat: bool = False):
    """Right-padded ``prompt + completion + end`` token ids with prompt-masked labels.

    ``end`` is the chat template's end-of-turn token when ``chat`` (the EOS if the template has
    none), else the EOS. Prompts are tokenised as they are (their special tokens included) and
    masked whole. Returns input_ids (B, T) int64, attention_mask (B, T) int64 and labels
    (B, T) int64 with -100 on prompt and padding positions.
    """
    end = (end_of_turn_id(tokenizer) if chat else None)
    end = tokenizer.eos_token_id if end is None else end
    rows, labels = [], []
    for prompt, completion in zip(prompts, completions):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [end]
        rows.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(l)] = torch.tensor(l)
    return ids.to(device), mask.to(device), lab.to(device)
