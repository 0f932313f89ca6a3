"""The Slurm job scripts, for real: a one-node Slurm (jobscripts/local-slurm/start.sh), the
sbatch scripts submitted at 2 ranks on the toy model, the results read back with h5py.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge: skipped where they are
absent, failed under HPC_TEST_STRICT=1 (CI). LAUNCHER=srun also needs libpmix-dev. The sweep
dry run needs no Slurm.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import h5py
import pytest

from conftest import MPI_ENV, REPO, mpirun_path, require
from hpc.runtime.runstore import RunFile

START = os.path.join(REPO, "jobscripts", "local-slurm", "start.sh")
STOP = os.path.join(REPO, "jobscripts", "local-slurm", "stop.sh")
SWEEP = os.path.join(REPO, "jobscripts", "sweep.sh")
SLURM_DIR = os.environ.get("HPC_SLURM_DIR", "/tmp/hpc-slurm")
TINY_SFT = ["sft.steps=2", "task.n_train=64", "task.n_eval=16", "eval.n_samples=2"]
SWEEP_VARS = ("GPU_COUNTS", "GPUS_PER_NODE", "METHODS", "SBATCH_ARGS", "RUN_ROOT")
# F-GRPO on the toy model, 2 ranks: a fresh LoRA, ~0.3 s a step on 2 CPU cores, so the job is
# still well inside its 40 steps when signalled after 3; checkpoints only at the stop and the end.
FGRPO_PREEMPT = ["model.path=toy", "fgrpo.steps=40", "fgrpo.batch_prompts=32",
                 "fgrpo.sampling.num_generations=8", "task.n_train=200", "task.n_eval=16",
                 "eval.every=0", "eval.n_samples=2", "run.checkpoint_every=0",
                 "run.progress=false"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

# Stand-in for a trainer, started by the job scripts as `$PYTHON -m MODULE ARGS...`: it keeps
# the trainers' preemption contract (SIGUSR1 or SIGTERM: checkpoint, exit 3; --resume: carry
# on) and records each start, so the tests see what the scripts did around it.
STAND_IN = """
import os, signal, sys, time
if sys.argv[1] == "-c":  # the scripts' check of the interpreter: run it as python would
    exec(sys.argv[2])
    sys.exit(0)
args = sys.argv[3:]
out = next(a.split("=", 1)[1] for a in args if a.startswith("run.out="))
rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["SLURM_PROCID"]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "starts"), "a") as fh:
    fh.write(f"{rank} {'resume' if '--resume' in args else 'fresh'} "
             f"{os.environ.get('SLURM_RESTART_COUNT', '0')}\\n")
if "--resume" in args:
    sys.exit(0)

def checkpoint_and_stop(signum, frame):
    time.sleep(1.5)  # the step in flight ends first
    os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
    open(os.path.join(out, "checkpoints", "step-00000001.safetensors"), "w").close()
    sys.exit(3)

signal.signal(signal.SIGUSR1, checkpoint_and_stop)
signal.signal(signal.SIGTERM, checkpoint_and_stop)
open(os.path.join(out, f"ready-{rank}"), "w").close()
time.sleep(300)
sys.exit(1)
"""


def _alive(pidfile: str) -> bool:
    try:
        with open(pidfile) as fh:
            os.kill(int(fh.read()), 0)
        return True
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module")
def slurm():
    """Environment for sbatch and scontrol on the local Slurm, started here if not running.

    Jobs inherit it (--export=ALL): this interpreter's folder first on PATH (its mpirun) and
    as PYTHON, offline Hugging Face, Open MPI allowed to run as root, LAUNCHER=mpirun.
    """
    sbin = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    missing = [c for c in ("sbatch", "scontrol", "slurmctld", "slurmd", "munged")
               if shutil.which(c, path=sbin) is None]
    require(not missing, f"Slurm ({', '.join(missing)})")
    require(os.geteuid() == 0, "root (to start the local Slurm)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(MPI_ENV, SLURM_CONF=f"{SLURM_DIR}/slurm.conf", PYTHON=sys.executable,
               LAUNCHER="mpirun",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    was_up = _alive(f"{SLURM_DIR}/slurmctld.pid") and _alive(f"{SLURM_DIR}/slurmd.pid")
    proc = subprocess.run(["bash", START], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield env
    if not was_up:
        subprocess.run(["bash", STOP], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def toy_model(slurm):
    """Build the cached toy model if absent (2-3 minutes) before any job, not inside one."""
    proc = subprocess.run([sys.executable, "-m", "hpc.toys.toy"], env=slurm, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def job_info(env, jobid, timeout=120) -> dict:
    """``scontrol show job``'s fields of ``jobid``. slurmctld answers late on a busy machine
    ("Socket timed out on send/recv operation", no fields): asked again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(["scontrol", "show", "job", "-o", jobid], env=env,
                              capture_output=True, text=True, timeout=60)
        info = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        if "JobState" in info:
            return info
        assert time.monotonic() < deadline, \
            f"scontrol show job {jobid} gave no state for {timeout} s: {proc.stderr}"
        time.sleep(1)


