"""Held-out evaluation: greedy accuracy, pass@k (unbiased estimator) and avg@n, over ranks.

Each rank answers its contiguous share of the problems; sample j of problem i is drawn with the
key (run seed, i, j) (:mod:`hpc.models.sampling`), so pass@k does not depend on the number of
ranks. The samples are decoded ``eval.sample_chunk`` per prompt at a time (0: all
``eval.n_samples`` at once; ``eval.batch_size`` prompts decode together); each chunk is graded
at once and only the per-problem counts of correct samples and reward sums are kept, so pass@k
at n = 1024 samples of long completions holds one chunk's completions at a time, and gives the
same numbers for any chunk size (sample j keeps its key in whichever chunk it falls).
Per-problem results cross the network once (Allgatherv, tag ``eval``). Also the ``hpc-eval``
command (``python -m hpc.evaluate``). A sample is correct when its reward is >= 1.0; with a
reward model (``reward.model``, :mod:`hpc.data.reward_model`) greedy accuracy and pass@k count
scores >= 1.0, and avg@n is the mean score, the figure that matters then.
"""
from __future__ import annotations

import time

import numpy as np

from hpc.job.config import EvalConfig
from hpc.runtime.errors import user_errors_exit
from hpc.runtime.methods import MethodSpec
from hpc.runtime.results import EvalResult, format_table, log_eval
from hpc.runtime.world import World, split_evenly


def _count(name: str, value) -> int:
    """``value`` as an int if it is an integer (Python or numpy; not a bool, not 2.0), else a
    ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"pass@k needs integer counts, got {name}={value!r}")
    return int(value)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct of ``n`` samples (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), computed as the stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i).
    ``n``, ``c``, ``k``: integers (Python or numpy), 1 <= k <= n and 0 <= c <= n, else a
    ValueError.
    """
    n, c, k = _count("n", n), _count("c", c), _count("k", k)
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_table(n: int) -> np.ndarray:
    """pass@k of one problem for every c = 0..n correct of ``n`` samples and k = 1..n: float64
    (n + 1, n), row c, column k - 1. The same stable product as :func:`pass_at_k`, built for
    all c at once: row c is row c - 1 times (1 - k / (n - c + 1)), a factor that is exactly 0
    at k = n - c + 1, so pass@k = 1 wherever n - c < k."""
    n = _count("n", n)
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 samples, got n={n}")
    k = np.arange(1, n + 1, dtype=np.float64)
    factors = 1.0 - k[None, :] / np.arange(n, 0, -1, dtype=np.float64)[:, None]
    misses = np.vstack([np.ones((1, n)), np.cumprod(factors, axis=0)])
    return np.where(np.arange(n + 1)[:, None] > n - k[None, :], 1.0, 1.0 - misses)


def pass_at_k_curve(correct_counts: np.ndarray, n: int) -> np.ndarray:
    """Mean pass@k over problems for k = 1..n: float64 (n,). ``correct_counts``: integers
    (problems,), each in 0..n; anything else (floats such as 2.5 or 2.0, bools) is a
    ValueError."""
    counts = np.asarray(correct_counts)
    if counts.dtype.kind not in "iu":
        raise ValueError(f"pass@k needs integer correct counts, got dtype {counts.dtype}")
    n = _count("n", n)
    if counts.size and not (counts.min() >= 0 and counts.max() <= n):
        bad = int(counts[(counts < 0) | (counts > n)][0])
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={bad}, n={n}")
    return pass_at_k_table(n)[counts.astype(np.int64)].mean(axis=0)


def sampled_counts(model, tokenizer, task, split, eval_cfg: EvalConfig, max_new_tokens: int,
                   decoder, seed: int, first_index: int) -> tuple:
    """(correct samples int32 (problems,), reward sums float64 (problems,)) of
    ``eval_cfg.n_samples`` samples of each problem of ``split`` (the first is problem
    ``first_index`` of the whole split: the sampling key), ``eval_cfg.sample_chunk`` samples
    of every problem per decoding call (module docstring)."""
    from hpc.engine.generate import generate

    n = eval_cfg.n_samples
    chunk = min(eval_cfg.sample_chunk or n, n)
    correct, sums = np.zeros(len(split), np.int32), np.zeros(len(split), np.float64)
    for first in range(0, n, chunk):
        m = min(chunk, n - first)
        samples = generate(model, tokenizer, split.prompts, max_new_tokens, do_sample=True,
                           temperature=eval_cfg.temperature, top_p=eval_cfg.top_p,
                           num_return_sequences=m, batch_size=eval_cfg.batch_size, seed=seed,
                           first_index=first_index, first_sample=first, decoder=decoder)
        answers = [a for a in split.answers for _ in range(m)]
        rewards = np.array(task.rewards(samples, answers), dtype=np.float64).reshape(-1, m)
        correct += (rewards >= 1.0).sum(axis=1).astype(np.int32)
        sums += rewards.sum(axis=1)
        del samples, answers, rewards  # one chunk's completions at a time
    return correct, sums


