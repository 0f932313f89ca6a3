"""Reports over run files: ``hpc-report compare`` (each run's start and end, side by side) and
``hpc-report summary`` (where a step's time and bytes go, per phase and rank; CSV and plots),
the subcommands that read any run file (:func:`add_commands`, :func:`run`). The command itself,
its --help and its reproduction subcommand are :mod:`compare.report`. Both read files of jobs
still running (rows not yet complete are skipped).
"""
# Nothing here knows a method: each run file names its phases with their kind (``phases``, see
# hpc.job.loop.PHASE_KINDS) and the held-out column its accuracy curve follows
# (``heldout_accuracy``); files without those attributes are read with LEGACY_PHASES.
from __future__ import annotations

import csv
import json
import os
import textwrap

import numpy as np
import yaml

from hpc.runtime.errors import UserError
from hpc.runtime.results import EvalResult, format_table
from hpc.runtime.runstore import RunFile

COMM_KINDS = ("waiting", "communication")  # the share "spent communicating or waiting"
NON_COMPUTE_KINDS = COMM_KINDS + ("eval", "checkpoint")
# {phase: kind} of run files written before the runs named their phases, in step order.
LEGACY_PHASES = {"rebuild": "rollout", "generate": "rollout", "generation": "rollout",
                 "reward": "rollout", "forward_backward": "train", "waiting": "waiting",
                 "communication": "communication", "allreduce": "communication",
                 "update": "update", "optimizer": "update", "eval": "eval",
                 "checkpoint": "checkpoint"}
PLOTS = ("accuracy_vs_wall.png", "scaling.png", "phases.png", "timeline.png")


def _result(eval_group: dict, row: int) -> EvalResult:
    return EvalResult(accuracy=float(eval_group["accuracy"][row]),
                      pass_at_k=np.asarray(eval_group["pass_at_k"][row]),
                      avg_at_n=float(eval_group["avg_at_n"][row]), n_problems=0,
                      seconds=float(eval_group["seconds"][row]), greedy_correct=np.empty(0))


def total_bytes(run: RunFile) -> int:
    """Payload bytes per rank over the whole run, all tags summed (bootstrap excluded)."""
    g = run.group("bytes")
    return int(sum(v.sum() for k, v in g.items() if k not in ("step", "bootstrap")))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def compare_rows(paths: list) -> list:
    """(label, EvalResult, extra) rows: the first file's start, then each file's end."""
    rows = []
    for i, path in enumerate(paths):
        run = open_run(path)
        ev = run.group("eval")
        if not ev or len(ev["step"]) < 2:
            raise UserError(f"{path} has no start and final evaluation (is the run finished?)")
        method = run.attrs.get("method", "?")
        if i == 0:
            rows.append((start_label(run), _result(ev, 0), {"wall s": "", "bytes/rank": ""}))
        wall = run.attrs.get("wall_seconds", run.attrs.get("train_seconds", float("nan")))
        rows.append((method, _result(ev, len(ev["step"]) - 1),
                     {"wall s": f"{wall:.0f}", "ranks": str(run.attrs.get("world_size", "")),
                      "bytes/rank": human_bytes(total_bytes(run))}))
    return rows


def open_run(path: str) -> RunFile:
    """The run file at ``path``; a missing or unreadable file is a :class:`UserError`."""
    if not os.path.isfile(path):
        raise UserError(f"run file not found: {path}")
    try:
        return RunFile(path)
    except OSError as err:
        raise UserError(f"cannot read {path} as an HDF5 run file: {err}") from None


def phase_kinds(run: RunFile) -> dict:
    """{phase: kind} of the run, in the order of a step (its ``phases`` attribute; for older
    files the legacy names, then any other timed phase as ``train``)."""
    if "phases" in run.attrs:
        return json.loads(run.attrs["phases"])
    timed = [k for k in run.group("timings") if k != "step"]
    kinds = {p: k for p, k in LEGACY_PHASES.items() if p in timed}
    return dict(kinds, **{p: "train" for p in sorted(set(timed) - set(kinds))})


