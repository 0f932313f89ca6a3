"""The ``task`` and ``reward`` config sections: the problems a job trains and evaluates on, how
they are prompted, and what scores a completion (the task's own check or a reward model).
Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from hpc.data.registry import TASKS
from hpc.runtime.config import param


@dataclass
class TaskConfig:
    name: str = param("arith", "task", choices=TASKS)
    prompt_format: str = param("plain", "plain: the task's text template; chat: the model's "
                               "chat template; presets: qwen25-math-cot (chat + Qwen2.5-Math "
                               "system prompt), gsm8k-plain, math-plain",
                               choices=["plain", "chat", "qwen25-math-cot", "gsm8k-plain",
                                        "math-plain"])
    system_prompt: str = param("", "chat formats: system message ('' = the format's own, "
                               "none for chat)")
    train_path: str = param("", "training jsonl (file tasks)")
    eval_path: str = param("", "held-out jsonl (file tasks)")
    n_train: int = param(2000, "training prompts (arith: generated; files: first n, 0 = all)",
                         min=0, max=10_000_000)
    n_eval: int = param(256, "held-out prompts (0 = all)", min=0, max=10_000_000)
    digits: int = param(2, "arith: digits per operand", min=1, max=9)
    ops: str = param("+", "arith: operators to draw from, e.g. '+-*'")
    seed: int = param(0, "data seed (arith generation, shuffling)", min=0, max=2**32 - 1)
    sft_split: float = param(0.0, "a warm start's own data: this many training prompts (a "
                             "whole count, or a fraction of them if below 1) are held apart, "
                             "drawn with task.seed: the SFT stage trains only on them, ESSA "
                             "and F-GRPO only on the rest (0 = off: every method trains on "
                             "all)",
                             min=0.0, max=10_000_000.0)
    max_new_tokens: int = param(8, "generated tokens per completion", min=1, max=32768)
    ifeval_check: str = param("strict", "ifeval: IFEval's test the reward uses, the share of a "
                              "prompt's instructions followed: strict (the completion as it "
                              "is) or loose (also with its first or last line or its '*' "
                              "removed)", choices=["strict", "loose"])


@dataclass
class RewardModelConfig:
    model: str = param("", "a sequence-classification reward model (a folder, or a Hub id in "
                       "the local Hugging Face cache) whose score of (prompt, completion) is "
                       "the reward in place of the task's own check ('' = the task's)")
    head: str = param("score", "which output is the reward: 'score' (the model's one logit, "
                      "or ArmoRM's preference score) or 'objective:<i>' (ArmoRM's i-th "
                      "objective reward)")
    batch_size: int = param(8, "completions scored in one forward on each rank", min=1,
                            max=65536)
    max_tokens: int = param(2048, "longest prompt + completion the reward model reads "
                            "(tokens; longer ones keep their end)", min=8, max=1_000_000)
    trust_remote_code: bool = param(False, "run the reward model folder's own modelling code "
                                    "(ArmoRM's); off: such a model is refused in one line")
