"""Tasks: prompts, gold answers, SFT solutions, a prompt template and a reward function.

:func:`load_task` builds a job's task with the loader :data:`hpc.data.registry.TASKS` names for
``task.name``. ``arith`` and ``wordprob`` are generated here (no files; arith is the demo
task); ``gsm8k``, ``math``, ``aime``, ``amc``, the short-answer sets ``deepscaler``, ``minerva``
and ``olympiadbench``, and ``ifeval`` (IFEval's instructions, :mod:`hpc.data.ifeval`) read
jsonl files (:mod:`hpc.data.mathdata`, written by ``hpc-data prepare``). Rewards live in
:mod:`hpc.data.rewards` and :mod:`hpc.data.ifeval`, the :class:`Split` and :class:`Task`
containers in :mod:`hpc.data.split`. Torch-free until :func:`load_task` renders prompts.
"""
from __future__ import annotations

import random

from hpc.data.registry import task_loader
from hpc.data.rewards import math_reward, numeric_reward
from hpc.data.split import Split, Task
from hpc.data.wordproblems import WORDPROB_TEMPLATE, word_problems
from hpc.runtime.errors import UserError

ARITH_TEMPLATE = "{question}="


def _arith_problem(rng: random.Random, digits: int, ops: str):
    low = 10 ** (digits - 1) if digits > 1 else 0
    high = 10 ** digits - 1
    a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}", str(value)


def arith_task(n_train: int, n_eval: int, digits: int = 2, ops: str = "+", seed: int = 0) -> Task:
    """Procedural arithmetic: prompt ``'47+38='``, answer ``'85'``; eval disjoint from train.

    Difficulty knobs: ``digits`` per operand and the operator set ``ops`` (from ``+-*``).
    """
    if not ops or any(op not in "+-*" for op in ops):
        raise UserError(f"config key 'task.ops': {ops!r} must use only the operators + - *")
    rng = random.Random(seed)
    n_possible = len(set(ops)) * (10 ** digits - (10 ** (digits - 1) if digits > 1 else 0)) ** 2
    if n_train + n_eval > n_possible // 2:
        raise UserError(f"arith with {digits} digits and ops {ops!r} has only {n_possible} "
                        f"problems; ask for at most {n_possible // 2} (task.n_train + n_eval)")
    seen, problems = set(), []
    while len(problems) < n_eval + n_train:
        question, answer = _arith_problem(rng, digits, ops)
        if question not in seen:
            seen.add(question)
            problems.append((question, answer))

    def split(items):
        return Split([ARITH_TEMPLATE.format(question=q) for q, _ in items],
                     [a for _, a in items], [a for _, a in items], [q for q, _ in items])

    return Task("arith", train=split(problems[n_eval:]), eval=split(problems[:n_eval]),
                reward_fn=numeric_reward)


def wordprob_task(n_train: int, n_eval: int, seed: int = 0) -> Task:
    """Generated multi-step word problems (:mod:`hpc.data.wordproblems`), graded by
    :func:`hpc.data.rewards.math_reward`; eval disjoint from train."""
    problems = word_problems(n_eval + n_train, seed)

    def split(items):
        return Split([WORDPROB_TEMPLATE.format(question=q) for q, _, _ in items],
                     [a for _, a, _ in items], [" " + s for _, _, s in items],
                     [q for q, _, _ in items])

    return Task("wordprob", train=split(problems[n_eval:]), eval=split(problems[:n_eval]),
                reward_fn=math_reward)


def load_arith(cfg) -> Task:
    """Task ``arith`` of the ``task`` section ``cfg`` (its loader in the registry)."""
    return arith_task(cfg.n_train, cfg.n_eval, cfg.digits, cfg.ops, cfg.seed)


def load_wordprob(cfg) -> Task:
    """Task ``wordprob`` of the ``task`` section ``cfg`` (its loader in the registry)."""
    return wordprob_task(cfg.n_train, cfg.n_eval, cfg.seed)


def sft_split_indices(n: int, sft_split: float, seed: int) -> tuple[list, list]:
    """``(sft, rest)``: the indices of ``n`` training problems that ``task.sft_split`` holds
    apart for SFT and the others, disjoint, each in ascending order. The held-apart ones are
    the first of a permutation drawn from ``seed`` alone (the same on every rank and any rank
    count); a value below 1 is a fraction of ``n`` (rounded), else a whole count. 0: no
    split, both are every index. UserError for a count that is not whole or that leaves
    either part empty."""
    if sft_split == 0:
        return list(range(n)), list(range(n))
    if sft_split >= 1 and sft_split != int(sft_split):
        raise UserError(f"config key 'task.sft_split': {sft_split:g} is neither a whole count "
                        f"nor a fraction below 1")
    count = round(sft_split * n) if sft_split < 1 else int(sft_split)
    if not 0 < count < n:
        raise UserError(f"config key 'task.sft_split': {sft_split:g} holds apart {count} of the "
                        f"{n} training problems; both SFT and the rest need at least one")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[:count]), sorted(order[count:])


def load_task(cfg, model_path: str = "", part: str = "rest") -> Task:
    """Build the task described by a :class:`hpc.data.config.TaskConfig` with its prompts in
    ``cfg.prompt_format`` (chat formats read the tokenizer of ``model_path``, the job's
    ``model.path``). With ``task.sft_split`` set, ``part`` picks its training problems:
    ``"held"`` the held-apart ones (the warm start's, SFT), ``"rest"`` the others (ESSA,
    F-GRPO). UserError if unusable."""
    from hpc.data.prompts import apply_prompt_format  # torch: only when a job loads its task

    task = task_loader(cfg.name)(cfg)
    if cfg.sft_split:
        held, rest = sft_split_indices(len(task.train), cfg.sft_split, cfg.seed)
        task.train = task.train.subset(held if part == "held" else rest)
    return apply_prompt_format(task, cfg, model_path)


def job_task(cfg, device) -> Task:
    """The task a training or evaluation job of config ``cfg`` runs on: :func:`load_task` of
    its ``task`` section in its model's prompt format, scored by ``reward.model`` where one is
    set (:func:`hpc.data.reward_model.with_reward_model`, loaded on ``device``)."""
    from hpc.data.reward_model import with_reward_model  # torch: only when a job loads its task

    return with_reward_model(load_task(cfg.task, cfg.model.path), cfg.reward, cfg.model.dtype,
                             device)