def step_timings(run: RunFile) -> dict:
    """{phase: float64 (n, ranks) seconds} over the steps every phase has completely written.

    A file being written may hold datasets one row longer than others, or a row still at its
    NaN fill value; such rows are dropped. A run resumed on another rank count (more than one
    row in ``segments``): the steps of its last segment, on that segment's ranks.
    """
    timings = run.group("timings")
    order = [p for p in phase_kinds(run) if p in timings]
    g = {k: np.atleast_2d(timings[k].T).T for k in order}
    if not g:
        return {}
    segments = run.group("segments")
    if len(segments.get("world_size", ())) > 1 and "step" in timings:
        since, ranks = segments["step"][-1], int(segments["world_size"][-1])
        g = {k: v[timings["step"][:len(v)] > since, :ranks] for k, v in g.items()}
    n = min(len(v) for v in g.values())
    complete = np.all([np.isfinite(v[:n]).all(axis=1) for v in g.values()], axis=0)
    return {k: v[:n][complete] for k, v in g.items()}


def heldout_curve(run: RunFile) -> tuple:
    """(wall seconds, accuracy) of the periodic held-out evaluations, in the column the run
    names (ESSA: the mean's)."""
    g = run.group("heldout")
    key = run.attrs.get("heldout_accuracy",
                        "mean_accuracy" if "mean_accuracy" in g else "accuracy")
    if key not in g or "wall_s" not in g:
        return np.empty(0), np.empty(0)
    n = min(len(g[key]), len(g["wall_s"]))
    wall, acc = g["wall_s"][:n], g[key][:n]
    ok = np.isfinite(wall) & np.isfinite(acc)
    return wall[ok], acc[ok]


def time_to_target(run: RunFile, target: float) -> float:
    """Wall seconds of the first held-out evaluation at accuracy >= ``target`` (NaN: never)."""
    wall, acc = heldout_curve(run)
    hit = np.flatnonzero(acc >= target)
    return float(wall[hit[0]]) if hit.size else float("nan")


def _section(run: RunFile, name: str) -> dict:
    """Section ``name`` of the run's stored config ({} where the file has none or it is not
    readable YAML)."""
    try:
        cfg = yaml.safe_load(run.attrs.get("config", "")) or {}
    except yaml.YAMLError:
        return {}
    section = cfg.get(name, {}) if isinstance(cfg, dict) else {}
    return section if isinstance(section, dict) else {}


def _model(run: RunFile) -> str:
    return str(_section(run, "model").get("path", "?"))


def start_label(run: RunFile) -> str:
    """The name of a run's start evaluation in ``compare``: ``base`` where the run started
    from the model alone (its config's ``lora.adapter`` empty), else ``<method> start`` (the
    adapter it started from, an earlier run's)."""
    adapter = _section(run, "lora").get("adapter")
    return f"{run.attrs.get('method', '?')} start" if adapter else "base"


def summarize(path: str, target: float | None = None) -> dict:
    """One summary row of a run file; seconds are per training step, bytes per rank."""
    run = open_run(path)
    t = step_timings(run)
    kinds = phase_kinds(run)
    phases = {k: float(v.mean()) if len(v) else float("nan") for k, v in t.items()}
    per_rank = sum(t.values()) if t else np.empty((0, 0))  # (n, ranks) seconds a step
    step_s = per_rank.max(axis=1) if per_rank.size else np.empty(0)
    comm = sum((t[k] for k in t if kinds[k] in COMM_KINDS), np.zeros_like(per_rank))
    compute = sum((t[k] for k in t if kinds[k] not in NON_COMPUTE_KINDS),
                  np.zeros_like(per_rank))
    b = run.group("bytes")
    tags = _aligned(b, [k for k in b if k not in ("step", "bootstrap")])
    wall, acc = heldout_curve(run)
    ev_step, ev_acc = _aligned(run.group("eval"), ["step", "accuracy"]) or (None, None)
    final = ev_acc[ev_step >= 0] if ev_step is not None else np.empty(0)
    wall_s = run.group("metrics").get("wall_s", np.empty(0))
    row = {"file": os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))),
                                os.path.basename(path)), "method": run.attrs.get("method", "?"),
           "status": run.attrs.get("status", "?"),
           "ranks": int(run.attrs.get("world_size", per_rank.shape[1] if per_rank.size else 0)),
           "model": _model(run), "steps": len(step_s),
           "step_s": _mean(step_s), "comm_share": _ratio(comm.mean(axis=1).sum(), step_s.sum())
           if per_rank.size else float("nan"),
           "straggler_spread": straggler_spread(compute),
           "bytes_per_step": _mean(sum(tags)) if tags else float("nan"),
           "best_heldout": float(acc.max()) if acc.size else float("nan"),
           "final_eval": float(final[-1]) if final.size else float("nan"),
           "wall_s": float(np.nanmax(wall_s)) if np.isfinite(wall_s).any() else float("nan")}
    if target is not None:
        row["time_to_target_s"] = time_to_target(run, target)
    row["phases"] = phases
    row["memory"] = memory_figures(run)
    return row


