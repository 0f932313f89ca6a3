"""Across nodes, for real: a simulated Slurm cluster of 2 nodes (jobscripts/local-slurm/
cluster.sh: one network + UTS + mount namespace per node, its own host name, /etc/hosts and
/tmp, a slurmd each), the job scripts run on 2 nodes x 2 ranks and on 1 node x 4 ranks, the
local ranks per node, and the jobs on Debian's own Open MPI (mpi4py built from source against
it) under srun, bitwise equal to the pip wheel's. The name traps of real clusters, the preflight
across the nodes and a node's link taken down mid-run: tests/test_multinode_faults.py, on a
cluster of its own beside this one.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and Debian's slurmctld, slurmd, slurm-client, munge
and libpmix-dev: skipped where absent, failed under HPC_TEST_STRICT=1 (CI). The cluster lives
in this module's fixture and is torn down (and checked gone) even when a test fails.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import pytest

from conftest import MPI_ENV, REPO, require, site_mpi_environment
from test_slurm import ENDED, job_info, job_log, wait_for

# the cluster's environment is taken when it comes up: every test here sees the toy cache
pytestmark = [pytest.mark.slurm, pytest.mark.toy]

CLUSTER = os.path.join(REPO, "jobscripts", "local-slurm", "cluster.sh")
CHECK = os.path.join(REPO, "tests", "mpi", "rendezvous_check.py")
# The test cluster's subnet, port and names: apart from a user's own cluster; the same
# variables in the environment move them (to run this module beside another test cluster).
NET = os.environ.get("HPC_CLUSTER_NET", "10.221.7")
SETTINGS = dict(HPC_CLUSTER_NODES="2", HPC_CLUSTER_CPUS="4", HPC_CLUSTER_GPUS="4",
                HPC_CLUSTER_NET=NET, HPC_CLUSTER_PORT=os.environ.get("HPC_CLUSTER_PORT", "6927"),
                HPC_CLUSTER_PREFIX=os.environ.get("HPC_CLUSTER_PREFIX", "hpct"),
                # the job script, not Slurm's node failure, must be first to end a lost job
                HPC_CLUSTER_SLURMD_TIMEOUT="60")
EVAL = ["task.n_eval=16", "eval.n_samples=2", "run.progress=false", "model.path=toy"]
SFT = ["sft.steps=2", "task.n_train=64", *EVAL]
FGRPO = ["fgrpo.steps=2", "fgrpo.batch_prompts=8", "fgrpo.sampling.num_generations=4",
         "task.n_train=64", "eval.every=0", *EVAL]
ESSA = ["essa.population=4", "essa.minibatch=8", "essa.generations=2", "essa.sigma0=0.5",
        "task.n_train=64", "eval.every=0", *EVAL]
LAYOUTS = {"1x4": (1, 4), "2x2": (2, 2)}
TIME_KEYS = ("_s", "seconds")  # measured durations: the only values that may differ


def simulated_cluster(settings: dict):
    """Bring a simulated cluster of ``settings`` (cluster.sh's HPC_CLUSTER_* variables) up,
    yield the environment for sbatch/srun on it, then take it down and check it is gone (also
    when a test failed). Several may run at once, each with its own subnet, port and prefix."""
    sbin = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    missing = [c for c in ("sbatch", "srun", "slurmctld", "slurmd", "munged", "nsenter", "ip")
               if shutil.which(c, path=sbin) is None]
    require(not missing, f"Slurm and iproute2 ({', '.join(missing)})")
    require(os.geteuid() == 0, "root (to create namespaces and start slurmd)")
    # Not under pytest's base temp folder: a pytest started meanwhile may delete old ones.
    root = pathlib.Path(tempfile.mkdtemp(prefix="hpc-cluster-test-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(MPI_ENV, **settings, HPC_CLUSTER_DIR=str(root), SLURM_CONF=f"{root}/slurm.conf",
               PYTHON=sys.executable, PMIX_MCA_psec="native",
               PATH=os.path.dirname(sys.executable) + os.pathsep + sbin)
    # What the job scripts set for srun, and what a user's own srun --mpi=pmix needs: PMIx
    # fences on Slurm's ring collective, else MPI_Init's closing barrier holds only the ranks
    # of one node and a rank can die inside MPI_Init (docs/troubleshooting.md). The tests'
    # own sruns take it from here; test_pmix_fences_are_barriers_under_the_job_scripts_srun
    # leaves it out to check the job scripts' setting.
    env["SLURM_PMIX_FENCE"] = "ring"
    env["runs"] = str(root / "runs")
    (root / "runs").mkdir()
    try:
        up = subprocess.run(["bash", CLUSTER, "up"], env=env, capture_output=True, text=True,
                            timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
    finally:
        subprocess.run(["bash", CLUSTER, "down"], env=env, capture_output=True, timeout=120)
        left = subprocess.run(["bash", CLUSTER, "check"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert left.returncode == 0, left.stderr
        if os.environ.get("HPC_KEEP_CLUSTER_DIR") != "1":  # the logs, for a failed test
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """Environment for sbatch/srun on the simulated cluster, up for this module only."""
    yield from simulated_cluster(SETTINGS)


@pytest.fixture(scope="module")
def toy_model(cluster):
    """Build the cached toy model if absent (2-3 minutes) before any job, not inside one."""
    proc = subprocess.run([sys.executable, "-m", "hpc.toys.toy"], env=cluster, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def submit(env, method, args, layout, gpus=True, after=None, **variables) -> str:
    """sbatch jobscripts/slurm/METHOD.sbatch on ``layout`` (nodes x ranks per node), with a
    stand-in GPU per rank unless ``gpus`` is false; with ``after`` (a job id), it starts once
    that job completed, and is cancelled if that job fails."""
    nodes, per_node = LAYOUTS[layout]
    depends = [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"] if after else []
    cmd = ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={env['runs']}/slurm-%x-%j.out",
           f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
           f"--gpus-per-node={per_node if gpus else 0}", "--export=ALL", *depends,
           f"jobscripts/slurm/{method}.sbatch", *args]
    proc = subprocess.run(cmd, env=dict(env, RUN_ROOT=env["runs"], **variables), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.split(";")[0].strip()


def wait_ended(env, jobids, timeout=900) -> None:
    wait_for(lambda: all(job_info(env, j)["JobState"] in ENDED for j in jobids), timeout,
             f"jobs {jobids} to end")


def completed(env, method, jobid) -> str:
    """The run folder of a job that must have completed (else its log in the failure)."""
    info = job_info(env, jobid)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        job_log(env["runs"], method, jobid)[-4000:]
    return os.path.join(env["runs"], f"{method}-{jobid}")


def assert_same_run(a: str, b: str, method: str) -> None:
    """Two run folders hold the same result bitwise: every group's values (measured durations
    and the run's segments, one more after a resume, aside) and the bytes of every exported
    adapter."""
    with h5py.File(f"{a}/{method}.h5", "r") as fa, h5py.File(f"{b}/{method}.h5", "r") as fb:
        assert fa.attrs["status"] == fb.attrs["status"] == "complete"
        skip = ("timings", "bytes", "segments")
        groups = [g for g in fa if g not in skip]
        assert groups == [g for g in fb if g not in skip]
        for group in groups:
            keys = [k for k in fa[group] if not k.endswith(TIME_KEYS)]
            assert keys and keys == [k for k in fb[group] if not k.endswith(TIME_KEYS)]
            for key in keys:
                assert np.array_equal(fa[group][key][:], fb[group][key][:]), f"{group}/{key}"
    # SFT and F-GRPO export adapter/, ESSA adapter-best/ and adapter-mean/
    names = sorted(p.parent.name for p in pathlib.Path(a).glob("adapter*/adapter_model.*"))
    assert names and names == sorted(p.parent.name for p in
                                     pathlib.Path(b).glob("adapter*/adapter_model.*"))
    for name in names:
        assert (pathlib.Path(a, name, "adapter_model.safetensors").read_bytes() ==
                pathlib.Path(b, name, "adapter_model.safetensors").read_bytes()), name


@pytest.fixture(scope="module")
def matrix(cluster, toy_model):
    """Every method on one node x 4 ranks (mpirun) and on 2 nodes x 2 ranks under srun and
    under mpirun, all submitted at once (Slurm packs them); ESSA starts from the 1x4 SFT
    adapter, its jobs held by a dependency until that SFT job completed.
    {(method, layout, launcher): run folder}."""
    methods = {"sft": ("sft", SFT), "fgrpo-ddp": ("fgrpo", FGRPO),
               "fgrpo-fsdp2": ("fgrpo", FGRPO + ["fgrpo.parallel.strategy=fsdp2"])}
    cases = [("1x4", "mpirun"), ("2x2", "srun"), ("2x2", "mpirun")]
    scripts = {name: script for name, (script, _) in methods.items()} | {"essa": "essa"}
    jobs = {(name, layout, launcher): submit(cluster, script, args, layout, LAUNCHER=launcher)
            for name, (script, args) in methods.items() for layout, launcher in cases}
    sft = jobs[("sft", "1x4", "mpirun")]
    adapter = os.path.join(cluster["runs"], f"sft-{sft}", "adapter")
    jobs.update({("essa", layout, launcher): submit(cluster, "essa",
                                                    ESSA + [f"lora.adapter={adapter}"], layout,
                                                    after=sft, LAUNCHER=launcher)
                 for layout, launcher in cases})
    wait_ended(cluster, list(jobs.values()))
    return {key: completed(cluster, scripts[key[0]], j) for key, j in jobs.items()}


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
@pytest.mark.parametrize("name", ["sft", "essa", "fgrpo-ddp", "fgrpo-fsdp2"])
@pytest.mark.slow
def test_two_nodes_equal_one_node_bitwise(matrix, name, launcher):
    method = name.split("-")[0]
    one, two = matrix[(name, "1x4", "mpirun")], matrix[(name, "2x2", launcher)]
    assert_same_run(one, two, method)
    with h5py.File(f"{two}/{method}.h5", "r") as f:
        assert json.loads(f.attrs["hosts"]) == ["node1", "node1", "node2", "node2"]


DEBIAN_OPENMPI_CC = "/usr/bin/mpicc.openmpi"
SITE_MPI_CASES = ["sft", "essa", "fgrpo-ddp"]


@pytest.fixture(scope="module")
def debian_openmpi_runs(cluster, matrix):
    """SFT, ESSA and DDP F-GRPO on 2 nodes x 2 ranks under srun --mpi=pmix with the python of
    an environment whose mpi4py is built from source against Debian's Open MPI 4.1
    (libopenmpi-dev; conftest.py site_mpi_environment), as a site's MPI module would be, in the
    cluster's shared folder; ESSA from the matrix's SFT adapter. {name: run folder}."""
    require(os.path.exists(DEBIAN_OPENMPI_CC), "Debian's libopenmpi-dev (mpicc.openmpi)")
    python = site_mpi_environment(os.path.join(cluster["runs"], "debian-openmpi"),
                                  DEBIAN_OPENMPI_CC)
    adapter = os.path.join(matrix[("sft", "1x4", "mpirun")], "adapter")
    cases = {"sft": ("sft", SFT), "essa": ("essa", ESSA + [f"lora.adapter={adapter}"]),
             "fgrpo-ddp": ("fgrpo", FGRPO)}
    jobs = {name: submit(cluster, script, args, "2x2", LAUNCHER="srun", PYTHON=python)
            for name, (script, args) in cases.items()}
    wait_ended(cluster, list(jobs.values()))
    return {name: completed(cluster, cases[name][0], j) for name, j in jobs.items()}


@pytest.mark.parametrize("name", SITE_MPI_CASES)
@pytest.mark.slow
def test_debian_open_mpi_under_srun_equals_the_wheels_bitwise(matrix, debian_openmpi_runs,
                                                               name):
    method = name.split("-")[0]
    ours = debian_openmpi_runs[name]
    with h5py.File(f"{ours}/{method}.h5", "r") as f:
        assert f.attrs["mpi_version"].startswith("Open MPI v4.1"), f.attrs["mpi_version"]
    assert_same_run(matrix[(name, "2x2", "srun")], ours, method)


def srun_check(env, timeout=120, **variables):
    """tests/mpi/rendezvous_check.py on 2 nodes x 2 ranks under srun: (process, reports)."""
    out = os.path.join(env["runs"], f"check-{time.monotonic_ns()}")
    os.makedirs(out)
    cmd = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=2",
           sys.executable, CHECK, out]
    proc = subprocess.run(cmd, env=dict(env, **variables), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    return proc, _reports(out)


def _reports(out) -> list:
    reports = []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as fh:
            reports.append(json.load(fh))
    return sorted(reports, key=lambda r: r["rank"])


def assert_local_ranks(reports, env) -> None:
    """Four ranks, two per node, each with its local rank and size, the launcher's agreeing,
    and the bootstrap address node1's on the cluster's network (``env``: the cluster's)."""
    addr = f"{env['HPC_CLUSTER_NET']}.11"
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    for node in ("node1", "node2"):
        mine = [r for r in reports if r["host"] == node]
        assert sorted(r["local_rank"] for r in mine) == [0, 1], mine
        for r in mine:
            assert (r["local_size"], r["size"], r["mean"]) == (2, 4, 1.5), r
            assert r["local_rank"] == int(r["launcher_local_rank"]), r
            assert r["local_size"] == int(r["launcher_local_size"]), r
            assert (r["addr"], r["gloo_ifname"]) == (addr, "eth0"), r


def test_local_rank_and_size_under_srun(cluster):
    proc, reports = srun_check(cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_local_ranks(reports, cluster)


FENCE_CHECK = os.path.join(REPO, "tests", "mpi", "fence_check.py")


def test_pmix_fences_are_barriers_under_the_job_scripts_srun(cluster):
    """srun as jobscripts/slurm/common.sh starts it (its own environment, not the cluster's
    SLURM_PMIX_FENCE): a data-less PMIx fence, MPI_Finalize's, holds the rank on node1 until
    the rank on node2, 2 s late, arrives. Slurm's tree collective, which such fences get by
    default, releases each node's ranks alone when TreeWidth (50 here) exceeds the step's node
    count, and MPI_Init's closing barrier is such a fence: a rank then dies inside MPI_Init
    now and then (jobscripts/local-slurm/init-race.sh counts it; docs/troubleshooting.md)."""
    env = {k: v for k, v in cluster.items() if k != "SLURM_PMIX_FENCE"}
    line = ('source jobscripts/slurm/common.sh && LAUNCHER=srun choose_launcher && '
            f'"${{launch[@]}}" --nodes=2 --ntasks-per-node=1 "$PYTHON" {FENCE_CHECK} 2')
    proc = subprocess.run(["bash", "-c", line], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    waited = {int(rank): float(seconds) for rank, seconds in
              (out.split()[1::2] for out in proc.stdout.splitlines() if out.startswith("rank "))}
    assert sorted(waited) == [0, 1], proc.stdout
    assert waited[0] > 1.5, f"MPI_Finalize on node1 did not wait for node2: {waited}"


def test_local_rank_and_size_under_mpirun_in_an_allocation(cluster):
    out = os.path.join(cluster["runs"], "check-alloc")
    os.makedirs(out)
    wrap = f"mpirun --bind-to none -x PYTHONPATH {sys.executable} {CHECK} {out}"
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2",
                           f"--chdir={REPO}", f"--output={out}.log", "--export=ALL",
                           f"--wrap={wrap}"], env=cluster, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobid = proc.stdout.strip()
    wait_ended(cluster, [jobid], 300)
    with open(f"{out}.log") as fh:
        assert job_info(cluster, jobid)["JobState"] == "COMPLETED", fh.read()[-3000:]
    assert_local_ranks(_reports(out), cluster)


def test_local_rank_and_size_under_mpirun_with_a_host_list(cluster):
    """mpirun on node1 with --host, its daemon started on node2 through cluster.sh rsh (the
    stand-in for ssh), outside any allocation."""
    out = os.path.join(cluster["runs"], "check-hosts")
    os.makedirs(out)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    proc = subprocess.run(
        ["bash", CLUSTER, "exec", "node1", mpirun, "--host", "node1:2,node2:2", "--bind-to",
         "none", "--mca", "plm_rsh_agent", f"{CLUSTER} rsh", "-x", "PYTHONPATH", "-x", "PATH",
         sys.executable, CHECK, out],
        env=cluster, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_local_ranks(_reports(out), cluster)
