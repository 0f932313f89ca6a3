"""``wordprob``: generated multi-step word problems with worked solutions ending in ``\\boxed{}``.

A problem starts a person with 2-12 things and applies 0 to ``MAX_STEPS`` gains and losses of
1 to ``MAX_CHANGE`` (the running count stays in 0..``MAX_COUNT``)::

    Question: Anna has 7 apples. Anna buys 3 more apples. Anna gives 2 apples to Ben.
              How many apples does Anna have now?
    Solution: Anna starts with 7 apples.
              Anna buys 3 more apples: 7 + 3 = 10.
              Anna gives 2 apples to Ben: 10 - 2 = 8.
              The answer is \\boxed{8}.

Solutions grow by one line per step: about 15 tokens for 0 steps to over 100 for 5 (with the
toy chat model's tokenizer). Graded by :func:`hpc.data.rewards.math_reward`. Problems are
drawn from ``random.Random(seed)``; the held-out split is the first ``n_eval`` distinct
questions of the stream, the train split the next ``n_train`` distinct ones.
"""
from __future__ import annotations

import random

WORDPROB_TEMPLATE = "Question: {question}\nAnswer:"
MAX_STEPS = 5
MAX_COUNT = 20
MAX_CHANGE = 4
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "James",
         "Kate", "Leo", "Maya", "Nina", "Omar", "Paul"]
THINGS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "shells",
          "cards", "eggs"]
GAINS = ["buys {n} more {thing}", "finds {n} more {thing}", "gets {n} {thing} from {other}"]
LOSSES = ["gives {n} {thing} to {other}", "loses {n} {thing}", "sells {n} {thing}"]


def word_problem(rng: random.Random, steps: int | None = None) -> tuple[str, str, str]:
    """One ``(question, gold answer, worked solution)``; ``steps`` drawn from 0..MAX_STEPS if
    None. The solution has no leading space (callers add what their prompt format needs)."""
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    steps = rng.randint(0, MAX_STEPS) if steps is None else steps
    count = rng.randint(2, 12)
    asked = [f"{name} has {count} {thing}."]
    worked = [f"{name} starts with {count} {thing}."]
    for _ in range(steps):
        gain = count <= 1 or (count + 1 <= MAX_COUNT and rng.random() < 0.5)
        n = rng.randint(1, min(MAX_CHANGE, MAX_COUNT - count) if gain else min(MAX_CHANGE, count))
        action = rng.choice(GAINS if gain else LOSSES).format(n=n, thing=thing, other=other)
        new = count + n if gain else count - n
        asked.append(f"{name} {action}.")
        worked.append(f"{name} {action}: {count} {'+' if gain else '-'} {n} = {new}.")
        count = new
    asked.append(f"How many {thing} does {name} have now?")
    worked.append(f"The answer is \\boxed{{{count}}}.")
    return " ".join(asked), str(count), "\n".join(worked)


def word_problems(n: int, seed: int, skip: set | None = None) -> list[tuple[str, str, str]]:
    """The first ``n`` distinct problems of the stream ``seed`` whose question is not in
    ``skip``."""
    rng, seen, out = random.Random(seed), set(skip or ()), []
    while len(out) < n:
        question, answer, solution = word_problem(rng)
        if question not in seen:
            seen.add(question)
            out.append((question, answer, solution))
    return out