def memory_figures(run: RunFile) -> dict:
    """GiB per GPU: the job's plan (its ``plan`` attribute: the load phase and the peak) and
    what the largest rank measured (``memory_load_peak``, ``memory_job_peak``: each rank's
    ``torch.cuda.max_memory_allocated`` after the load and at the end, CUDA only); NaN where
    the run file has none."""
    def gib(nbytes) -> float:
        return float(nbytes) / 2 ** 30 if nbytes is not None else float("nan")

    def measured(key) -> float:
        try:
            peaks = json.loads(run.attrs.get(key, "[]"))
        except (TypeError, ValueError):
            peaks = []
        return gib(max(peaks)) if peaks else float("nan")

    try:
        plan = json.loads(run.attrs.get("plan", "{}"))
    except (TypeError, ValueError):
        plan = {}
    phases = plan.get("phases", {}) if isinstance(plan, dict) else {}
    return {"plan_load": gib(phases.get("load")) if isinstance(phases, dict) else float("nan"),
            "plan_peak": gib(plan.get("peak") or None) if isinstance(plan, dict) else
            float("nan"),
            "measured_load": measured("memory_load_peak"),
            "measured_peak": measured("memory_job_peak")}


def _aligned(group: dict, keys: list) -> list:
    """The ``keys`` datasets of a group cut to a common length ([] if one is missing)."""
    if not keys or any(k not in group for k in keys):
        return []
    n = min(len(group[k]) for k in keys)
    return [group[k][:n] for k in keys]


def straggler_spread(compute: np.ndarray) -> float:
    """Mean over steps of (slowest - fastest) / mean of the ranks' compute seconds (n, ranks)."""
    if compute.size == 0:
        return float("nan")
    mean = compute.mean(axis=1)
    ok = mean > 0
    return _mean((compute.max(axis=1) - compute.min(axis=1))[ok] / mean[ok])


def _mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()) if x.size else float("nan")


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else float("nan")


def flat(row: dict) -> dict:
    """A summary row with its phases as ``phase_<name>_s`` columns and its memory figures as
    ``memory_<name>_gib`` (for CSV)."""
    out = {k: v for k, v in row.items() if k not in ("phases", "memory")}
    out.update({f"phase_{k}_s": v for k, v in row["phases"].items()})
    out.update({f"memory_{k}_gib": v for k, v in row.get("memory", {}).items()})
    return out


