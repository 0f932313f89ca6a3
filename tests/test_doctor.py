"""hpc-doctor, the preflight: on 2 ranks under the real mpirun every check holds and every
rank's row is printed; each failure a cluster has is made for real on one rank (its own mount
namespace hiding the model folder or giving it another run root, HDF5's lock call failing as
on an NFS mount without lockd, a rendezvous address no rank can listen on) and ends with exit
2 and one line naming the rank's host and the fix, never a traceback. The checks' parts are
tested in process (the memory plan's verdict on CUDA, the free space, the grouping of lines).
The same across the nodes of a simulated Slurm cluster: tests/test_multinode.py.
"""
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import MPI_ENV, REPO, mpirun_path, our_lines, require, run_mpi
from hpc.doctor.bandwidth import bandwidth_rows, bus_factor
from hpc.doctor.command import doctor_job_class, main, method_configs
from hpc.doctor.findings import Finding, failure_lines, ranks_text
from hpc.doctor.inputs import (checkpoint_need, check_same_model, fingerprint,
                               model_folder_here, plan_verdicts)
from hpc.doctor.storage import check_free_space, check_hdf5_locking, run_root
from hpc.runtime.config import load_config

DOCTOR = ["-m", "hpc.doctor"]
# strace makes flock() fail as it fails on an NFS mount without a lock daemon
NO_LOCKS = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=flock",
            "-e", "inject=flock:error=ENOLCK"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model folder (config.json, weights, tokenizer) in a folder of its own, which a
    rank's mount namespace can hide."""
    from hpc.toys.toy import tiny_model

    folder = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model(save_dir=str(folder))
    return str(folder)


def doctor(model, root, *extra) -> list:
    return [*DOCTOR, f"model.path={model}", f"run.out={root}/{{method}}-{{jobid}}",
            "run.progress=false", *extra]


def hidden(folder: str, argv: list) -> list:
    """``argv`` in a mount namespace of its own where ``folder`` is an empty tmpfs: the same
    path, another folder, as on a node whose disk lacks it."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs none "{folder}" && exec "$@"', "sh", *argv]


def mpmd(rank0: list, rank1: list, env: dict | None = None):
    """Two ranks under mpirun, each with its own command line (an MPMD app context)."""
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    cmd = [mpirun, "--oversubscribe", "-n", "1", *rank0, ":", "-n", "1", *rank1]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, **MPI_ENV, **(env or {})))


def errors(proc) -> list:
    """The error lines of a doctor that must have exited 2 without a traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in our_lines(proc.stderr) if line.startswith("error")]


