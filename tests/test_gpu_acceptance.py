"""benchmarks/gpu_acceptance.py in its CPU mode (tiny shapes, gloo), so that the GPU acceptance
run cannot rot between GPU loans: every part present with a verdict, the parts that run on a
CPU ran and passed, the CUDA-only ones skipped with their reason; a spent time budget skips;
the CUDA-graph part fails when the replayed step differs from the eager one."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import MPI_ENV, REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_acceptance.py")
PARTS = ["engine_vs_hf", "cuda_graphs", "quantized_decode", "memory_plan", "nccl_all_reduce",
         "fsdp2_step", "backends"]


def run(out, *args):
    """(CompletedProcess, the JSON it wrote or None) of the script in its CPU mode."""
    proc = subprocess.run([sys.executable, SCRIPT, str(out), "--device", "cpu", *args],
                          capture_output=True, text=True, env=dict(os.environ, **MPI_ENV),
                          cwd=REPO, timeout=600)
    found = sorted(out.glob("gpu_acceptance-cpu-*.json")) if out.is_dir() else []
    return proc, json.loads(found[0].read_text()) if found else None


@pytest.mark.mpi  # the all-reduce part starts two ranks (mpirun, else torchrun)
@pytest.mark.toy
@pytest.mark.slow
def test_cpu_mode_runs_every_part_a_cpu_can(tmp_path):
    proc, report = run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = report["parts"]
    assert list(parts) == PARTS and report["exit_status"] == 0
    for name, part in parts.items():
        expected = "skipped" if name == "cuda_graphs" else "ok"
        assert part["verdict"] == expected, (name, part["reason"])
        assert f"{name:<17} {expected}" in proc.stdout  # the table
    assert parts["cuda_graphs"]["reason"] == "CUDA graphs need a CUDA device"

    toy = parts["engine_vs_hf"]["toy"]
    assert toy["identical"] and toy["rows_identical"] == 1.0
    assert toy["engine_tokens_per_s"] > 0 and toy["hf_tokens_per_s"] > 0
    assert 0 <= parts["engine_vs_hf"]["tiny"]["tokens_before_first_difference"] <= 1
    bf16 = parts["engine_vs_hf"]["toy_bf16"]  # a figure: bf16 may flip the closest choices
    assert bf16["dtype"] == "bfloat16" and 0 <= bf16["rows_identical"] <= 1

    quantized = parts["quantized_decode"]
    assert quantized["toy"]["int8"]["tokens_before_first_difference"] >= 0.9
    assert quantized["tiny"]["int8"]["weight_bytes"] < quantized["tiny"]["float32"]["weight_bytes"]
    assert "int4 runs on CUDA" in quantized["not_run"]["int4"]

    for case in ("essa", "fgrpo"):
        plan = parts["memory_plan"][case]
        assert plan["measured_peak_bytes"] > 0
        assert 1.0 <= plan["plan_over_measured"] <= 1.15

    reduce = parts["nccl_all_reduce"]
    assert reduce["one_rank"]["backend"] == "gloo" and reduce["one_rank"]["exact"]
    two = reduce["two_ranks"]
    assert two["outcome"] == "passed", two
    assert two["rank0"]["backend"] == "gloo" and two["rank0"]["ranks"] == 2
    assert two["rank0"]["max_abs_error"] <= 1e-6
    assert two["rank0"]["bytes_counted"] == two["rank0"]["bytes_expected"] > 0

    ratios = parts["backends"]["toy"]["backends"]  # every installed backend, the same work
    assert {"engine", "hf"} <= set(ratios) and set(ratios["hf"]) == {"essa", "fgrpo", "eval"}
    fsdp2 = parts["fsdp2_step"]
    assert fsdp2["float32"]["moved"] and fsdp2["float32"]["backend"] == "gloo"
    assert fsdp2["float32"]["relative_difference_to_unsharded_fp32"] <= 5e-5
    assert fsdp2["bfloat16"]["moved"]


@pytest.mark.subprocess
def test_a_part_whose_time_is_spent_is_skipped(tmp_path):
    from hpc.toys.toy import tiny_model

    tiny_model(save_dir=str(tmp_path / "model"))  # the check reads the folder only
    proc, report = run(tmp_path / "out", "--minutes", "0.001", "--toy", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(report["parts"]) == PARTS
    for part in report["parts"].values():
        assert part["verdict"] == "skipped"
        assert part["reason"].startswith("time budget spent")


@pytest.mark.parametrize("args,words", [
    (["--minutes", "0"], "--minutes must be a positive number"),
    (["--minutes", "nan"], "--minutes must be a positive number"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--toy", "/nonexistent"], "model folder not found: /nonexistent")])
@pytest.mark.subprocess
def test_bad_argument_is_one_line_and_exit_2(tmp_path, args, words):
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "out"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert words in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.toy
def test_graph_part_fails_when_the_replayed_step_is_not_the_eager_one(one_thread):
    """The CUDA-graph part on CPU with a stand-in "captured" step (tests/mpi/engine_job.py):
    the eager step itself passes; a perturbed one fails the self-check and the part."""
    from acceptance_parts import PartBudget, Setup, cuda_graphs
    from hpc.toys.toy import toy_model_path
    from mpi.engine_job import CheckedStep, PerturbedStep

    setup = Setup.for_device(torch.device("cpu"), toy_model_path())
    good = cuda_graphs(setup, PartBudget(600), replay=CheckedStep)
    assert good["verdict"] == "ok", good["reason"]
    assert good["toy"]["identical"] and good["toy"]["shapes_checked"] >= 1
    bad = cuda_graphs(setup, PartBudget(600), replay=PerturbedStep)
    assert bad["verdict"] == "FAILED"
    assert "toy: self-check failed: decode shape" in bad["reason"]
    assert not bad["tiny"]["replayed"] and bad["tiny"]["self_check_failure"]
