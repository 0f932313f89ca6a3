"""hpc-report summary: values from known timings, CSV, plots, and files of running jobs."""
import csv
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO
from compare.report import main
from hpc.analysis.report import PLOTS, scaling_points, summarize
from hpc.runtime.runstore import RunStore

WRITER = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_report import essa_two_ranks
store = essa_two_ranks(sys.argv[1], close=False)
store.write_row("metrics", 3, wall_s=13.0)                    # step 3 under way:
store.write_row("timings", 3, generate=np.array([1.0, 1.0]))  # its other phases still NaN
print("ready", flush=True)
sys.stdin.read()
store.close()
"""

ESSA_PHASES = ["rebuild", "generate", "reward", "waiting", "communication", "update", "eval",
               "checkpoint"]
FGRPO_PHASES = ["generation", "reward", "forward_backward", "allreduce", "optimizer", "eval",
                "checkpoint"]


def essa_two_ranks(path, close=True):
    """Two steps on two ranks with hand-checkable numbers (see test_summary_values)."""
    store = RunStore(str(path), active=True, attrs={
        "method": "essa", "world_size": 2,
        "config": "model:\n  path: toy-llm\nlora:\n  adapter: runs/sft/adapter\n"})
    store.write_row("eval", -1, accuracy=0.3, pass_at_k=[0.3, 0.4], avg_at_n=0.3, seconds=1.0)
    for step, gen, wait in ((1, [2.0, 4.0], [2.0, 0.0]), (2, [3.0, 3.0], [0.0, 0.0])):
        timings = {p: np.zeros(2) for p in ESSA_PHASES}
        timings.update(generate=np.array(gen), waiting=np.array(wait),
                       communication=np.ones(2))
        store.log_step(step, metrics={"wall_s": 4.5 * step}, timings=timings,
                       nbytes={"fitness": 64, "control": 1})
        store.write_row("heldout", step, mean_accuracy=0.2 + 0.2 * step,
                        best_accuracy=0.7, wall_s=5.0 + 4.0 * (step - 1))
    if close:
        store.write_row("eval", 2, accuracy=0.65, pass_at_k=[0.65, 0.7], avg_at_n=0.6,
                        seconds=1.0)
        store.close()
    return store


def scaled_run(path, method, ranks, steps=4):
    """A run whose compute splits perfectly over ``ranks``: 8 s of work a step, plus (F-GRPO)
    a 0.5 s all-reduce on more than one rank; accuracy rises 0.1 a step."""
    phases = ESSA_PHASES if method == "essa" else FGRPO_PHASES
    work = "generate" if method == "essa" else "generation"
    store = RunStore(str(path), active=True, attrs={
        "method": method, "world_size": ranks, "config": "model:\n  path: toy\n"})
    wall = 0.0
    for step in range(1, steps + 1):
        timings = {p: np.zeros(ranks) for p in phases}
        timings[work] = np.full(ranks, 8.0 / ranks)
        if method == "fgrpo" and ranks > 1:
            timings["allreduce"] = np.full(ranks, 0.5)
        wall += sum(t[0] for t in timings.values())
        store.log_step(step, metrics={"wall_s": wall}, timings=timings,
                       nbytes={"grad_allreduce": 1000} if method == "fgrpo" else {"fitness": 8})
        acc = {"mean_accuracy": 0.1 * step} if method == "essa" else {"accuracy": 0.1 * step}
        store.write_row("heldout", step, wall_s=wall, **acc)
    store.close()
    return str(path)


def test_summary_values(tmp_path):
    path = tmp_path / "essa.h5"
    essa_two_ranks(path)
    row = summarize(str(path), target=0.5)
    assert (row["method"], row["ranks"], row["model"], row["steps"]) == ("essa", 2, "toy-llm", 2)
    assert row["step_s"] == pytest.approx(4.5)          # max over ranks: 5 then 4
    assert row["comm_share"] == pytest.approx(1 / 3)    # (mean 2 + mean 1) / (5 + 4)
    assert row["straggler_spread"] == pytest.approx(1 / 3)  # (4-2)/3, then 0
    assert row["phases"]["generate"] == pytest.approx(3.0)
    assert row["phases"]["communication"] == pytest.approx(1.0)
    assert row["bytes_per_step"] == pytest.approx(65.0)
    assert row["best_heldout"] == pytest.approx(0.6)
    assert row["final_eval"] == pytest.approx(0.65)
    assert row["time_to_target_s"] == pytest.approx(9.0)  # second held-out eval, 0.6 >= 0.5
    assert np.isnan(summarize(str(path), target=0.9)["time_to_target_s"])


def test_phase_kinds_and_accuracy_column_come_from_the_run_file(tmp_path):
    """A method the report has never heard of: its run file names its phases' kinds and the
    held-out column to follow, as hpc.job.loop writes them."""
    path = tmp_path / "new.h5"
    store = RunStore(str(path), active=True, attrs={
        "method": "other", "world_size": 2, "config": "",
        "phases": json.dumps({"sample": "rollout", "sync": "waiting", "send": "communication",
                              "eval": "eval"}), "heldout_accuracy": "score"})
    for step in (1, 2):
        store.log_step(step, metrics={"wall_s": 4.0 * step},
                       timings={"eval": np.zeros(2), "send": np.ones(2), "sync": np.ones(2),
                                "sample": np.full(2, 2.0)})
        store.write_row("heldout", step, score=0.3 * step, accuracy=0.0, wall_s=4.0 * step)
    store.close()
    row = summarize(str(path), target=0.5)
    assert list(row["phases"]) == ["sample", "sync", "send", "eval"]
    assert row["comm_share"] == pytest.approx(0.5)  # (sync 1 + send 1) / 4
    assert row["best_heldout"] == pytest.approx(0.6) and row["time_to_target_s"] == 8.0


@pytest.mark.subprocess
def test_reads_file_of_running_job(tmp_path):
    """Another process holds the file open for writing, mid-step, with no final eval."""
    path = tmp_path / "running.h5"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert writer.stdout.readline().strip() == "ready"
        row = summarize(str(path), target=0.5)
        assert row["status"] == "running" and row["steps"] == 2
        assert row["step_s"] == pytest.approx(4.5) and np.isnan(row["final_eval"])
        assert row["wall_s"] == 13.0 and row["time_to_target_s"] == pytest.approx(9.0)
        out = tmp_path / "plots"
        main(["summary", str(path), "--plots", str(out)])
        assert sorted(os.listdir(out)) == sorted(PLOTS)
        assert all(os.path.getsize(out / name) > 0 for name in PLOTS)
    finally:
        writer.communicate("", timeout=30)
    assert writer.returncode == 0


def test_scaling_points(tmp_path):
    rows = [summarize(scaled_run(tmp_path / f"{m}{n}.h5", m, n)) for m in ("essa", "fgrpo")
            for n in (1, 2, 4)]
    pts = scaling_points(rows)
    ranks, speedup, eff, basis = pts["essa"]
    assert ranks.tolist() == [1, 2, 4] and basis == "step time"
    np.testing.assert_allclose(speedup, [1, 2, 4])
    np.testing.assert_allclose(eff, [1, 1, 1])
    ranks, speedup, eff, _ = pts["fgrpo"]
    np.testing.assert_allclose(speedup, [1, 8 / 4.5, 8 / 2.5])
    np.testing.assert_allclose(eff, [1, 8 / 9, 0.8])
    # with a target every run reaches (0.3: the third step), time to target is the basis
    rows = [summarize(scaled_run(tmp_path / f"t{n}.h5", "essa", n), target=0.3)
            for n in (1, 2, 4)]
    assert rows[0]["time_to_target_s"] == pytest.approx(24.0)
    ranks, speedup, _, basis = scaling_points(rows)["essa"]
    assert basis == "time to target"
    np.testing.assert_allclose(speedup, [1, 2, 4])


def test_cli_table_csv_and_plots(tmp_path, capsys):
    files = [scaled_run(tmp_path / f"{m}{n}.h5", m, n) for m in ("essa", "fgrpo")
             for n in (1, 2, 4)]
    out_csv, plots = tmp_path / "summary.csv", tmp_path / "plots"
    main(["summary", *files, "--csv", str(out_csv), "--plots", str(plots), "--target", "0.2"])
    text = capsys.readouterr().out
    assert "straggler_spread" in text and "forward_backward" in text
    with open(out_csv) as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == ["essa"] * 3 + ["fgrpo"] * 3
    for key in ("ranks", "model", "steps", "step_s", "comm_share", "straggler_spread",
                "bytes_per_step", "best_heldout", "time_to_target_s", "phase_generate_s",
                "phase_allreduce_s"):
        assert key in table[0]
    assert float(table[5]["comm_share"]) == pytest.approx(0.5 / 2.5)
    assert float(table[5]["time_to_target_s"]) == pytest.approx(5.0)  # second step
    assert table[0]["phase_allreduce_s"] == ""  # ESSA has no such phase
    assert "shows nothing" not in text
    for name in ("accuracy_vs_wall.png", "scaling.png", "phases.png", "timeline.png"):
        with open(plots / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(plots / name) > 5000


def test_scaling_plot_of_one_rank_count_says_why_it_is_empty(tmp_path, capsys):
    files = [scaled_run(tmp_path / f"{m}2.h5", m, 2) for m in ("essa", "fgrpo")]
    main(["summary", *files, "--plots", str(tmp_path / "plots")])
    line = next(l for l in capsys.readouterr().out.splitlines() if "scaling.png" in l)
    assert "shows nothing: every run has 2 rank(s)" in line and "several rank counts" in line


def test_compare_still_works_and_user_errors(tmp_path, capsys):
    path = tmp_path / "essa.h5"
    essa_two_ranks(path)
    main(["compare", str(path)])
    out = capsys.readouterr().out
    assert "essa start" in out and "65.0%" in out
    with h5py.File(path, "r+") as f:  # a run from the model alone, as SFT's from the base model
        f.attrs["config"] = "model:\n  path: toy-llm\nlora:\n  adapter: ''\n"
    main(["compare", str(path)])
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["base", "30.0%"]
    with pytest.raises(SystemExit) as err:
        main(["summary", str(tmp_path / "missing.h5")])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        main(["summary", str(path), "--target", "50"])
    assert err.value.code == 2


def test_summary_sets_the_plan_beside_the_measured_memory(tmp_path, capsys):
    """A run file that holds its job's plan and each rank's measured peaks (on CUDA, after the
    load and at the end) gets a memory table: the plan's load phase and peak beside the
    largest rank's; a run without them (CPU) gets none."""
    path = tmp_path / "run" / "essa.h5"
    path.parent.mkdir()
    store = essa_two_ranks(path, close=False)
    gib = 2 ** 30
    store.set_attrs(plan=json.dumps({"phases": {"load": 33 * gib, "ESSA scoring": 50 * gib},
                                     "peak": 55 * gib}),
                    memory_load_peak=json.dumps([32 * gib, 34 * gib]),
                    memory_job_peak=json.dumps([52 * gib, 51 * gib]))
    store.close()
    row = summarize(str(path))
    assert row["memory"] == {"plan_load": 33.0, "plan_peak": 55.0, "measured_load": 34.0,
                             "measured_peak": 52.0}
    main(["summary", str(path)])
    out = capsys.readouterr().out
    assert "GiB per GPU: the plan's load phase and peak" in out
    assert out.rstrip().splitlines()[-1].split() == ["run/essa.h5", "33.00", "55.00", "34.00",
                                                     "52.00"]
    main(["summary", str(essa_two_ranks(tmp_path / "cpu.h5").path)])
    assert "GiB per GPU" not in capsys.readouterr().out