def verdicts(out: str) -> dict:
    """{check: (verdict, what was found)} from the doctor's table of checks."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check "))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("hpc-doctor:"))
    rows = [re.split(r"\s{2,}", line, maxsplit=2) for line in lines[start + 1:end]]
    return {name: (verdict, found) for name, verdict, found in rows}


def needs_mount_namespaces():
    require(os.geteuid() == 0 and shutil.which("unshare"),
            "root and unshare (a mount namespace per rank)")


@pytest.mark.mpi
def test_every_check_holds_on_two_ranks(model, tmp_path):
    proc = run_mpi(2, doctor(model, tmp_path / "runs"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows[:2]] == ["0", "1"] and [r[2] for r in rows[:2]] == ["0/2", "1/2"]
    assert all(r[3] == "cpu" and "MPI" in " ".join(r) for r in rows[:2]), out
    assert "busbw GB/s" in out and "gloo us" in out and "4 MiB" in out
    checks = verdicts(out)
    assert {"device", "MPI all-reduce", "rendezvous", "torch.distributed all-reduce", "run root",
            "HDF5 file locking", "model folder", "sft on 2 ranks", "essa on 2 ranks",
            "fgrpo on 2 ranks", "data files"} == set(checks)
    assert {verdict for verdict, _ in checks.values()} == {"ok"}, checks
    assert out.rstrip().endswith("hpc-doctor: every check holds")
    assert os.listdir(tmp_path / "runs") == []  # its probes and token removed


@pytest.mark.mpi
def test_model_folder_missing_on_one_rank(model, tmp_path):
    needs_mount_namespaces()
    argv = [sys.executable, *doctor(model, tmp_path / "runs")]
    proc = mpmd(argv, hidden(os.path.dirname(model), argv))
    lines = errors(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: model folder on ") and "(rank 1)" in lines[0]
    assert f"model folder not found: {model}" in lines[0] and "copy the same" in lines[0]


@pytest.mark.mpi
def test_run_root_a_different_folder_on_one_rank(model, tmp_path):
    needs_mount_namespaces()
    root = tmp_path / "runs"
    root.mkdir()
    argv = [sys.executable, *doctor(model, root)]
    lines = errors(mpmd(argv, hidden(str(root), argv)))
    assert len(lines) == 1 and "(rank 1)" in lines[0], lines
    assert "is not the folder rank 0 wrote to" in lines[0] and "same path" in lines[0]


@pytest.mark.mpi
def test_hdf5_locking_that_fails_names_the_variable_that_fixes_it(model, tmp_path):
    require(shutil.which("strace") is not None, "strace (to make flock fail)")
    argv = [sys.executable, *doctor(model, tmp_path / "runs")]
    lines = errors(mpmd(argv, NO_LOCKS + argv))
    assert len(lines) == 1 and "(rank 1)" in lines[0], lines
    assert lines[0].startswith("error: HDF5 file locking on ") and "No locks available" in lines[0]
    assert "export HDF5_USE_FILE_LOCKING=FALSE" in lines[0]
    fixed = mpmd(argv, NO_LOCKS + argv, env={"HDF5_USE_FILE_LOCKING": "FALSE"})
    assert fixed.returncode == 0, fixed.stderr
    assert "off (HDF5_USE_FILE_LOCKING=FALSE)" in fixed.stdout


@pytest.mark.subprocess
def test_a_job_whose_run_file_cannot_be_locked_names_the_same_fix(tmp_path):
    require(shutil.which("strace") is not None, "strace (to make flock fail)")
    code = ("from hpc.runtime.runstore import RunStore\nfrom hpc.runtime.errors import UserError\n"
            f"try:\n    RunStore({str(tmp_path / 'x.h5')!r}, True, {{}})\n"
            "except UserError as err:\n    print(err)\n")
    proc = subprocess.run(NO_LOCKS + [sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.startswith(f"cannot write the run file {tmp_path / 'x.h5'}: No locks "
                                  f"available; this file system refuses HDF5's file locks: "
                                  f"export HDF5_USE_FILE_LOCKING=FALSE"), proc


@pytest.mark.mpi
def test_a_rendezvous_address_no_rank_can_use_is_one_line(model, tmp_path):
    """MASTER_ADDR names an address of no interface of rank 0's host (TEST-NET-2): the ranks
    cannot meet; the other checks still run."""
    proc = run_mpi(2, doctor(model, tmp_path / "runs"), env={"MASTER_ADDR": "198.51.100.7"},
                   timeout=300)
    lines = errors(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: rendezvous: ") and "198.51.100.7" in lines[0]
    assert "set MASTER_ADDR to an address of" in lines[0]
    checks = verdicts(proc.stdout)
    assert checks["rendezvous"][0] == "FAILED"
    assert checks["torch.distributed all-reduce"] == ("ok", "not run")
    assert checks["model folder"][0] == checks["run root"][0] == "ok"


@pytest.mark.mpi
def test_the_job_scripts_run_it_as_they_run_a_job(model, tmp_path):
    """run_doctor (jobscripts/slurm/common.sh, doctor.sbatch's body) as job 42 outside Slurm,
    under the real mpirun on this machine's slots: the run root checked is RUN_ROOT."""
    require(mpirun_path() is not None, "mpirun")
    script = tmp_path / "job.sh"
    script.write_text('source jobscripts/slurm/common.sh\nrun_doctor "$@"\n')
    env = dict(os.environ, **MPI_ENV, SLURM_JOB_ID="42", LAUNCHER="mpirun",
               PYTHON=sys.executable, RUN_ROOT=str(tmp_path / "runs"), OMPI_MCA_ras="^slurm",
               OMPI_MCA_plm="^slurm")
    proc = subprocess.run(["bash", str(script), f"model.path={model}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"-m hpc.doctor model.path={model} run.out={tmp_path}/runs/doctor-42" in proc.stdout
    assert verdicts(proc.stdout)["run root"][1].startswith(f"{tmp_path}/runs ")


def test_run_root_is_where_run_folders_are_made():
    assert run_root("runs/{method}-{jobid}") == "runs"
    assert run_root("/scratch/me/{jobid}/{method}") == "/scratch/me"
    assert run_root("/scratch/run1") == "/scratch"
    assert run_root("run1") == "."


def test_failure_lines_name_hosts_and_ranks_once_per_finding():
    found = Finding("model folder", "model folder not found: /m", "copy it").as_dict()
    wide = Finding("rendezvous", "rank 2 on node2 cannot connect", "", job_wide=True).as_dict()
    lines = failure_lines([[wide], [], [found], [found]], ["node1", "node1", "node2", "node2"])
    assert lines == ["error: rendezvous: rank 2 on node2 cannot connect",
                     "error: model folder on node2 (ranks 2-3): model folder not found: /m; "
                     "copy it"]
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_busbw_is_nccl_tests_all_reduce_bus_bandwidth():
    assert bus_factor(2) == 1.0 and bus_factor(8) == 1.75
    head, rows = bandwidth_rows([1 << 20], {"MPI": [(1e-3, 1)]}, 8, ["a", "b"])
    cells = dict(zip(head, rows[0]))
    assert (cells["size"], cells["algbw GB/s"], cells["busbw GB/s"], cells["slowest"]) == \
        ("1 MiB", "1.049", "1.835", "1 (b)")


def test_a_model_that_differs_from_rank_0s_is_named(model, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert check_same_model(fingerprint(str(copy)), fingerprint(model)) == []
    (copy / "tokenizer_config.json").write_text("{}")
    (copy / "model.safetensors").write_bytes(b"0")
    found = check_same_model(fingerprint(str(copy)), fingerprint(model))
    assert [f.problem for f in found] == \
        ["differs from rank 0's in model.safetensors, tokenizer_config.json"]
    assert model_folder_here(str(tmp_path / "none"))[1][0].problem.startswith(
        "model folder not found")


def configs(model, *overrides):
    cfg = load_config(doctor_job_class(), None, [f"model.path={model}", *overrides])
    return cfg, method_configs(cfg)[0]


def test_the_memory_plan_verdict_as_a_job_on_cuda_gives_it(model):
    world = SimpleNamespace(size=2, rank=0)
    cfg, jobs = configs(model, "plan.gpu_memory_gib=0.01")
    found = plan_verdicts(jobs, world, "cuda")
    assert sorted(f.check for f in found) == ["essa on 2 ranks", "fgrpo on 2 ranks"]
    assert all(f.problem.startswith("memory plan: ") and "to fit:" in f.problem for f in found)
    assert plan_verdicts(jobs, world, "cpu") == []  # the jobs plan on CUDA only
    assert plan_verdicts(configs(model)[1], world, "cuda") == []
    _, few = configs(model, "fgrpo.batch_prompts=1")
    assert [f.problem for f in plan_verdicts(few, world, "cpu")] == \
        ["fgrpo.batch_prompts=1 is smaller than the 2 ranks"]


def test_free_space_against_the_checkpoints_of_the_run(model, tmp_path):
    from hpc.engine.shape import ModelShape

    cfg, jobs = configs(model, "run.min_free_mb=0")
    lora = ModelShape.from_folder(model).lora_parameters(cfg.lora.rank, cfg.lora.targets)
    need, why = checkpoint_need(cfg, jobs, model)
    assert need == 4 * lora * 12 + lora * 4 and "4 checkpoints" in why  # 3 kept + 1 written
    full_cfg, full = configs(model, "fgrpo.full_finetune=true", "run.min_free_mb=0")
    assert checkpoint_need(full_cfg, full, model)[0] > need
    assert checkpoint_need(*configs(model, "run.min_free_mb=10")[:2], model) == \
        (10 * 2 ** 20, "run.min_free_mb=10")
    assert check_free_space(str(tmp_path), need, why) == []
    found = check_free_space(str(tmp_path), 1 << 60, "a lot")
    assert "the run needs about" in found[0].problem and "a lot" in found[0].problem
    assert check_hdf5_locking(str(tmp_path)) == [] and os.listdir(tmp_path) == []


def test_a_config_mistake_is_one_line_before_any_rank_work(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["model.pth=x"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config key 'model.pth'"), err
