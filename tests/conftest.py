"""Shared test helpers: real mpirun / h5dump / Slurm / torchao, skipped where absent except in CI.

CI sets HPC_TEST_STRICT=1, which turns every such skip into a failure. The tiers' marks, their
guard and the time budget live in tests/tiers.py (its hooks are registered here).
"""
import atexit
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

import pytest
from filelock import FileLock

from tiers import (charge_shared_build, pytest_addoption,  # noqa: F401
                   pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport,
                   pytest_runtest_protocol)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
STRICT = os.environ.get("HPC_TEST_STRICT") == "1"

# Open MPI 5's libfabric BTL (ofi), opened and then not selected on a machine without a fabric,
# sleeps 1 s as it closes in every process's MPI_Init (mca_btl_base_select ->
# mca_base_component_close -> sleep(1)): a 1-rank job took 1.14 s to initialise MPI with it and
# 0.16 s without, `mpirun -n 2` of a barrier 1.28 s and 0.28 s. The suite starts thousands of
# such processes, one after the other in most tests. Ranks on one host talk over sm and tcp.
OFI_OFF = "^ofi"
os.environ.setdefault("OMPI_MCA_btl", OFI_OFF)  # also every Slurm job, which inherits it

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_btl": OFI_OFF,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": REPO,
}


# Open MPI's mpirun keeps its PMIx rendezvous files in <base>/ompi.<pid>. A test that kills
# mpirun leaves them behind, and a later mpirun given the same pid (pid_max is 32768 on such
# machines, and a suite starts tens of thousands of processes) stops at once: "The PMIx
# server's listener thread failed to start", exit 213. Every test's launches get a base of
# their own (fresh_mpirun_session_base below), the shared builds one per pytest worker.
PRTE_BASE = "PRTE_MCA_prte_tmpdir_base"
os.environ[PRTE_BASE] = tempfile.mkdtemp(prefix="prte-session-")
atexit.register(shutil.rmtree, os.environ[PRTE_BASE], True)


def require(condition: bool, what: str):
    """Skip when ``condition`` is false, or fail under HPC_TEST_STRICT=1 (CI)."""
    if not condition:
        if STRICT:
            pytest.fail(f"{what} is required in CI (HPC_TEST_STRICT=1) but is missing")
        pytest.skip(f"{what} not available on this machine, so this was not tested "
                    f"(HPC_TEST_STRICT=1 makes it a failure)")


def require_torchao():
    """torchao, the extra 'quant' that `make venv` installs and model.quantize needs: a test of
    quantisation skips without it, or fails under HPC_TEST_STRICT=1 (CI), as for mpirun."""
    import importlib.util

    require(importlib.util.find_spec("torchao") is not None, "torchao (the extra 'quant')")


@pytest.fixture
def torchao():
    """:func:`require_torchao` before the test."""
    require_torchao()


def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def run_mpi(n: int, args: list, timeout: float = 300, env: dict | None = None, cwd=None,
            python: str | None = None):
    """Run ``python args...`` on ``n`` ranks under the real mpirun (``python``: this
    interpreter, or another environment's); returns CompletedProcess."""
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    full_env = dict(os.environ, **MPI_ENV, **(env or {}))
    cmd = [mpirun, "-n", str(n), "--oversubscribe", python or sys.executable] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or REPO)


VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")  # make venv-vllm


def vllm_python() -> str:
    """The interpreter of vLLM's environment (``make venv-vllm``; CI builds it)."""
    require(os.path.isfile(VLLM_PYTHON), f"vLLM's environment ({VLLM_PYTHON}: make venv-vllm)")
    return VLLM_PYTHON


@pytest.fixture
def shared_data():
    require(os.path.isdir(SHARED_DATA), f"the shared data folder {SHARED_DATA}")
    return SHARED_DATA