def sbatch(env, method, args, out_dir, wait=True, **variables):
    """Submit jobscripts/slurm/METHOD.sbatch at 2 ranks; (exit code if waited, job id).

    Waits by polling scontrol, as `sbatch --wait` backs off to polls half a minute apart.
    """
    cmd = ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={out_dir}/slurm-%x-%j.out",
           "--ntasks-per-node=2", "--gpus-per-node=2", "--export=ALL",
           f"jobscripts/slurm/{method}.sbatch", *args]
    proc = subprocess.run(cmd, env=dict(env, RUN_ROOT=str(out_dir), **variables), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    jobid = proc.stdout.split(";")[0].strip()
    if not wait:
        return None, jobid
    wait_for(lambda: job_info(env, jobid)["JobState"] in ENDED, 900, f"job {jobid} to end")
    return int(job_info(env, jobid)["ExitCode"].split(":")[0]), jobid


def job_log(out_dir, method, jobid) -> str:
    path = os.path.join(out_dir, f"slurm-{method}-{jobid}.out")
    if not os.path.exists(path):
        return "(no job log)"
    with open(path) as fh:
        return fh.read()


def wait_for(condition, timeout, what):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


def srun_pmix_works(env) -> bool:
    """srun can start 2 MPI ranks of this interpreter that see each other."""
    proc = subprocess.run(
        ["srun", "--mpi=pmix", "-n", "2", "--gpus-per-node=0", sys.executable, "-c",
         "from mpi4py import MPI; print(MPI.COMM_WORLD.allreduce(1))"],
        env=dict(env, PMIX_MCA_psec="native"), capture_output=True, text=True, timeout=120)
    return proc.returncode == 0 and proc.stdout.split() == ["2", "2"]


def _sweep(args, tmp_path, **variables):
    # An sbatch that only records its calls: a dry run must not submit anything.
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho called >> {tmp_path}/sbatch-calls\nexit 1\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SWEEP_VARS}
    env.update(variables, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", SWEEP, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert not (tmp_path / "sbatch-calls").exists()
    return proc


@pytest.mark.subprocess
def test_sweep_dry_run_prints_one_sbatch_line_per_size_and_method(tmp_path):
    proc = _sweep(["--dry-run", "configs/exp.yaml", "task.ops=+-*", "run.seed=3"], tmp_path,
                  RUN_ROOT="runs/sweep-test")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 8
    seen = []
    for line in lines:
        env_word, *argv = shlex.split(line)
        assert env_word == "RUN_ROOT=runs/sweep-test"
        assert argv[0] == "sbatch"
        at = next(i for i, a in enumerate(argv) if a.endswith(".sbatch"))
        opts = dict(a[2:].split("=", 1) for a in argv[1:at])
        gpus = int(opts["ntasks"])
        assert opts["nodes"] == str(gpus // 8)
        assert opts["ntasks-per-node"] == opts["gpus-per-node"] == "8"
        assert opts["export"] == "ALL"
        assert argv[at + 1:] == ["configs/exp.yaml", "task.ops=+-*", "run.seed=3"]
        method = re.fullmatch(r"jobscripts/slurm/(\w+)\.sbatch", argv[at]).group(1)
        assert opts["job-name"] == f"{method}-{gpus}g"
        seen.append((method, gpus))
    assert sorted(seen) == [(m, g) for m in ("essa", "fgrpo") for g in (16, 32, 64, 128)]


@pytest.mark.subprocess
def test_sweep_gives_each_method_its_own_section_keys(tmp_path):
    """A job refuses another method's key on its command line, so the sweep sends each key of
    a method's section to that method's jobs only, and refuses one no job of it would read."""
    proc = _sweep(["--dry-run", "configs/exp.yaml", "essa.population=8", "run.seed=3",
                   "fgrpo.advantage.gamma=2"], tmp_path, GPU_COUNTS="16")
    assert proc.returncode == 0, proc.stderr
    tails = {re.search(r"slurm/(\w+)\.sbatch", line).group(1): line.split(".sbatch ")[1]
             for line in proc.stdout.splitlines()}
    assert tails == {"essa": "configs/exp.yaml essa.population=8 run.seed=3",
                     "fgrpo": "configs/exp.yaml run.seed=3 fgrpo.advantage.gamma=2"}
    (tmp_path / "again").mkdir()
    proc = _sweep(["--dry-run", "sft.steps=3"], tmp_path / "again", GPU_COUNTS="16")
    assert proc.returncode == 2 and proc.stdout == "" and "sft.steps=3" in proc.stderr


@pytest.mark.subprocess
def test_sweep_passes_run_root_with_a_comma_through_the_environment(tmp_path):
    """Inside --export=ALL,RUN_ROOT=... a comma ended the value and injected a variable."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nprintf "%s|%s|%s\\n" "$RUN_ROOT" "${{EVIL:-unset}}" "$*" '
                    f'>> {tmp_path}/sbatch-calls\necho 42\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SWEEP_VARS}
    env.update(PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", GPU_COUNTS="8",
               METHODS="essa", RUN_ROOT="runs/a,EVIL=1")
    proc = subprocess.run(["bash", SWEEP], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    run_root, evil, args = (tmp_path / "sbatch-calls").read_text().strip().split("|")
    assert (run_root, evil) == ("runs/a,EVIL=1", "unset")
    assert "--export=ALL " in args + " " and "EVIL" not in args


@pytest.mark.subprocess
def test_sweep_rejects_a_partial_node_before_printing_anything(tmp_path):
    proc = _sweep(["--dry-run"], tmp_path, GPU_COUNTS="16 12", GPUS_PER_NODE="8")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "12 GPUs" in proc.stderr


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
@pytest.mark.slurm
@pytest.mark.toy
def test_sft_job_writes_its_run_file(slurm, toy_model, tmp_path, launcher):
    if launcher == "srun":
        require(srun_pmix_works(slurm), "srun --mpi=pmix (Debian: apt-get install libpmix-dev)")
    rc, jobid = sbatch(slurm, "sft", TINY_SFT, tmp_path, LAUNCHER=launcher)
    log = job_log(tmp_path, "sft", jobid)
    assert rc == 0, log[-4000:]
    assert f"+ {launcher} " in log
    assert job_info(slurm, jobid)["JobState"] == "COMPLETED"
    run = tmp_path / f"sft-{jobid}"
    with h5py.File(run / "sft.h5", "r") as f:
        assert f.attrs["method"] == "sft"
        assert f.attrs["status"] == "complete"
        assert int(f.attrs["world_size"]) == 2
        assert {"metrics", "timings", "bytes", "eval"} <= set(f)
        assert len(f["metrics/loss"]) == 2  # sft.steps=2
        assert f["timings/forward_backward"].shape == (2, 2)  # one column per rank
        assert len(f["eval/accuracy"]) == 2  # before and after training
    assert (run / "adapter").is_dir()


@pytest.mark.parametrize("method", ["sft", "essa", "fgrpo", "eval"])
@pytest.mark.slurm
@pytest.mark.toy
def test_user_error_fails_the_job_and_is_not_requeued(slurm, tmp_path, method):
    rc, jobid = sbatch(slurm, method, ["run.seed=-1"], tmp_path)
    log = job_log(tmp_path, method, jobid)
    assert rc == 2, log[-4000:]
    assert "run.seed" in log and "Traceback" not in log
    info = job_info(slurm, jobid)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "0", "2:0")


def _start_stand_in(env, tmp_path, launcher):
    trainer = tmp_path / "trainer"
    trainer.write_text(f"#!{sys.executable}\n{STAND_IN}")
    trainer.chmod(0o755)
    runs = tmp_path / "runs"
    runs.mkdir()  # Slurm does not create the folder of the job log
    # The stand-in uses no MPI, so srun needs no PMIx here: this runs in CI as it is.
    _, jobid = sbatch(env, "fgrpo", ["fgrpo.steps=5"], runs, wait=False, PYTHON=str(trainer),
                      LAUNCHER=launcher, SRUN_MPI="none")
    run = runs / f"fgrpo-{jobid}"

    def ready():
        assert job_info(env, jobid)["JobState"] in ("PENDING", "RUNNING"), job_log(runs, "fgrpo",
                                                                                  jobid)
        return all((run / f"ready-{r}").exists() for r in (0, 1))

    wait_for(ready, 300, "both ranks")
    return jobid, run, runs


def _starts(run) -> list:
    return sorted(tuple(line.split()) for line in (run / "starts").read_text().splitlines())


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
@pytest.mark.slurm
@pytest.mark.toy
def test_usr1_before_time_limit_checkpoints_requeues_and_resumes(slurm, tmp_path, launcher):
    jobid, run, runs = _start_stand_in(slurm, tmp_path, launcher)
    # What Slurm does at `--signal=B:USR1@120`: SIGUSR1 to the batch shell alone.
    subprocess.run(["scancel", "--signal=USR1", "--batch", jobid], env=slurm, check=True)

    def requeued():
        info = job_info(slurm, jobid)
        return (info["JobState"], info["Restarts"]) == ("PENDING", "1")

    wait_for(requeued, 120, "the requeue")
    # Slurm holds a requeued job for about two minutes before it may start again; not at once
    # either (see the F-GRPO requeue test below: slurmd's one-second credential resolution).
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], env=slurm,
                   check=True)
    wait_for(lambda: job_info(slurm, jobid)["JobState"] in ENDED, 300, "the requeued job to end")
    log = job_log(runs, "fgrpo", jobid)
    assert job_info(slurm, jobid)["JobState"] == "COMPLETED", log
    # Each rank: started fresh, was requeued (restart 1) into the same folder with --resume.
    assert _starts(run) == [("0", "fresh", "0"), ("0", "resume", "1"),
                            ("1", "fresh", "0"), ("1", "resume", "1")]
    assert "fgrpo.steps=5 run.out=" in log and log.count("--resume") == 1
    assert "requeueing" in log


@pytest.mark.slurm
@pytest.mark.toy
def test_cancelled_job_stays_cancelled_despite_checkpoint_exit(slurm, tmp_path):
    # srun passes Slurm's SIGTERM to the ranks, which then checkpoint and exit 3.
    jobid, run, runs = _start_stand_in(slurm, tmp_path, "srun")
    subprocess.run(["scancel", jobid], env=slurm, check=True)
    wait_for(lambda: job_info(slurm, jobid)["JobState"] == "CANCELLED", 120, "the cancel")
    time.sleep(5)  # time enough for a wrong `scontrol requeue` to have brought it back
    info = job_info(slurm, jobid)
    log = job_log(runs, "fgrpo", jobid)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log
    assert "stopped by SIGTERM" in log
    assert [s[1] for s in _starts(run)] == ["fresh", "fresh"]


@pytest.mark.subprocess
def test_python_is_the_environment_of_essa_on_path_else_one_line(tmp_path):
    """PYTHON unset: the python beside the `essa` found on PATH. One whose environment lacks
    torch and the rest (a bare venv holding an `essa` script) stops the job in one line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    here = os.path.dirname(sys.executable)
    require(os.path.exists(os.path.join(here, "essa")), "the essa command beside this python")
    found = subprocess.run(["bash", "-c", "source jobscripts/slurm/common.sh && package_python"],
                           cwd=REPO, env=dict(env, PATH=f"{here}:{env['PATH']}"),
                           capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == os.path.join(here, "python"), found.stderr
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)
    (bare / "bin" / "essa").write_text("#!/bin/sh\n")
    (bare / "bin" / "essa").chmod(0o755)
    proc = subprocess.run(["bash", "-c", "source jobscripts/slurm/common.sh && "
                           "SLURM_JOB_ID=7 run_job fgrpo fgrpo"], cwd=REPO,
                          env=dict(env, PATH=f"{bare}/bin:{env['PATH']}"), capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc
    assert lines[0].startswith(f"error: {bare}/bin/python cannot import torch mpi4py h5py "
                               f"transformers: set PYTHON to the python of the environment")


def _job_outside_slurm(tmp_path, trainer_text: str) -> tuple:
    """(script, env) that run run_job (common.sh) as job 42 of 2 ranks outside Slurm, under
    the real mpirun, with ``trainer_text`` as the interpreter PYTHON; runs go to
    ``tmp_path/runs``."""
    require(mpirun_path() is not None, "mpirun")
    trainer = tmp_path / "trainer"
    trainer.write_text(trainer_text)
    trainer.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text('source jobscripts/slurm/common.sh\nrun_job fgrpo fgrpo "fgrpo.steps=5"\n')
    env = dict(os.environ, **MPI_ENV)
    env.update(SLURM_JOB_ID="42", SLURM_NTASKS="2", LAUNCHER="mpirun", PYTHON=str(trainer),
               RUN_ROOT=str(tmp_path / "runs"), OMPI_MCA_ras="^slurm", OMPI_MCA_plm="^slurm",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    return script, env


@pytest.mark.mpi
def test_term_trap_passes_sigusr1_to_mpirun_so_the_step_finishes(tmp_path):
    """run_job (common.sh) outside Slurm, with the real mpirun: SIGTERM to the batch shell must
    reach the ranks as SIGUSR1. The trap used to pass SIGTERM on, and PRRTE's mpirun SIGKILLs
    its ranks 0.25 s after forwarding SIGTERM, so the stand-in (1.5 s to finish its step) died
    without a checkpoint."""
    script, env = _job_outside_slurm(tmp_path, f"#!{sys.executable}\n{STAND_IN}")
    run = tmp_path / "runs" / "fgrpo-42"
    proc = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: all((run / f"ready-{r}").exists() for r in (0, 1)) or
                 proc.poll() is not None, 120, "both ranks")
        proc.send_signal(signal.SIGTERM)  # to the batch shell alone, as scancel --batch does
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, log
    assert "stopped by SIGTERM with a checkpoint" in log
    assert (run / "checkpoints" / "step-00000001.safetensors").exists()


@pytest.mark.parametrize("status,rc", [("preempted", 1), ("running", 1), ("complete", 0)])
@pytest.mark.mpi
def test_launcher_exit_0_counts_as_done_only_when_the_run_file_says_complete(tmp_path, status,
                                                                              rc):
    """run_job (common.sh) outside Slurm, with the real mpirun: ranks that exit 0 at once
    (as when srun's launch aborted on a requeue: it exited 0 and the job said "done") leave
    the run file as it was. Only a run file that says complete is "done"; else exit 1 and one
    line saying how to resume. The interpreter PYTHON is also what reads the run file."""
    from hpc.runtime.runstore import RunStore

    run = tmp_path / "runs" / "fgrpo-42"
    run.mkdir(parents=True)
    store = RunStore(str(run / "fgrpo.h5"), True, {"method": "fgrpo"})
    store.close(status)
    # as a trainer (-m MODULE ...) it does nothing; otherwise it is the real interpreter
    script, env = _job_outside_slurm(
        tmp_path, f"#!/bin/sh\n[ \"$1\" = -m ] && exit 0\nexec {sys.executable} \"$@\"\n")
    proc = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    if rc:
        assert f"says '{status}': the ranks did not finish" in proc.stderr
        assert "scontrol requeue 42" in proc.stderr and "done:" not in proc.stdout
    else:
        assert f"done: {tmp_path / 'runs'}/fgrpo-42" in proc.stdout


@pytest.mark.slurm
@pytest.mark.toy
def test_sigterm_to_the_batch_shell_lets_mpirun_ranks_finish_the_step(slurm, tmp_path):
    """The TERM trap used to pass SIGTERM to mpirun, which (PRRTE) SIGKILLs its ranks 0.25 s
    after SIGTERM: the step in flight was lost. It now sends SIGUSR1."""
    jobid, run, runs = _start_stand_in(slurm, tmp_path, "mpirun")
    subprocess.run(["scancel", "--signal=TERM", "--batch", jobid], env=slurm, check=True)
    wait_for(lambda: job_info(slurm, jobid)["JobState"] in ENDED, 120, "the job to end")
    time.sleep(5)  # time enough for a wrong `scontrol requeue` to have brought it back
    info = job_info(slurm, jobid)
    log = job_log(runs, "fgrpo", jobid)
    assert (info["Restarts"], info["ExitCode"]) == ("0", "3:0"), log
    assert "stopped by SIGTERM with a checkpoint" in log
    assert (run / "checkpoints" / "step-00000001.safetensors").exists()


@pytest.mark.slurm
@pytest.mark.toy
def test_user_error_after_mpi_start_under_srun_exits_2(slurm, toy_model, tmp_path):
    """srun --kill-on-bad-exit SIGTERMs the slower ranks of an agreed exit: 143 instead of 2."""
    require(srun_pmix_works(slurm), "srun --mpi=pmix (Debian: apt-get install libpmix-dev)")
    rc, jobid = sbatch(slurm, "essa", ["model.path=toy", f"lora.adapter={tmp_path}/missing",
                                       "run.progress=false"], tmp_path, LAUNCHER="srun")
    log = job_log(tmp_path, "essa", jobid)
    assert rc == 2, log[-4000:]
    assert "adapter folder not found" in log and "Traceback" not in log
    info = job_info(slurm, jobid)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "0", "2:0")


def _metric_steps(path) -> list:
    """metrics/step of a run file, also of a running job's ([] until readable)."""
    try:
        return [int(s) for s in RunFile(str(path)).group("metrics").get("step", [])]
    except (OSError, KeyError, ValueError, RuntimeError):  # not there yet, or read mid-flush
        return []


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
@pytest.mark.slurm
@pytest.mark.toy
@pytest.mark.slow
def test_fgrpo_job_preempted_by_usr1_resumes_to_all_steps_without_gap(slurm, toy_model, tmp_path,
                                                                      launcher):
    if launcher == "srun":
        require(srun_pmix_works(slurm), "srun --mpi=pmix (Debian: apt-get install libpmix-dev)")
    _, jobid = sbatch(slurm, "fgrpo", FGRPO_PREEMPT, tmp_path, wait=False, LAUNCHER=launcher)
    run = tmp_path / f"fgrpo-{jobid}"
    h5 = run / "fgrpo.h5"

    def three_steps():
        assert job_info(slurm, jobid)["JobState"] in ("PENDING", "RUNNING"), \
            job_log(tmp_path, "fgrpo", jobid)[-4000:]
        return len(_metric_steps(h5)) >= 3

    wait_for(three_steps, 300, "3 F-GRPO steps")
    # What Slurm does at `--signal=B:USR1@120`: SIGUSR1 to the batch shell alone.
    subprocess.run(["scancel", "--signal=USR1", "--batch", jobid], env=slurm, check=True)

    def requeued():
        info = job_info(slurm, jobid)
        assert info["JobState"] not in ENDED, job_log(tmp_path, "fgrpo", jobid)[-4000:]
        return (info["JobState"], info["Restarts"]) == ("PENDING", "1")

    wait_for(requeued, 120, "the requeue")
    # Held before its restart (see below): the first attempt's files, as it left them.
    first = job_log(tmp_path, "fgrpo", jobid)
    stopped = re.search(r"preempted after step (\d+)", first)
    assert stopped, first[-4000:]
    n = int(stopped.group(1))
    assert 3 <= n < 40, first[-4000:]
    assert f"requeueing job {jobid}" in first, first[-4000:]
    with h5py.File(h5, "r", locking=False) as f:
        assert f.attrs["status"] == "preempted"
        assert list(f["metrics/step"][:]) == list(range(1, n + 1))
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*.safetensors")) == \
        [f"step-{n:08d}.safetensors"]

    # Slurm holds a requeued job for about two minutes before it may start again. Not at once
    # though: slurmd rejects ("Job credential revoked") a credential issued in the same second
    # (its resolution) as it revoked the first attempt's, and the job then fails. On a loaded
    # machine slurmd takes that revocation in late: 2 s once let srun's launch abort (exit 0).
    time.sleep(5)
    subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], env=slurm,
                   check=True)
    wait_for(lambda: job_info(slurm, jobid)["JobState"] in ENDED, 300, "the requeued job to end")
    log = job_log(tmp_path, "fgrpo", jobid)
    info = job_info(slurm, jobid)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), \
        log[-4000:]
    attempts = log.split(f"job {jobid} (restart 1)")
    assert len(attempts) == 2, log[-4000:]
    assert f"preempted after step {n}" in attempts[0] and "--resume" not in attempts[0]
    assert "preempted after step" not in attempts[1]
    assert re.search(rf"\+ {launcher} .* -m fgrpo .*run\.out=\S+ --resume\n", attempts[1]), \
        attempts[1][-4000:]
    with h5py.File(h5, "r") as f:
        assert f.attrs["status"] == "complete"
        assert int(f.attrs["steps_done"]) == 40
        assert list(f["metrics/step"][:]) == list(range(1, 41))  # no gap, no step twice
        assert list(f["timings/step"][:]) == list(range(1, 41))
        assert list(f["eval/step"][:]) == [-1, 40]  # the start evaluation only once
    assert (run / "adapter").is_dir()


