"""The measured cost source: per-completion costs and steps to a held-out accuracy target
from ESSA and F-GRPO run files (any number of seeds per method; ``hpc-scaling --runs``).

Units: seconds, bytes; costs are per completion on one GPU (rank-seconds).
"""
from __future__ import annotations

import numpy as np

from compare.model import LinearCosts
from fgrpo.config import OptimConfig
from hpc.analysis.report import open_run, phase_kinds, step_timings
from hpc.runtime.config import stored_config
from hpc.runtime.errors import UserError

METHOD_KEYS = {"essa": ("population", "minibatch"),
               "fgrpo": ("batch_prompts", "sampling.num_generations", "optim.num_iterations",
                         "optim.mini_batch_prompts")}
# a run file older than a key ran as the key's default does
KEY_DEFAULTS = {"fgrpo": {"optim.num_iterations": OptimConfig().num_iterations,
                          "optim.mini_batch_prompts": OptimConfig().mini_batch_prompts}}
METHOD_NAMES = {"essa": "ESSA", "fgrpo": "F-GRPO"}
ACCURACY_TOLERANCE = 1e-9  # an accuracy within this of the target reaches it


class Measured(LinearCosts):
    """Per-completion costs measured in run files (seconds per completion on one GPU, from
    the phase timings summed over ranks), averaged over the runs of each method (seeds), and
    the steps each run took to a held-out accuracy."""

    def __init__(self, paths: list):
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise UserError(f"--runs names {', '.join(twice)} more than once")
        runs = [open_run(p) for p in paths]
        for run in runs:
            if run.attrs.get("method") not in METHOD_KEYS:
                raise UserError(f"{run.path} is neither an ESSA nor an F-GRPO run file "
                                f"(method {run.attrs.get('method')!r})")
        self.runs = {m: [r for r in runs if r.attrs.get("method") == m] for m in METHOD_KEYS}
        for method, found in self.runs.items():
            if not found:
                raise UserError(f"--runs needs at least one {METHOD_NAMES[method]} run file "
                                f"(method {method!r}); got none among {len(runs)}")
        self.essa_cfg = _shared_section(self.runs["essa"], "essa")
        self.fgrpo_cfg = _shared_section(self.runs["fgrpo"], "fgrpo")
        e, f = self.essa_cfg, self.fgrpo_cfg
        # optimizer updates a step: PPO epochs x mini-batches (each an all-reduce and AdamW)
        mini_batch = f["optim.mini_batch_prompts"] or f["batch_prompts"]
        iters = f["optim.num_iterations"] * (f["batch_prompts"] // mini_batch)
        completions_g = f["batch_prompts"] * f["sampling.num_generations"]
        essa = [(step_timings(r), phase_kinds(r)) for r in self.runs["essa"]]
        fgrpo = [(step_timings(r), phase_kinds(r)) for r in self.runs["fgrpo"]]
        self.s_essa = np.mean([_rank_sum(t, _of_kind(k, "rollout")) for t, k in essa]) / (
            e["population"] * e["minibatch"])
        self.fgrpo_rounds = float(np.mean([_rollout_rounds(r, completions_g)
                                           for r in self.runs["fgrpo"]]))
        self.s_gen = np.mean([_rank_sum(t, _of_kind(k, "rollout")) for t, k in fgrpo]) / \
            (completions_g * self.fgrpo_rounds)
        self.s_train = np.mean([_rank_sum(t, _of_kind(k, "train")) for t, k in fgrpo]) / \
            completions_g
        self.essa_update_s = float(np.mean([_rank_sum(t, _of_kind(k, "update"), mean=True)
                                            for t, k in essa]))
        self.optimizer_s = float(np.mean([_rank_sum(t, _of_kind(k, "update"), mean=True)
                                          for t, k in fgrpo])) / iters
        self.grad_bytes = float(np.mean([_grad_bytes(r) for r in self.runs["fgrpo"]])) / iters
        self.updates = iters

    def workload_defaults(self) -> dict:
        """The runs' workload: :class:`compare.model.Workload`'s fields but the steps."""
        e, f = self.essa_cfg, self.fgrpo_cfg
        return {"population": e["population"], "minibatch": e["minibatch"],
                "fgrpo_batch": f["batch_prompts"],
                "fgrpo_generations": f["sampling.num_generations"],
                "fgrpo_minibatch": max(1, f["batch_prompts"] // self.updates),
                "essa_update_s": self.essa_update_s, "fgrpo_rounds": self.fgrpo_rounds}

    def steps_to_target(self, target: float | None = None) -> tuple:
        """(ESSA generations, F-GRPO steps, target, lines): per run the step of the first
        held-out evaluation at accuracy >= ``target``, then the median per method. Without a
        target: the highest held-out accuracy that every run of both methods reaches."""
        curves = {r.path: _heldout(r) for rs in self.runs.values() for r in rs}
        chosen = target is None
        if chosen:
            target = min(float(acc.max()) for _, acc in curves.values())
        missed = [f"{path} (its best: {acc.max():.4g})" for path, (_, acc) in curves.items()
                  if not (acc >= target - ACCURACY_TOLERANCE).any()]
        if missed:
            raise UserError(f"never reached held-out accuracy {target:g}: {', '.join(missed)};"
                            " lower --target, or leave it out to take the highest accuracy "
                            "every run reaches")
        medians, lines = [], []
        for method, runs in self.runs.items():
            per_run = []
            for run in runs:
                steps, acc = curves[run.path]
                per_run.append(int(steps[np.flatnonzero(acc >= target - ACCURACY_TOLERANCE)[0]]))
            median = float(np.median(per_run))  # held-out rows follow steps 1, 2, ...
            medians.append(int(median) if median.is_integer() else median)
            lines.append(f"{METHOD_NAMES[method]} steps to {target:.4g}, run by run: " +
                         ", ".join(f"{r.path} {s}" for r, s in zip(runs, per_run)) +
                         f"; median {median:g}")
        how = ("chosen automatically: the highest held-out accuracy every run of both methods "
               "reaches" if chosen else "as given by --target")
        lines.insert(0, f"target: held-out accuracy {target:.4g} ({how}; the column each run "
                     "names in its heldout_accuracy attribute, group heldout)")
        return medians[0], medians[1], target, lines

    def assumptions(self) -> list:
        e, g = self.runs["essa"], self.runs["fgrpo"]
        return [
            f"costs measured in {len(e)} ESSA run(s) ({', '.join(r.path for r in e)}; "
            f"{e[0].attrs.get('world_size')} ranks) and {len(g)} F-GRPO run(s) "
            f"({', '.join(r.path for r in g)}; {g[0].attrs.get('world_size')} ranks), on "
            f"{e[0].attrs.get('device_model', '?')}, averaged over each method's runs: ESSA "
            f"{1e3 * self.s_essa:.2f} ms per scored completion, GRPO {1e3 * self.s_gen:.2f} ms "
            f"per sampled completion and {1e3 * self.s_train:.2f} ms of forward+backward per "
            "completion",
            "these costs are taken as linear in the completions a GPU does (the batch-size and "
            "longest-completion effects of the roofline model are not applied)",
            f"GRPO gradients: {self.grad_bytes / 1e6:.3g} MB all-reduced per optimizer step; "
            f"optimizer {1e3 * self.optimizer_s:.2f} ms as measured",
        ]


def _dotted(data, key: str):
    """The value at the dotted ``key`` of nested dicts ``data``; None where there is none."""
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _shared_section(runs: list, method: str) -> dict:
    """The ``method`` section of the runs' config, checked to hold the workload keys and to
    agree on them across the runs (seeds of one experiment)."""
    keys = METHOD_KEYS[method]
    sections = []
    for run in runs:
        cfg = stored_config(run.attrs.get("config", ""))
        section = {**KEY_DEFAULTS.get(method, {}), **{
            key: value for key in keys
            if (value := _dotted(cfg, f"{method}.{key}")) is not None}}
        if any(k not in section for k in keys):
            raise UserError(f"{run.path}: its config lacks {method}.{'/'.join(keys)}")
        if len(run.group("timings").get("step", [])) == 0:
            raise UserError(f"{run.path} has no completed step yet")
        sections.append(section)
    for key in keys:
        values = {s[key] for s in sections}
        if len(values) > 1:
            raise UserError(f"the {METHOD_NAMES[method]} runs differ in {method}.{key} "
                            f"({', '.join(f'{r.path}: {s[key]}' for r, s in zip(runs, sections))})"
                            "; the runs of one method must share its workload")
    return sections[0]


def _rollout_rounds(run, completions: int) -> float:
    """Rollout rounds a step of an F-GRPO run: 1 + its mean ``extra_rollouts`` (dynamic
    sampling) over the batch's completions; 1 for a run without the metric."""
    metrics = run.group("metrics")
    extra = metrics["extra_rollouts"] if "extra_rollouts" in metrics else np.zeros(1)
    return 1.0 + float(np.mean(extra)) / completions


def _grad_bytes(run) -> float:
    """Bytes an F-GRPO run all-reduced per step (4 bytes a trainable parameter if
    unrecorded)."""
    sent = run.group("bytes").get("grad_allreduce", np.zeros(0))
    return float(sent.mean()) if sent.size and sent.mean() > 0 else \
        4.0 * float(run.attrs.get("trainable_parameters", 0))


def _heldout(run) -> tuple:
    """(steps, accuracy) of a run's held-out evaluations, in the column its
    ``heldout_accuracy`` attribute names (files without it: ESSA's mean, else accuracy)."""
    g = run.group("heldout")
    key = run.attrs.get("heldout_accuracy", "mean_accuracy" if "mean_accuracy" in g else
                        "accuracy")
    if key not in g or "step" not in g:
        raise UserError(f"{run.path} has no held-out evaluation (group heldout, column {key})")
    n = min(len(g[key]), len(g["step"]))
    steps, acc = np.asarray(g["step"][:n]), np.asarray(g[key][:n], dtype=float)
    ok = np.isfinite(acc)
    if not ok.any():
        raise UserError(f"{run.path} has no held-out evaluation (group heldout, column {key})")
    return steps[ok], acc[ok]


def _of_kind(kinds: dict, kind: str) -> tuple:
    """The phases of a run (``{phase: kind}``, :func:`hpc.analysis.report.phase_kinds`) that
    are of ``kind``: rollout (decoding and rewards), train (forward/backward), update."""
    return tuple(p for p, k in kinds.items() if k == kind)


def _rank_sum(timings: dict, phases: tuple, mean: bool = False) -> float:
    """Seconds a step of ``phases``, summed over ranks (or their mean), averaged over steps."""
    parts = [timings[p] for p in phases if p in timings]
    if not parts or len(parts[0]) == 0:
        return 0.0
    total = sum(parts)
    return float((total.mean(axis=1) if mean else total.sum(axis=1)).mean())
