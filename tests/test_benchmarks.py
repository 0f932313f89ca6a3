"""Every script in benchmarks/ runs end to end at a tiny size, as a user starts it.

``communication.py`` and ``memory.py`` start their own ranks with the real mpirun
(``benchmarks/common.py``'s ``launch_mpi``); the others run as one process. ``gpu_check.py``
runs its CPU path on the ``tiny`` shape. Figures are not checked (they are machine-dependent
and live in README/benchmarks/results); the tables must be complete. A hung run is killed with
its whole process group (mpirun and its ranks) and fails the test.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import MPI_ENV, REPO, mpirun_path, require

BENCHMARKS = os.path.join(REPO, "benchmarks")
TIMEOUT_S = 600  # a loaded shared machine; a hang fails at this point instead of never

# script: (arguments at smoke size, needs mpirun, lines the output must contain)
SMOKE = {
    "communication.py": (["--ranks", "1", "2", "--population", "4", "--repeats", "2"], True,
                         ["1 ranks. ESSA per generation", "2 ranks. ESSA per generation",
                          "qwen2.5-7b shape, LoRA r=8 on q/k/v/o"]),
    "memory.py": (["--ranks", "2", "--ks", "1", "--population", "4", "--minibatch", "2",
                   "--prompts", "2", "--num-generations", "2"], True,
                  ["ESSA generation, k=1 (P=4, M=2)", "F-GRPO step (2 prompts x G=2"]),
    "optimizer_cost.py": (["--dims", "8", "--population", "6", "--generations", "2"], False,
                          ["population 6, 2 generations", "cma", "openai-es"]),
    "host_ops.py": (["--model", "qwen2.5-1.5b", "--ks", "1", "--prompts", "1", "--tokens", "2",
                     "--repeats", "1"], False, ["qwen2.5-1.5b       28   1     1"]),
    "members_per_second.py": (["--ks", "1", "2", "--minibatches", "2", "--members", "2",
                               "--repeats", "1", "--population", "4", "--generations", "2"],
                              False, ["minibatch 2 prompts, 2 members", "OUTSIDE GENERATION"]),
    "engine_cpu.py": (["--rows", "4", "--ks", "2"], False, ["  2   fixed", "  2  spread"]),
    "backends.py": (["--repeats", "1", "--members", "2", "--prompts", "8", "--rollouts", "2"],
                    False, ["  essa  engine", " fgrpo      hf", "  eval      hf"]),
    "training_memory.py": (["--models", "tiny", "--tokens", "64", "--chunk", "16"], False,
                           ["tiny", "ckpt on  chunk 16"]),
    "gpu_check.py": (["--model", "tiny", "--device", "cpu", "--ks", "1", "2", "--prompts", "2",
                      "--minutes", "5", "--int8", "--rows", "4", "8", "--engine-ks", "1", "2"],
                     False, ["F-GRPO step (256 rows)", "int8/dtype", "wrote "]),
    "memory_tracker.py": (["--cases", "essa,after_evaluation,fgrpo", "--layers-from", "1", "2",
                           "eval.batch_size=2", "eval.n_samples=2", "essa.population=4",
                           "plan.max_prompt_tokens=8", "task.max_new_tokens=8",
                           "fgrpo.batch_prompts=2", "fgrpo.sampling.num_generations=2",
                           "fgrpo.optim.micro_batch=2"], False,
                          ["essa ", "after_evaluation ", "fgrpo "]),
    "cli_help.py": (["--repeats", "1"], False, ["python -c pass", "hpc-report", "x python"]),
    "job_start.py": (["--repeats", "1"], False, ["essa.trainer", "x python 0"]),
    "quantization.py": (["--models", "toy", "--n-eval", "8", "--minibatch", "4",
                         "--population", "4", "--members-per-pass", "2"], False,
                        ["toy (arith", "identical completions", "Spearman"]),
}


def run_script(args: list) -> tuple:
    """(return code, stdout, stderr) of ``python args...`` in its own process group."""
    env = dict(os.environ, **MPI_ENV)
    proc = subprocess.Popen([sys.executable] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script, mpirun and its ranks
        out, err = proc.communicate()
        pytest.fail(f"{args[0]} still running after {TIMEOUT_S} s (hung?):\n{err[-2000:]}")
    return proc.returncode, out, err


# imported by the scripts, not run alone (acceptance_ranks.py also runs as the ranks of
# gpu_acceptance.py's all-reduce part)
LIBRARIES = {"common.py", "engine_speed.py", "acceptance_parts.py", "acceptance_ranks.py"}
OWN_TESTS = {"gpu_acceptance.py": "test_gpu_acceptance.py"}  # run with checks of their own


def test_every_benchmark_has_a_smoke_test():
    scripts = {f for f in os.listdir(BENCHMARKS) if f.endswith(".py") and f not in LIBRARIES}
    assert scripts == set(SMOKE) | set(OWN_TESTS)
    assert all(os.path.exists(os.path.join(REPO, "tests", t)) for t in OWN_TESTS.values())


@pytest.mark.parametrize("script", sorted(SMOKE))
@pytest.mark.mpi  # communication.py and memory.py start mpirun themselves
@pytest.mark.toy  # several measure on the toy model
def test_benchmark_runs_at_smoke_size(script, tmp_path):
    args, needs_mpi, expected = SMOKE[script]
    if needs_mpi:
        require(mpirun_path() is not None, "mpirun")
    if script == "gpu_check.py":
        args = [str(tmp_path)] + args
    if script == "memory_tracker.py":  # a tiny Qwen2 shape: config.json alone, no weights
        (tmp_path / "config.json").write_text(json.dumps(dict(
            model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True)))
        args = [f"model.path={tmp_path}"] + args
    code, out, err = run_script([os.path.join(BENCHMARKS, script)] + args)
    assert code == 0, err[-3000:]
    assert out.startswith("machine: "), out[:500]
    for line in expected:
        assert line in out, f"{line!r} missing from:\n{out}"
    if script == "gpu_check.py":
        with open(tmp_path / "gpu_check.json") as fh:
            result = json.load(fh)["results"][0]
        assert [r["k"] for r in result["members"]] == [1, 2]
        assert all(r["lora_fused"]["members_per_s"] > 0 for r in result["members"])
        assert result["fgrpo_step"]["rows"] == 256
        # the step is the trainer's own update, not a copy of it
        assert result["fgrpo_step"]["phases_s"]["forward_backward"] > 0
        source = open(os.path.join(BENCHMARKS, "gpu_check.py")).read()
        assert "train_on_rollouts(" in source
        assert not any(name in source for name in ("policy_loss", "accumulate_gradients",
                                                   "torch.optim.AdamW", "sequence_logprobs"))
        int8 = result["int8"]
        assert int8["int8"]["weight_bytes"] < int8["model dtype"]["weight_bytes"]
        assert all(r["engine"]["tokens_per_s"] > 0 for r in int8["int8"]["engine"])
