"""What goes wrong across nodes, for real, on a simulated 2-node Slurm cluster of this module's
own (tests/test_multinode.py's, brought up with its own subnet, ports and names, so that it runs
beside that module's): the name traps of real clusters (a host name that does not resolve on
another node, or resolves to loopback), the preflight (hpc-doctor) across the nodes, passing and
naming the node that lacks the model folder, has its own run root or cannot reach the
rendezvous, and a node lost mid-run: an F-GRPO job whose second node's link goes down ends with
the requeue code within its collective timeout, Slurm marks the node DOWN, and the requeued job
resumes to the result of an uninterrupted run, bitwise.

Needs what tests/test_multinode.py needs (root, Debian's Slurm, munge and libpmix-dev).
"""
import os
import subprocess
import sys
import time

import h5py
import pytest

from conftest import REPO, our_lines
from test_doctor import verdicts
from test_multinode import (CLUSTER, EVAL, SETTINGS, assert_local_ranks, assert_same_run,
                            completed, simulated_cluster, srun_check, submit, wait_ended)
from test_multinode import toy_model  # noqa: F401  (the fixture, on this module's cluster)
from test_slurm import ENDED, job_info, job_log, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.toy]

# Apart from test_multinode.py's cluster (10.221.7, 6927, hpct), which may be up at the same
# time; the same variables in the environment move them.
FAULTS_SETTINGS = dict(SETTINGS,
                       HPC_CLUSTER_NET=os.environ.get("HPC_FAULTS_CLUSTER_NET", "10.221.8"),
                       HPC_CLUSTER_PORT=os.environ.get("HPC_FAULTS_CLUSTER_PORT", "6937"),
                       HPC_CLUSTER_PREFIX=os.environ.get("HPC_FAULTS_CLUSTER_PREFIX", "hpcf"))


@pytest.fixture(scope="module")
def cluster():
    """Environment for sbatch/srun on this module's simulated cluster."""
    yield from simulated_cluster(FAULTS_SETTINGS)


@pytest.fixture
def hosts(cluster):
    """Edit a node's /etc/hosts in place (its bind mount keeps the inode); restored after."""
    saved = {}

    def edit(node, keep_lines, *extra):
        path = os.path.join(cluster["HPC_CLUSTER_DIR"], node, "hosts")
        with open(path) as fh:
            text = saved.setdefault(path, fh.read())
        lines = [line for line in text.splitlines() if keep_lines(line)]
        with open(path, "w") as fh:  # "w" truncates: the same inode
            fh.write("\n".join([*extra, *lines]) + "\n")

    yield edit
    for path, text in saved.items():
        with open(path, "w") as fh:
            fh.write(text)


def unresolvable(hosts):
    """Trap 1: rank 0's host name (node1) does not resolve on node2."""
    hosts("node2", lambda line: "node1" not in line)


def loopback(hosts):
    """Trap 2: on node1 its own name resolves to 127.0.1.1 (Debian's default line)."""
    hosts("node1", lambda line: "node1" not in line, "127.0.1.1 node1")


@pytest.mark.parametrize("trap, setting", [
    (unresolvable, {}), (loopback, {}),
    (unresolvable, {"MASTER_ADDR": "node1"}),  # a name: resolved on rank 0 only
])
def test_name_trap_with_a_reachable_address_succeeds(cluster, hosts, trap, setting):
    trap(hosts)
    proc, reports = srun_check(cluster, **setting)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_local_ranks(reports, cluster)


@pytest.mark.parametrize("trap, setting, words", [
    (loopback, {"MASTER_ADDR": "node1"}, ["127.0.1.1", "MASTER_ADDR"]),
    (unresolvable, {"GLOO_SOCKET_IFNAME": "lo"}, ["127.0.0.1", "GLOO_SOCKET_IFNAME"]),
])
def test_name_trap_without_a_reachable_address_ends_with_one_line(cluster, hosts, trap, setting,
                                                                  words):
    """Every rank exits 2 within 10 s of starting the bootstrap; one line names the host that
    cannot connect, the address tried and the variable that fixes it."""
    trap(hosts)
    proc, reports = srun_check(cluster, **setting)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in our_lines(proc.stderr)
             if not line.startswith(("srun:", "slurmstepd", "[W"))]  # Slurm's, c10d's lines
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert lines[0].startswith("error: rank 2 on node2") and "cannot connect" in lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    # each rank records when its bootstrap began and when it exited
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert all(r["exit_code"] == 2 and r["bootstrap_s"] < 10 for r in reports), reports


