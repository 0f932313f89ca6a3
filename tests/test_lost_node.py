"""A node lost mid-run, for real: on a simulated 2-node Slurm cluster (tests/test_multinode.py's,
brought up for this module with its own subnet, ports and names, so that it runs beside that
module's), an F-GRPO job whose second node's link goes down ends with the requeue code within
its collective timeout, Slurm marks the node DOWN, and the requeued job resumes to the result
of an uninterrupted run, bitwise.

Needs what tests/test_multinode.py needs (root, Debian's Slurm, munge and libpmix-dev).
"""
import os
import subprocess
import time

import h5py
import pytest

from test_multinode import (EVAL, SETTINGS, assert_same_run, completed, simulated_cluster,
                            submit, wait_ended)
from test_multinode import toy_model  # noqa: F401  (the fixture, on this module's cluster)
from test_slurm import ENDED, job_info, job_log, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.toy]

# Apart from test_multinode.py's cluster (10.221.7, 6927, hpct), which may be up at the same
# time; the same variables in the environment move them.
LOST_SETTINGS = dict(SETTINGS,
                     HPC_CLUSTER_NET=os.environ.get("HPC_LOST_CLUSTER_NET", "10.221.8"),
                     HPC_CLUSTER_PORT=os.environ.get("HPC_LOST_CLUSTER_PORT", "6937"),
                     HPC_CLUSTER_PREFIX=os.environ.get("HPC_LOST_CLUSTER_PREFIX", "hpcl"))


@pytest.fixture(scope="module")
def cluster():
    """Environment for sbatch/srun on this module's simulated cluster."""
    yield from simulated_cluster(LOST_SETTINGS)


LOST_TIMEOUT_S = 10
LOST = ["fgrpo.steps=8", "fgrpo.batch_prompts=8", "fgrpo.sampling.num_generations=4",
        "task.n_train=64", "eval.every=0", "run.checkpoint_every=1",
        f"run.collective_timeout_s={LOST_TIMEOUT_S}", *EVAL]


def _steps(path) -> int:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return len(f["metrics/step"])
    except (OSError, KeyError):
        return 0


def _state(env, node) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], env=env, capture_output=True,
                          text=True, timeout=60).stdout.strip()


def _steps_left(env, node) -> list:
    """Job step daemons (slurmstepd) still running on ``node``."""
    ns = f"{env['HPC_CLUSTER_PREFIX']}-{node}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          timeout=60).stdout.split()
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # ended meanwhile
            pass
    return [n for n in names if n == "slurmstepd"]


def _start_when_requeued(env, jobid) -> bool:
    """True once the job ended; while it waits for the begin time Slurm gives a requeued job,
    start it now (after slurmd's one-second credential resolution, see test_slurm.py)."""
    info = job_info(env, jobid)
    if info["JobState"] in ENDED:
        return True
    if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
        time.sleep(5)
        start = subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"],
                               env=env, capture_output=True, text=True, timeout=60)
        # on a slow machine the begin time may already have passed: it runs
        assert start.returncode == 0 or "no longer pending" in start.stderr, start.stderr
    return False


@pytest.mark.slow
def test_lost_node_requeues_and_resumes_to_the_uninterrupted_result(cluster, toy_model):
    """With 2 stand-in GPUs per node. Slurm before 23.02.2 (bug 16121; docs/troubleshooting.md)
    restarts the job with none of its GPUs: the job script then requeues it once more, and that
    attempt resumes; later Slurm versions resume at the first restart."""
    reference = submit(cluster, "fgrpo", LOST, "2x2", LAUNCHER="srun")
    wait_ended(cluster, [reference])
    full = completed(cluster, "fgrpo", reference)

    jobid = submit(cluster, "fgrpo", LOST, "2x2", LAUNCHER="srun",
                   RUN_FILE_POLL_S="2", LAUNCHER_GRACE_S="5")
    run = os.path.join(cluster["runs"], f"fgrpo-{jobid}")
    wait_for(lambda: _steps(f"{run}/fgrpo.h5") >= 2, 600, "2 F-GRPO steps")
    veth = f"{cluster['HPC_CLUSTER_PREFIX']}-v2"  # node2's end in the root namespace
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    lost_at = time.monotonic()
    try:
        def requeued():
            info = job_info(cluster, jobid)
            assert info["JobState"] not in ENDED, job_log(cluster["runs"], "fgrpo", jobid)
            return info["Restarts"] == "1"

        wait_for(requeued, LOST_TIMEOUT_S + 30, "the requeue within the collective timeout + 30 s")
        ended_s = time.monotonic() - lost_at
        first = job_log(cluster["runs"], "fgrpo", jobid)
        # both of node2's ranks, whether they had reached the collective or not
        assert "a rank was lost (ranks [2, 3] on node2)" in first, first[-4000:]
        with h5py.File(f"{run}/fgrpo.h5", "r", locking=False) as f:
            assert f.attrs["status"] == "lost"
            assert f.attrs["lost_ranks"].tolist() == [2, 3]
            assert list(f.attrs["lost_hosts"]) == ["node2"]
        assert ended_s < LOST_TIMEOUT_S + 30
        # As on a real cluster, Slurm marks the silent node DOWN (SlurmdTimeout, 60 s here);
        # when it answers again, Slurm ends what the first attempt left on it.
        wait_for(lambda: _state(cluster, "node2").startswith("down"), 180, "node2 DOWN")
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    wait_for(lambda: _state(cluster, "node1") == _state(cluster, "node2") == "idle", 180,
             "both nodes to be idle")
    wait_for(lambda: not _steps_left(cluster, "node2"), 120, "node2's old job step to end")
    wait_for(lambda: _start_when_requeued(cluster, jobid), 900, "the requeued job to end")
    resumed = completed(cluster, "fgrpo", jobid)
    log = job_log(cluster["runs"], "fgrpo", jobid)
    restarts = int(job_info(cluster, jobid)["Restarts"])
    if restarts == 2:  # Slurm before 23.02.2: the first restart held no GPUs
        assert f"restart 1 of job {jobid} holds none of its GPUs" in log, log[-4000:]
    assert restarts in (1, 2), log[-4000:]
    last = log.split(f"(restart {restarts})")[1]
    assert "GPUs/node 2" in last and "--resume" in last, last[-4000:]
    assert_same_run(full, resumed, "fgrpo")
