"""The accuracy cost of ``model.quantize=int8`` on the toy models, measured.

    python benchmarks/quantization.py [--models toy toy-chat] [--n-eval 256 64]
        [--population 16] [--minibatch 64 32] [--sigma 0.3] [--members-per-pass 4]

For each built-in model (``toy``: arith, plain prompts, 8 new tokens; ``toy-chat``: wordprob,
chat prompts, 144 new tokens; each as its demo config) and its own unquantised twin:

* **greedy held-out accuracy** of the base model on ``--n-eval`` held-out problems, fp32 and
  with torchao INT8 weight-only base linears (:func:`hpc.models.quantize.quantize_base`), and
  the **agreement**: the share of problems whose greedy completion (token ids) is identical;
* **ESSA's fitness ranking**: a fixed population (``--population`` members drawn as ESSA's
  first generation: offsets ``sigma * N(0, 1) * s`` to the singular values s of a rank-8 LoRA on
  q/k/v/o whose B is random, seed 0) scored by ESSA's own ``score_members`` on ``--minibatch``
  training problems, fp32 and INT8; prints the Spearman correlation of member fitness, the mean
  absolute fitness difference and whether both pick the same best member.

Decoding uses the package's engine (``model.engine=engine``), as ESSA and evaluation do.
"""
from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
from scipy.stats import spearmanr

from common import LORA_ALPHA, LORA_RANK, TARGETS, machine

from essa.population import ScoringRequest, score_members  # common.py put the repo on sys.path
from hpc.engine.engine_backend import EngineBackend
from hpc.data.tasks import load_task
from hpc.models.adapter_space import SingularValueSpace
from hpc.engine.generate import generate_tokens
from hpc.models.loading import attach_lora, load_model, randomize_lora_b
from hpc.models.quantize import quantize_base
from hpc.data.config import TaskConfig
from hpc.runtime.timing import PhaseTimer
from hpc.toys.builtin import model_folder

# model: (task, prompt format, new tokens), as configs/demo and configs/demo-chat
TASKS = {"toy": ("arith", "plain", 8), "toy-chat": ("wordprob", "chat", 144)}
BATCH = 64  # eval.batch_size and model.decode_batch default
ADAPTER_STD = 0.02  # LoRA B entries: a small random adapter, as after a short SFT


def greedy(model, tok, task, split, max_new: int) -> tuple:
    """(token ids per problem, accuracy) of greedy completions of ``split``."""
    ids = generate_tokens(model, tok, split.prompts, max_new, batch_size=BATCH)
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    return ids, float(np.mean(task.rewards(texts, split.answers)))


def population(space, size: int, sigma: float) -> np.ndarray:
    """(size, dim) offsets: ESSA's first generation with sigma_scale=relative, seed 0."""
    sv = space.singular_values()
    stds = np.maximum(sv, 1e-3 * sv.max())
    return sigma * np.random.default_rng(0).standard_normal((size, space.dim)) * stds


def fitness(model, tok, space, members, task, n: int, max_new: int, k: int) -> np.ndarray:
    timer = PhaseTimer(["rebuild", "generate", "reward"])
    request = ScoringRequest(members, task.train.prompts[:n], task.train.answers[:n], max_new,
                             BATCH, k)
    return score_members(model, tok, space, task, request, decoder=EngineBackend(), timer=timer)


def compare(name: str, n_eval: int, minibatch: int, args) -> None:
    """Print the two comparisons (module docstring) for built-in model ``name``."""
    task_name, prompt_format, max_new = TASKS[name]
    folder = model_folder(name)
    task = load_task(TaskConfig(name=task_name, prompt_format=prompt_format, n_train=minibatch,
                                n_eval=n_eval, max_new_tokens=max_new), folder)
    model, tok = load_model(folder, "float32", "cpu")
    quantised = quantize_base(copy.deepcopy(model), "int8")
    start = time.perf_counter()
    ids, acc = greedy(model, tok, task, task.eval, max_new)
    ids_q, acc_q = greedy(quantised, tok, task, task.eval, max_new)
    agree = np.mean([a == b for a, b in zip(ids, ids_q)])
    print(f"\n{name} ({task_name}, {prompt_format} prompts, {max_new} new tokens), "
          f"{len(task.eval)} held-out problems, greedy:")
    print(f"  accuracy fp32 {acc:.1%}, int8 {acc_q:.1%} (difference {acc_q - acc:+.1%}); "
          f"identical completions {agree:.1%}")
    peft = attach_lora(model, LORA_RANK, LORA_ALPHA, TARGETS)
    randomize_lora_b(peft, ADAPTER_STD, torch.Generator().manual_seed(0))
    peft_q = quantize_base(copy.deepcopy(peft), "int8")
    space = SingularValueSpace.from_peft(peft)
    members = population(space, args.population, args.sigma)
    f = fitness(peft, tok, space, members, task, minibatch, max_new, args.members_per_pass)
    f_q = fitness(peft_q, tok, space, members, task, minibatch, max_new,
                  args.members_per_pass)
    rho = spearmanr(f, f_q).statistic
    print(f"  ESSA fitness of {len(members)} members (sigma {args.sigma}, relative) on "
          f"{minibatch} training problems: Spearman {rho:.3f}, mean |fp32 - int8| "
          f"{np.abs(f - f_q).mean():.4f}, fitness spread (std) fp32 {f.std():.4f}; best "
          f"member fp32 #{int(f.argmax())}, int8 #{int(f_q.argmax())}")
    print(f"  ({time.perf_counter() - start:.0f} s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--n-eval", type=int, nargs="+", default=[256, 64],
                        help="held-out problems per model (in --models order)")
    parser.add_argument("--minibatch", type=int, nargs="+", default=[64, 32],
                        help="training problems per member (in --models order)")
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=0.3, help="essa.sigma0 (relative)")
    parser.add_argument("--members-per-pass", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print("fp32 vs torchao INT8 weight-only decoder linears (model.quantize=int8), engine path")
    for i, name in enumerate(args.models):
        compare(name, args.n_eval[min(i, len(args.n_eval) - 1)],
                args.minibatch[min(i, len(args.minibatch) - 1)], args)


if __name__ == "__main__":
    main()