@pytest.fixture(scope="module")
def shared_model(cluster):
    """A tiny model folder in the cluster's shared folder: every node sees it."""
    from hpc.toys.toy import tiny_model

    folder = os.path.join(cluster["runs"], "tiny-model")
    tiny_model(save_dir=folder)
    return folder


def doctor_lines(proc) -> list:
    """The error lines of a preflight that must have exited 2 without a traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in our_lines(proc.stderr) if line.startswith("error")]


def srun_doctor(env, *args, **variables):
    """hpc-doctor on 2 nodes x 2 ranks under srun, as doctor.sbatch starts it."""
    cmd = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=2",
           sys.executable, "-m", "hpc.doctor", "run.progress=false", *args]
    return subprocess.run(cmd, env=dict(env, **variables), cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_doctor_job_on_two_nodes_prints_every_rank_and_passes(cluster, shared_model):
    jobid = submit(cluster, "doctor", [f"model.path={shared_model}"], "2x2")
    wait_ended(cluster, [jobid], 300)
    completed(cluster, "doctor", jobid)
    log = job_log(cluster["runs"], "doctor", jobid)
    rows = [line.split()[:3] for line in log.splitlines() if line[:1].isdigit()][:4]
    assert rows == [["0", "node1", "0/2"], ["1", "node1", "1/2"], ["2", "node2", "0/2"],
                    ["3", "node2", "1/2"]], log
    assert "hpc-doctor: 4 rank(s) on 2 node(s)" in log
    checks = verdicts(log[log.index("hpc-doctor: 4 rank(s)"):])
    assert {verdict for verdict, _ in checks.values()} == {"ok"}, log
    assert checks["run root"][1].startswith(f"{cluster['runs']} "), checks["run root"]
    assert checks["rendezvous"][1].startswith(f"{cluster['HPC_CLUSTER_NET']}.11:"), \
        checks["rendezvous"]


def test_doctor_names_the_node_without_the_model_and_its_own_run_root(cluster, shared_model):
    """The model folder only in node1's /tmp (each node's /tmp is its own), the run root
    there too: two lines, each naming node2 and the fix."""
    private = "/tmp/hpc-doctor-model"
    subprocess.run(["bash", CLUSTER, "exec", "node1", "cp", "-r", shared_model, private],
                   env=cluster, check=True, timeout=60)
    try:
        proc = srun_doctor(cluster, f"model.path={private}",
                           "run.out=/tmp/hpc-doctor-runs/{method}-{jobid}")
    finally:
        subprocess.run(["bash", CLUSTER, "exec", "node1", "rm", "-rf", private,
                        "/tmp/hpc-doctor-runs"], env=cluster, timeout=60)
    lines = doctor_lines(proc)
    assert len(lines) == 2, lines
    assert lines[0] == (f"error: model folder on node2 (ranks 2-3): model folder not found: "
                        f"{private}; copy the same model folder to every node, or keep it on a "
                        f"shared file system")
    assert lines[1].startswith("error: run root on node2 (ranks 2-3): /tmp/hpc-doctor-runs is "
                               "not the folder rank 0 wrote to"), lines[1]


def test_doctor_names_the_rank_that_cannot_reach_the_rendezvous(cluster, hosts, shared_model):
    """node1's own name resolves to 127.0.1.1 there, and MASTER_ADDR names it: node2's ranks
    cannot connect; the other checks still run."""
    loopback(hosts)
    proc = srun_doctor(cluster, f"model.path={shared_model}",
                       f"run.out={cluster['runs']}/{{method}}-{{jobid}}", MASTER_ADDR="node1")
    lines = doctor_lines(proc)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: rendezvous: rank 2 on node2 and 1 more rank(s) cannot "
                               "connect to rank 0 at 127.0.1.1:"), lines[0]
    assert "set MASTER_ADDR to an address of node1 that every node reaches" in lines[0]


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
    try:
        wait_for(lambda: _steps(f"{run}/fgrpo.h5") >= 2, 600, "2 F-GRPO steps")
    except AssertionError as err:  # the job's log, to see where it stands
        raise AssertionError(f"{err}: {job_info(cluster, jobid)}\n"
                             f"{job_log(cluster['runs'], 'fgrpo', jobid)[-4000:]}") from None
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
