"""mpirun's session files: a killed launcher's leftovers must not stop a later launch.

Open MPI 5's mpirun keeps PMIx rendezvous files in <base>/ompi.<pid> (base: the MCA parameter
prte_tmpdir_base, else $TMPDIR, else /tmp). SIGKILL leaves them, and a later mpirun that is given
the same pid stops before starting any rank (exit 213). Pids come round again soon where pid_max
is 32768, so the test helpers, benchmarks.common.launch_mpi and the sbatch scripts give every
launch a base of its own.
"""
import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import MPI_ENV, PRTE_BASE, REPO, mpirun_path, require, run_mpi

LISTENER_FAILED = "The PMIx server's listener thread failed to start"
FIRST_PID = 300  # the kernel hands out pids from here once it wraps at pid_max


def killed_mpirun_leftovers(base) -> list:
    """The rendezvous files (paths) a SIGKILLed mpirun left in ``base``."""
    proc = subprocess.Popen([mpirun_path(), "-n", "1", "sleep", "60"], start_new_session=True,
                            env=dict(os.environ, **MPI_ENV, **{PRTE_BASE: str(base)}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    left = []
    try:
        for _ in range(200):
            left = glob.glob(os.path.join(base, f"ompi.{proc.pid}", "pmix.*"))
            if left:
                break
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # an orphaned `sleep`, if any
    return left


def every_pid() -> range:
    """Every pid a later process may get (the kernel wraps at pid_max to FIRST_PID)."""
    with open("/proc/sys/kernel/pid_max") as f:
        return range(FIRST_PID, int(f.read()))


@pytest.fixture
def stale_base(tmp_path):
    """A session base holding a killed mpirun's rendezvous files for every pid (hard links),
    so whatever pid the next mpirun gets (other processes take pids meanwhile) is stale."""
    require(mpirun_path() is not None, "mpirun")
    left = killed_mpirun_leftovers(tmp_path / "killed")
    assert left, "a killed mpirun left no session files: this Open MPI keeps them elsewhere"
    base = tmp_path / "stale"
    for pid in every_pid():
        os.makedirs(base / f"ompi.{pid}")
        for path in left:
            os.link(path, base / f"ompi.{pid}" / os.path.basename(path))
    return base


def plain_mpirun(base) -> subprocess.CompletedProcess:
    return subprocess.run([mpirun_path(), "-n", "1", "true"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **MPI_ENV, **{PRTE_BASE: str(base)}))


@pytest.mark.mpi
def test_a_killed_mpiruns_files_stop_a_later_mpirun_given_its_pid(stale_base):
    """The hazard itself, so that a change of Open MPI that removes it shows here."""
    proc = plain_mpirun(stale_base)
    assert proc.returncode == 213 and LISTENER_FAILED in proc.stderr, \
        (proc.returncode, proc.stderr[-1000:])


@pytest.mark.mpi
def test_the_test_helper_launches_beside_stale_session_files(stale_base, monkeypatch):
    """run_mpi under a TMPDIR full of stale session files: its own base (conftest) is fresh."""
    proc = run_mpi(2, ["-c", "print('rank up')"], env={"TMPDIR": str(stale_base)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("rank up") == 2


@pytest.mark.mpi
def test_benchmark_launches_beside_stale_session_files(stale_base, monkeypatch):
    """benchmarks.common.launch_mpi given the stale base by the environment still launches."""
    monkeypatch.setenv(PRTE_BASE, str(stale_base))
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    from common import launch_mpi

    launch_mpi(2, ["-c", "import sys; sys.exit(0)"])
    assert plain_mpirun(stale_base).returncode == 213  # the base was still stale


@pytest.mark.mpi
def test_the_sbatch_scripts_give_each_attempt_its_own_session_base(stale_base, tmp_path):
    """run_job (jobscripts/slurm/common.sh) as restart 1 of job 42, outside Slurm with the real
    mpirun, the site's base full of stale session files: mpirun keeps its session in
    <site base>/hpc-prte-42-1, which is gone when the job ends. The stand-in trainer lists the
    session folders while it runs (mpirun does not pass PRTE_MCA_* on to the ranks)."""
    from hpc.runtime.runstore import RunStore

    run = tmp_path / "runs" / "fgrpo-42"
    run.mkdir(parents=True)
    RunStore(str(run / "fgrpo.h5"), True, {"method": "fgrpo"}).close("complete")
    seen = tmp_path / "base-seen"
    trainer = tmp_path / "trainer"  # as a trainer (-m MODULE ...) it lists mpirun's bases
    trainer.write_text(f'#!/bin/sh\n[ "$1" = -m ] && {{ cd {stale_base} && ls -d hpc-prte-*/ompi.* '
                       f'> {seen}; exit 0; }}\nexec {sys.executable} "$@"\n')
    trainer.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text('source jobscripts/slurm/common.sh\nrun_job fgrpo fgrpo\n')
    env = dict(os.environ, **MPI_ENV)
    env.update(SLURM_JOB_ID="42", SLURM_RESTART_COUNT="1", SLURM_NTASKS="1", LAUNCHER="mpirun",
               PYTHON=str(trainer), RUN_ROOT=str(tmp_path / "runs"), OMPI_MCA_ras="^slurm",
               OMPI_MCA_plm="^slurm", **{PRTE_BASE: str(stale_base)})
    proc = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seen.read_text().startswith("hpc-prte-42-1/ompi."), seen.read_text()
    assert not (stale_base / "hpc-prte-42-1").exists()