def evaluate(model, tokenizer, task, split, eval_cfg: EvalConfig, max_new_tokens: int,
             world: World, decoder, seed: int = 0, sampled: bool = True,
             next_decode: tuple = (0, 1)) -> EvalResult:
    """Greedy accuracy and (if ``sampled``) pass@k over ``split``, shared across ranks,
    decoded by ``decoder`` (the job's :class:`hpc.engine.engine_backend.EngineBackend`). The evaluation's
    engine is released at the end unless the phase after it, which decodes ``next_decode`` =
    (rows, members) at once ((0, 1): nothing), would reuse it
    (:meth:`hpc.engine.engine_backend.EngineBackend.end_phase`)."""
    from hpc.engine.generate import generate

    start = time.perf_counter()
    counts = split_evenly(len(split), world.size)
    lo = sum(counts[: world.rank])
    mine = split.subset(range(lo, lo + counts[world.rank]))
    greedy = generate(model, tokenizer, mine.prompts, max_new_tokens,
                      batch_size=eval_cfg.batch_size, first_index=lo, decoder=decoder)
    correct = np.array(task.rewards(greedy, mine.answers), dtype=np.float64) >= 1.0
    all_correct = world.allgatherv(correct.astype(np.int8), counts, tag="eval")
    n = eval_cfg.n_samples
    curve, avg = np.full(n, np.nan), float("nan")
    if sampled:
        mine_c, mine_sums = sampled_counts(model, tokenizer, task, mine, eval_cfg,
                                           max_new_tokens, decoder, seed, lo)
        c = world.allgatherv(mine_c, counts, tag="eval")
        reward_sums = world.allgatherv(mine_sums, counts, tag="eval")
        curve = pass_at_k_curve(c, n)
        avg = float(reward_sums.sum() / (len(split) * n))
    decoder.end_phase(*next_decode)
    return EvalResult(accuracy=float(all_correct.mean()), pass_at_k=curve, avg_at_n=avg,
                      n_problems=len(split), seconds=time.perf_counter() - start,
                      greedy_correct=all_correct)


# hpc-eval: a job of the shared sections only, which keeps no checkpoints; a spec like a
# method's, not registered among them (it trains nothing)
EVAL = MethodSpec(
    name="eval", command="hpc-eval",
    about="Greedy accuracy and pass@k of model.path (+ lora.adapter) on the task's held-out "
          "split: writes eval.h5.",
    section="", job="hpc.job.config:JobConfig", trainer="hpc.evaluate:main",
    keeps_checkpoints=False)


@user_errors_exit
def main(argv=None):
    """``hpc-eval [CONFIG.yaml] [key=value ...]``: evaluate a model (+ lora.adapter)."""
    from hpc.job.lifecycle import on_all_ranks, start_job
    from hpc.models.loading import load_adapter, load_model
    from hpc.models.quantize import quantized_linears
    from hpc.runtime.runstore import RunStore, environment_attrs
    from hpc.job.loop import share_graph_check
    from hpc.data.tasks import job_task

    job = start_job(EVAL, argv)
    cfg, world = job.cfg, job.world
    task = on_all_ranks(world, lambda: job_task(cfg, job.device))
    model, tok = on_all_ranks(world, lambda: load_model(
        cfg.model.path, cfg.model.dtype, job.device, load=cfg.model.load,
        wrap=(lambda base: load_adapter(base, cfg.lora.adapter)) if cfg.lora.adapter else None,
        quantize=cfg.model.quantize))
    attrs = environment_attrs(world, job.device)
    store = RunStore(f"{job.out_dir}/eval.h5", world.is_root,
                     dict(attrs, **job.sources.attrs(), method="eval", config=job.config_text,
                          quantized_linears=quantized_linears(model),
                          decode_backend=job.decoder.name,
                          decode_backend_version=job.decoder.version()))
    result = evaluate(model, tok, task, task.eval, cfg.eval, cfg.task.max_new_tokens, world,
                      job.decoder, seed=cfg.run.seed)
    log_eval(store, 0, result)
    share_graph_check(world, job.decoder, store)
    job.decoder.close()
    store.close()
    if world.is_root:
        label = cfg.lora.adapter or cfg.model.path
        print(format_table([(label, result, {"problems": result.n_problems})]))


if __name__ == "__main__":
    main()
