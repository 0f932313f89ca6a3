"""The containers every task fills: a :class:`Split` of prompts, gold answers and SFT
solutions, and a :class:`Task` (two splits and a reward function); a :class:`ScoredTask`
rewards by a scorer that reads the prompt (a reward model: :mod:`hpc.data.reward_model`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Split:
    """One split of a task. All lists have the same length (one entry per problem)."""

    prompts: list  # model inputs, template already applied
    answers: list  # gold final answers, as strings
    solutions: list  # SFT targets: the text a model should write after the prompt
    questions: list = field(default_factory=list)  # the bare questions (prompt formats)

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, indices) -> "Split":
        indices = list(indices)
        return Split([self.prompts[i] for i in indices], [self.answers[i] for i in indices],
                     [self.solutions[i] for i in indices],
                     [self.questions[i] for i in indices] if self.questions else [])


@dataclass
class Task:
    name: str
    train: Split
    eval: Split
    reward_fn: Callable[[str, str], float]  # (completion, gold answer) -> reward in [0, 1]
    chat: bool = False  # prompts are chat-templated (SFT ends targets with the end-of-turn)

    def rewards(self, completions: list, answers: list) -> list:
        """Reward of each completion against its gold answer (floats in [0, 1])."""
        return [float(self.reward_fn(c, a)) for c, a in zip(completions, answers)]


@dataclass
class ScoredTask(Task):
    """A task rewarded by ``scorer(prompts, completions) -> rewards`` (a reward model's
    scores, unbounded floats) instead of ``reward_fn``. Each split's ``answers`` hold the
    prompt the scorer reads for its problem: every caller of :meth:`rewards` passes a split's
    answers beside the completions of that split's prompts, and ESSA's reward cache keys on
    (completion, answer)."""

    scorer: Callable[[list, list], list] | None = None

    def rewards(self, completions: list, answers: list) -> list:
        """The scorer's reward of each completion of its prompt (``answers``)."""
        return [float(r) for r in self.scorer(answers, completions)]
