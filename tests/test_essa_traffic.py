"""ESSA's traffic measured from outside the package: Open MPI's PML monitoring component counts
every byte each rank hands to the MPI point-to-point layer (the messages of mpi4py's
collectives included) and writes it at MPI_Finalize. The package's own byte counter (the run
file's ``bytes`` group) plays no part in it. (The bytes on the TCP sockets between the ranks,
Open MPI's headers included, are measured by hand with strace: docs/essa.md, "Traffic"; strace
cannot always name a socket's TCP ends, so they are not a test.)"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import MPI_ENV, REPO, mpirun_path, require
from hpc.runtime.runstore import RunFile

P = 6

# Open MPI's pml "monitoring" sits above the real PML (ob1) and counts what it is handed;
# enable=2 keeps messages of collectives ("I", internal) apart from user point-to-point ("E")
MONITORING = {"OMPI_MCA_pml_monitoring_enable": "2", "OMPI_MCA_pml_monitoring_enable_output": "3"}
LINE = re.compile(r"^([EI])\t(\d+)\t(\d+)\t(\d+) bytes\t(\d+) msgs sent", re.M)
def monitoring_available() -> bool:
    mpirun = mpirun_path()
    if mpirun is None:
        return False
    ompi_info = os.path.join(os.path.dirname(mpirun), "ompi_info")
    ompi_info = ompi_info if os.path.exists(ompi_info) else shutil.which("ompi_info")
    if ompi_info is None:
        return False
    out = subprocess.run([ompi_info], capture_output=True, text=True, timeout=60).stdout
    return re.search(r"MCA pml: monitoring", out) is not None


def sent_bytes(model_dir, adapter, generations, out):
    """A 2-rank ESSA run under Open MPI's monitoring: by rank, the bytes and messages its MPI
    layer sent; and the run file's own byte counter."""
    out.mkdir()
    prefix = out / "monitoring"
    args = ["-m", "essa", f"model.path={model_dir}", f"lora.adapter={adapter}",
            "task.n_train=200", "task.n_eval=32", f"essa.population={P}", "essa.minibatch=16",
            f"essa.generations={generations}", "essa.sigma0=0.5", "eval.every=0",
            "eval.n_samples=2", "eval.batch_size=16", "run.progress=false", f"run.out={out}"]
    env = {**os.environ, **MPI_ENV, **MONITORING, "OMPI_MCA_pml_monitoring_filename": str(prefix)}
    proc = subprocess.run([mpirun_path(), "-n", "2", "--oversubscribe", sys.executable, *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = {}
    for rank in (0, 1):
        text = open(f"{prefix}.{rank}.prof").read()
        rows = [(int(b), int(m)) for _, src, _, b, m in LINE.findall(text) if int(src) == rank]
        assert rows, text[:2000]
        sent[rank] = (sum(b for b, _ in rows), sum(m for _, m in rows))
    return sent, RunFile(str(out / "essa.h5")).group("bytes")


@pytest.mark.mpi
@pytest.mark.slow
def test_bytes_the_mpi_layer_sends_per_generation_do_not_grow_with_the_model(tiny_models,
                                                                              tmp_path):
    """Two random Qwen2 models (the second 7x the parameters, twice the singular values
    searched), 2 ranks, population 6: what a 4-generation run sent minus what a 2-generation
    run sent, halved, is one generation's traffic. Counted by Open MPI's monitoring it is the
    same number of bytes at both sizes, and so is the whole run's; and it is a few hundred
    bytes, under a tenth of one float32 copy of the small model's LoRA adapter."""
    require(monitoring_available(), "Open MPI's pml monitoring component (ompi_info)")
    per_generation, total = {}, {}
    for i, (name, (model_dir, adapter, n_params)) in enumerate(tiny_models.items()):
        # run folders (and model folders) of one length at both sizes: the whole runs' counts
        # are compared too, and a string such as a path may cross the ranks at start
        runs = {g: sent_bytes(model_dir, adapter, g, tmp_path / f"m{i}-{g}") for g in (2, 4)}
        (two, _), (four, counter) = runs[2], runs[4]
        per_generation[name] = {r: tuple((four[r][i] - two[r][i]) / 2 for i in range(2))
                                for r in (0, 1)}
        total[name] = four
        # the package's own counter (what the fitness collective returned, each rank's share
        # included) agrees: 8 bytes a member a generation at both sizes
        assert counter["fitness"].tolist() == [8 * P] * 4, counter["fitness"]
        own = {k: int(v[1]) for k, v in counter.items() if k not in ("step", "eval")}
        print(f"{name} ({n_params:,} parameters): MPI layer, bytes (messages) sent per "
              f"generation: rank 0 {per_generation[name][0][0]:g} "
              f"({per_generation[name][0][1]:g}), rank 1 {per_generation[name][1][0]:g} "
              f"({per_generation[name][1][1]:g}); whole 4-generation run: rank 0 "
              f"{four[0][0]} ({four[0][1]}), rank 1 {four[1][0]} ({four[1][1]}); the "
              f"package's own counter, received per rank in generation 2: {own}")
    assert tiny_models["large"][2] >= 4 * tiny_models["small"][2]
    lora_params = sum(t.numel() for t in _adapter_tensors(tiny_models["small"][1]))
    for rank in (0, 1):
        # the MPI layer's counts: the same at both sizes, per generation and for the whole run
        assert per_generation["small"][rank] == per_generation["large"][rank]
        assert total["small"][rank] == total["large"][rank]
        for name in per_generation:
            gen_bytes, _ = per_generation[name][rank]
            assert 8 * P / 2 <= gen_bytes < 4 * lora_params / 10  # fitness, no weights


def _adapter_tensors(adapter_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).values()
