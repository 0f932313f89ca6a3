"""configs/paper/f*-qwen2.5-7b.yaml: the F-GRPO paper's Qwen2.5-7B settings (Tables 5 and 7), the
memory plan on 16 x 80 GB, and the F-GRPO config's job on the toy shape."""
import glob
import os

import pytest

from conftest import REPO, run_mpi
from fgrpo.config import FGRPOJobConfig
from hpc.runtime.config import load_config
from hpc.runtime.runstore import RunFile
from test_memory_plan import model_folder

PAPER = {name: f"{REPO}/configs/paper/{name}-qwen2.5-7b.yaml" for name in ("fgrpo", "fdapo",
                                                                             "fcispo")}
# the keys a paper config's toy run changes: the model and task (the toy reads arith, not
# DeepScaleR) and the sizes a CPU run can hold (2 steps of 8 prompts in 4 updates of 2, the
# paper's 256 in 4 of 64); every other key is the config's: bf16 full fine-tuning under FSDP2,
# activation checkpointing, lr 1e-6 after 15 warm-up steps, weight decay, clipping, the preset
TOY = ["model.path=toy", "task.name=arith", "task.train_path=",
       "task.eval_path=", "task.prompt_format=plain", "task.n_train=64", "task.n_eval=8",
       "task.max_new_tokens=8", "plan.max_prompt_tokens=16", "fgrpo.steps=2",
       "fgrpo.batch_prompts=8", "fgrpo.optim.mini_batch_prompts=2", "eval.every=0",
       "eval.n_samples=2", "eval.batch_size=8", "model.decode_batch=8", "run.progress=false"]


def test_the_three_configs_are_the_papers_table_5_and_7():
    assert sorted(glob.glob(f"{REPO}/configs/paper/f*.yaml")) == sorted(PAPER.values())
    gamma = {"fgrpo": 0.5, "fdapo": 0.5, "fcispo": 1.0}
    for name, path in PAPER.items():
        cfg = load_config(FGRPOJobConfig, path, [])
        f = cfg.fgrpo
        assert (cfg.model.path, cfg.task.name, cfg.plan.max_prompt_tokens) == \
            ("Qwen/Qwen2.5-7B", "deepscaler", 1024)
        assert (f.full_finetune, f.parallel.strategy, f.batch_prompts,
                f.sampling.num_generations) == (True, "fsdp2", 256, 8)
        o = f.optim
        assert (o.learning_rate, o.warmup_steps, o.weight_decay, o.max_grad_norm,
                o.num_iterations, o.mini_batch_prompts) == (1e-6, 15, 0.01, 1.0, 1, 64)
        assert f.advantage.gamma == gamma[name], name
    grpo, dapo, cispo = (load_config(FGRPOJobConfig, PAPER[n], []).fgrpo
                         for n in ("fgrpo", "fdapo", "fcispo"))
    assert (grpo.loss.clip.epsilon, grpo.loss.clip.epsilon_high) == (0.2, 0.2)
    assert (dapo.loss.clip.epsilon, dapo.loss.clip.epsilon_high,
            dapo.sampling.dynamic_sampling) == (0.2, 0.28, True)
    assert (cispo.loss.surrogate, cispo.loss.cispo.epsilon_low,
            cispo.loss.cispo.epsilon_high) == ("cispo", 1.0, 5.0)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_hpc_plan_says_each_fits_16_gpus_of_80_gb(name, tmp_path, capsys):
    from hpc.commands import plan as main
    main([PAPER[name], f"model.path={model_folder(tmp_path, '7B')}", "--ranks", "16"])
    out = capsys.readouterr().out
    fgrpo = out[out.index("F-GRPO per GPU"):]
    assert "GPU memory assumed: 80 GiB" in out
    peak = next(line for line in fgrpo.splitlines() if line.strip().startswith("peak"))
    assert peak.rstrip().endswith("of 72.00 GiB usable: fits"), peak


@pytest.mark.mpi
@pytest.mark.toy
def test_the_fgrpo_config_runs_on_the_toy(tmp_path):
    """The F-GRPO config's job with the model swapped for the toy (and the sizes of TOY):
    full fine-tuning under FSDP2 on 2 ranks, 4 mini-batch updates a step, the warm-up; with
    eval.sampled_every=1 a full evaluation after step 1 beside the end's, the checkpoints
    hpc-report reproduce --checkpoint paper chooses from."""
    from compare.reproduce_runs import Run
    out = tmp_path / "run"
    proc = run_mpi(2, ["-m", "fgrpo", PAPER["fgrpo"], *TOY, "eval.sampled_every=1",
                       f"run.out={out}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    metrics = run.group("metrics")
    assert metrics["step"].tolist() == [1, 2] and metrics["updates"].tolist() == [4, 4]
    assert metrics["skipped_steps"].tolist() == [0, 0]
    for line in ("full_finetune: true", "strategy: fsdp2", "weight_decay: 0.01",
                 "dtype: bfloat16", "warmup_steps: 15", "learning_rate: 1.0e-06",
                 "mini_batch_prompts: 2", "max_grad_norm: 1.0", "epsilon_high: 0.2\n",
                 "gamma: 0.5"):
        assert line in run.attrs["config"], line
    assert os.path.isfile(out / "model" / "config.json")  # full fine-tuning exports the model
    evaluations = Run(str(out / "fgrpo.h5")).evaluations
    assert [e.step for e in evaluations] == [1, 2]
    assert all(len(e.passk) == 2 and e.tokens > 0 for e in evaluations)


@pytest.mark.subprocess
def test_the_cluster_script_submits_each_pair_per_seed(tmp_path):
    """jobscripts/fgrpo-paper.sh --dry-run: per config and seed a plain job (gamma 0) and a
    focal one (the preset's gamma), 16 GPUs on two nodes, all in RUN_ROOT/family."""
    import subprocess
    proc = subprocess.run(["bash", "jobscripts/fgrpo-paper.sh", "--dry-run", "run.seed=9"],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, SEEDS="0 1", RUN_ROOT=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 * 2 * 2
    for name in PAPER:
        mine = [line for line in lines if f"configs/paper/{name}-qwen2.5-7b.yaml" in line]
        assert len(mine) == 4 and sum("fgrpo.advantage.gamma=0" in line for line in mine) == 2
    assert all(line.startswith(f"RUN_ROOT={tmp_path}/family sbatch") and "--ntasks=16" in line
               and "--nodes=2" in line and "run.seed=" in line for line in lines)