def run_cli(args: list, timeout: float = 300, env: dict | None = None,
            python: str | None = None):
    """Run ``python args...`` as one process (no mpirun; ``python``: this interpreter, or
    another environment's); returns CompletedProcess."""
    full_env = dict(os.environ, **MPI_ENV, **(env or {}))
    return subprocess.run([python or sys.executable] + list(args), capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


def hf_cached(cache, repo: str, files: dict, kind: str = "models", revision: str = "a" * 40,
           ref: str = "main") -> str:
    """Put ``files`` ({name: bytes or a path to copy}) into ``cache`` as the snapshot
    ``revision`` of ``repo``, which ``refs/<ref>`` names, as huggingface_hub lays out a
    download (``<kind>--org--name/refs``, ``snapshots/<commit>/``); returns the snapshot."""
    root = os.path.join(cache, f"{kind}--{repo.replace('/', '--')}")
    snapshot = os.path.join(root, "snapshots", revision)
    for name, content in files.items():
        target = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if isinstance(content, bytes):
            with open(target, "wb") as fh:
                fh.write(content)
        else:
            shutil.copyfile(content, target)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", ref), "w") as fh:
        fh.write(revision)
    return snapshot


def hpc_data(capsys, *args) -> tuple:
    """``hpc-data ARGS`` in this process: (exit code, stdout, stderr)."""
    from hpc.data.check import main

    try:
        code = main(list(args))
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def placeholder_adapter(folder) -> str:
    """A folder that passes a job's input check as a peft adapter (its two files, empty), for
    tests whose job stops before any adapter loads."""
    os.makedirs(folder, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        open(os.path.join(folder, name), "w").close()
    return str(folder)


def our_lines(stderr: str) -> list:
    """The lines our program wrote to stderr (mpirun's own banners removed)."""
    lines = []
    in_banner = False
    for line in stderr.splitlines():
        if line.startswith("-----"):
            in_banner = not in_banner
            continue
        if not in_banner and line.strip():
            lines.append(line)
    return lines


def run_shared_folder(tmp_path_factory):
    """The temporary folder of this pytest run that all its xdist workers share."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def toy_adapter(tmp_path_factory):
    """The demo's SFT adapter (configs/demo/sft.yaml: LoRA rank 16, 10 steps), one process,
    trained once per pytest run: the first worker to ask trains it under a file lock, the
    others wait for it and share the folder (read-only to every test)."""
    root = run_shared_folder(tmp_path_factory)
    out = root / "toy-sft"
    began = time.monotonic()
    with FileLock(str(root / "toy-sft.lock")):
        done = root / "toy-sft.done"  # written after the job succeeded
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a failed try of another worker
            proc = run_cli(["-m", "sft", "configs/demo/sft.yaml", "task.n_eval=16",
                            "eval.n_samples=2", "run.progress=false", f"run.out={out}"],
                           timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done.touch()
    charge_shared_build(time.monotonic() - began)
    return str(out / "adapter")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Two random tiny Qwen2 models (the second ~4x the parameters) with a LoRA adapter each
    whose B factors are random (so every singular value is non-zero)."""
    import torch

    from hpc.models.loading import attach_lora, randomize_lora_b, save_adapter
    from hpc.toys.toy import tiny_model

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, (hidden, layers) in {"small": (32, 2), "large": (64, 4)}.items():
        model_dir, adapter_dir = root / name, root / f"{name}-adapter"
        model, _ = tiny_model(hidden=hidden, layers=layers, save_dir=str(model_dir))
        peft_model = attach_lora(model, 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
        randomize_lora_b(peft_model, 0.1, torch.Generator().manual_seed(1))
        save_adapter(peft_model, str(adapter_dir))
        out[name] = (str(model_dir), str(adapter_dir),
                     sum(p.numel() for p in model.parameters()))
    return out


@pytest.fixture(autouse=True)
def _sigterm_disposition_restored():
    """A test must not leave SIGTERM ignored in this process: subprocesses inherit an ignored
    signal, and a shell cannot trap what it started with ignored."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(autouse=True)
def fresh_mpirun_session_base(monkeypatch):
    """This test's mpirun session files in a folder of its own, removed after it (PRTE_BASE)."""
    base = tempfile.mkdtemp(prefix="prte-")
    monkeypatch.setenv(PRTE_BASE, base)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def site_mpi_environment(folder, mpicc: str) -> str:
    """A virtual environment in ``folder`` whose mpi4py (this environment's version) is built
    from source with the compiler wrapper ``mpicc`` and which sees this environment's packages
    after its own; returns its python. Built without optimisation (``CFLAGS=-O0``): the speed
    of MPI calls is not under test, and it halves the build."""
    base = os.path.join(sys.base_prefix, "bin", "python3")
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = os.path.join(folder, "bin", "python")
    version = importlib.metadata.version("mpi4py")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                           "--no-binary", "mpi4py", "--no-cache-dir", f"mpi4py=={version}"],
                          env=dict(os.environ, MPICC=mpicc, CFLAGS="-O0 -g0"),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip()
    with open(os.path.join(own, "this-environment.pth"), "w") as fh:
        # addsitedir also runs this environment's .pth files (the package's editable install)
        fh.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return python