def _cell(key: str, value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return str(value)
    if not np.isfinite(value):
        return "not reached" if key == "time_to_target_s" else "-"
    if key in ("comm_share", "straggler_spread", "best_heldout", "final_eval"):
        return f"{100 * value:.1f}%"
    if key.startswith("memory_"):
        return f"{value:.2f}"
    if key == "bytes_per_step":
        return human_bytes(value)
    return f"{value:.3g}" if key.startswith("phase_") else f"{value:.2f}"


def text_table(rows: list, keys: list, head: list | None = None) -> str:
    lines = [head or keys] + [[_cell(k, r.get(k, float("nan"))) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(keys))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def phase_union(rows: list) -> list:
    """Every phase of ``rows``, each run's in the order of its step, first run first; the
    job loop's own phases (evaluation, checkpoint) last."""
    names = list(dict.fromkeys(p for r in rows for p in r["phases"]))
    last = [p for p in ("eval", "checkpoint") if p in names]
    return [p for p in names if p not in last] + last


def format_summary(rows: list) -> str:
    """The summary table, then a table of mean seconds per phase (mean over ranks)."""
    flats = [flat(r) for r in rows]
    main = [k for k in flats[0] if not k.startswith(("phase_", "memory_"))]
    phases = phase_union(rows)
    keys = ["file"] + [f"phase_{p}_s" for p in phases]
    text = (text_table(flats, main) + "\n\nseconds per step by phase (mean over ranks)\n"
            + text_table(flats, keys, ["file"] + phases))
    memory = [k for k in flats[0] if k.startswith("memory_")]
    if any(np.isfinite(f[k]) for f in flats for k in memory):
        text += ("\n\nGiB per GPU: the plan's load phase and peak, the largest rank's measured "
                 "after the load and at the end\n"
                 + text_table(flats, ["file"] + memory, ["file", "plan load", "plan peak",
                                                         "measured load", "measured peak"]))
    return text


def write_csv(rows: list, path: str) -> None:
    flats = [flat(r) for r in rows]
    keys = list(dict.fromkeys(k for r in flats for k in r))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(flats)


def scaling_points(rows: list) -> dict:
    """{method: (ranks, speed-up, efficiency, basis)} against the smallest rank count.

    The basis is time to target when every run of the method reached it, else the mean step
    time (several runs at one rank count are averaged).
    """
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        group = [r for r in rows if r["method"] == method and np.isfinite(r["step_s"])]
        ttt = [r.get("time_to_target_s", float("nan")) for r in group]
        basis = "time to target" if group and np.isfinite(ttt).all() else "step time"
        key = "time_to_target_s" if basis == "time to target" else "step_s"
        ranks = np.array(sorted({r["ranks"] for r in group}))
        if len(ranks) == 0:
            continue
        t = np.array([np.mean([r[key] for r in group if r["ranks"] == n]) for n in ranks])
        speedup = t[0] / t
        out[method] = (ranks, speedup, speedup / (ranks / ranks[0]), basis)
    return out


def empty_plots(rows: list) -> dict:
    """The plots of :data:`PLOTS` that cannot show anything for ``rows``, with the reason."""
    notes = {}
    rank_counts = sorted({r["ranks"] for r in rows})
    if len(rank_counts) < 2:
        notes["scaling.png"] = (f"every run has {rank_counts[0]} rank(s), so there is no speed-up "
                                f"to show: it needs runs of one method at several rank counts "
                                f"(jobscripts/local-scaling.sh, jobscripts/sweep.sh)")
    return notes


def draw_plots(rows: list, paths: list, out_dir: str, timeline_steps: int = 5,
               target: float | None = None) -> list:
    """Write the four PNGs of :data:`PLOTS` into ``out_dir``; returns their paths. A plot that
    cannot show anything (:func:`empty_plots`) says why on its face."""
    import matplotlib  # here: only the plots need it, and the backend is chosen before pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    runs = [RunFile(p) for p in paths]
    names = phase_union(rows)
    cmap = plt.get_cmap("tab20")
    colour = {p: cmap(i % 20) for i, p in enumerate(names)}
    label = [f"{r['method']} x{r['ranks']} ({r['file']})" for r in rows]
    written = [os.path.join(out_dir, name) for name in PLOTS]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for run, row, lab in zip(runs, rows, label):
        wall, acc = heldout_curve(run)
        if wall.size:
            ax.plot(wall, 100 * acc, marker="o", label=lab,
                    ls=("-", "--", ":", "-.")[methods.index(row["method"]) % 4])
    if target is not None:
        ax.axhline(100 * target, color="grey", lw=0.8, ls=":", label="target")
    ax.set(xlabel="wall clock (s)", ylabel="held-out accuracy (%)",
           title="accuracy against wall clock")
    if any(line.get_label() != "target" for line in ax.lines):
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no held-out evaluations yet", ha="center", transform=ax.transAxes)
    fig.savefig(written[0], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if "scaling.png" in empty_plots(rows):
        fig.text(0.5, 0.5, textwrap.fill(empty_plots(rows)["scaling.png"], 60), ha="center",
                 va="center", fontsize=10, bbox={"facecolor": "white", "alpha": 0.9})
    points = scaling_points(rows)
    for method, (ranks, speedup, eff, basis) in points.items():
        ax1.plot(ranks, speedup, marker="o", label=f"{method} ({basis})")
        ax2.plot(ranks, eff, marker="o", label=method)
    all_ranks = np.array(sorted({r["ranks"] for r in rows}))
    ax1.plot(all_ranks, all_ranks / all_ranks[0], "k--", label="ideal")
    ax2.axhline(1.0, color="k", ls="--", label="ideal")
    ax1.set(xlabel="ranks (GPUs)", ylabel="speed-up vs fewest ranks", title="speed-up")
    top = max([1.0] + [float(np.max(p[2])) for p in points.values()])
    ax2.set(xlabel="ranks (GPUs)", ylabel="parallel efficiency", title="parallel efficiency",
            ylim=(0, 1.2 * top))
    for a in (ax1, ax2):
        a.set_xticks(all_ranks)
        a.legend(fontsize=7)
    fig.savefig(written[1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    bottom = np.zeros(len(rows))
    for p in names:
        h = np.nan_to_num([r["phases"].get(p, 0.0) for r in rows])
        ax.bar(range(len(rows)), h, bottom=bottom, color=colour[p], label=p)
        bottom += h
    ax.set_xticks(range(len(rows)), label, rotation=20, ha="right", fontsize=7)
    ax.set(ylabel="seconds per step (mean over ranks)", title="phase breakdown")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(written[2], dpi=100, bbox_inches="tight")
    plt.close(fig)

    pick = int(np.argmax([r["ranks"] for r in rows]))
    timeline(plt, step_timings(runs[pick]), colour, timeline_steps, written[3], label[pick])
    return written


def timeline(plt, t: dict, colour: dict, n_steps: int, path: str, title: str) -> None:
    """Per rank, the phases of the first ``n_steps`` steps as consecutive segments; a step
    starts when the slowest rank finished the previous one (steps end in a collective)."""
    first = next(iter(t.values()), np.empty((0, 1)))
    n, ranks = min(n_steps, first.shape[0]), first.shape[1]
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.4 * ranks))
    start, seen = 0.0, set()
    for s in range(n):
        ends = np.full(ranks, start)
        for p, sec in t.items():
            ax.barh(range(ranks), sec[s], left=ends, color=colour[p],
                    label=None if p in seen else p, edgecolor="white", linewidth=0.3)
            seen.add(p)
            ends = ends + sec[s]
        ax.axvline(start, color="k", lw=0.5)
        start = float(ends.max())
    ax.set(xlabel="seconds since the first step", ylabel="rank", yticks=range(ranks),
           title=f"per-rank timeline, first {n} steps: {title}")
    if n:
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    else:
        ax.text(0.5, 0.5, "no complete steps yet", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def add_commands(sub) -> None:
    """The ``compare`` and ``summary`` subcommands on ``hpc-report``'s subparsers ``sub``."""
    cmp_parser = sub.add_parser("compare", help="start vs end of runs, side by side")
    cmp_parser.add_argument("files", nargs="+")
    sum_parser = sub.add_parser("summary", help="time split, communication, stragglers, "
                                "accuracy and time to target of runs; CSV and plots")
    sum_parser.add_argument("files", nargs="+")
    sum_parser.add_argument("--csv", metavar="OUT.csv", help="write the table as CSV")
    sum_parser.add_argument("--plots", metavar="DIR", help="write " + ", ".join(PLOTS))
    sum_parser.add_argument("--target", type=float, metavar="ACC",
                            help="held-out accuracy (0-1) for the time-to-target column")
    sum_parser.add_argument("--timeline-steps", type=int, default=5, metavar="N",
                            help="steps drawn in timeline.png (run with the most ranks)")


def run(args) -> None:
    """Run the ``compare`` or ``summary`` subcommand that ``args`` (parsed) names."""
    if args.command == "compare":
        print(format_table(compare_rows(args.files)))
        return
    if args.target is not None and not 0.0 <= args.target <= 1.0:
        raise UserError(f"--target is an accuracy between 0 and 1 (got {args.target})")
    rows = [summarize(p, args.target) for p in args.files]
    print(format_summary(rows))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"csv: {args.csv}")
    if args.plots:
        notes = empty_plots(rows)
        for path in draw_plots(rows, args.files, args.plots, args.timeline_steps, args.target):
            note = notes.get(os.path.basename(path))
            print(f"plot: {path}" + (f" (shows nothing: {note})" if note else ""))
