"""Shared test helpers: real mpirun / h5dump / Slurm, skipped where absent except in CI.

CI sets HPC_TEST_STRICT=1, which turns every such skip into a failure.
"""
import os
import shutil
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
STRICT = os.environ.get("HPC_TEST_STRICT") == "1"

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": REPO,
}


def require(condition: bool, what: str):
    """Skip when ``condition`` is false, or fail under HPC_TEST_STRICT=1 (CI)."""
    if not condition:
        if STRICT:
            pytest.fail(f"{what} is required in CI (HPC_TEST_STRICT=1) but is missing")
        pytest.skip(f"{what} not available")


def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def run_mpi(n: int, args: list, timeout: float = 300, env: dict | None = None, cwd=None):
    """Run ``python args...`` on ``n`` ranks under the real mpirun; returns CompletedProcess."""
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    full_env = dict(os.environ, **MPI_ENV, **(env or {}))
    cmd = [mpirun, "-n", str(n), "--oversubscribe", sys.executable] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or REPO)


@pytest.fixture
def shared_data():
    require(os.path.isdir(SHARED_DATA), f"the shared data folder {SHARED_DATA}")
    return SHARED_DATA