@pytest.mark.subprocess
def test_a_restart_without_its_gpus_is_requeued_once_then_names_the_fix(tmp_path):
    """requeue_without_gpus (common.sh), outside Slurm with scontrol recorded: a restart that
    asked for GPUs and holds none (Slurm before 23.02.2 after a lost node) is requeued once
    (exit 3); a second such restart ends with exit 1 and the line naming the fix; a restart
    that holds its GPUs, a first start and a job without GPUs go on (exit 0)."""
    calls = tmp_path / "scontrol-calls"
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (tmp_path / "scontrol").chmod(0o755)
    run = tmp_path / "runs" / "fgrpo-42"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", SLURM_JOB_ID="42")

    def check(**variables) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", 'source jobscripts/slurm/common.sh && '
                               'requeue_without_gpus "$1"', "-", str(run)], cwd=REPO,
                              env=dict(env, **variables), capture_output=True, text=True,
                              timeout=60)

    lost = dict(SLURM_RESTART_COUNT="1", SLURM_GPUS_PER_NODE="2")
    first = check(**lost)
    assert first.returncode == 3, first.stderr
    assert first.stderr.startswith("restart 1 of job 42 holds none of its GPUs"), first.stderr
    assert calls.read_text() == "requeue 42\n"
    again = check(**lost)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 1 and len(lines) == 1, again.stderr
    assert "'scontrol reconfigure'" in lines[0] and "scontrol requeue 42" in lines[0]
    for fine in (dict(lost, SLURM_GPUS_ON_NODE="2"), dict(lost, SLURM_RESTART_COUNT="0"),
                 dict(lost, SLURM_GPUS_PER_NODE="0")):
        proc = check(**fine)
        assert proc.returncode == 0 and proc.stderr == "", (fine, proc.stderr)
    assert calls.read_text() == "requeue 42\n"
    assert not (run / ".requeued-without-gpus").exists()  # cleared once GPUs were held
