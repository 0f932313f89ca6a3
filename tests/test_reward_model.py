"""A reward model's score as the reward (reward.*, hpc/data/reward_model.py): the scores against
a direct forward of a toy sequence-classification model (batched, unbatched, left-truncated),
ArmoRM-style heads, the one-line refusals, the task wrapper, the memory plan's term against
the loaded weights and torch's tracker, and an ESSA and an F-GRPO job on 2 ranks rewarded by
it."""
import json
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForSequenceClassification

from conftest import REPO, our_lines, run_mpi
from hpc.data.reward_model import RewardModel, load_reward_model, with_reward_model
from hpc.data.tasks import arith_task
from hpc.plan.terms import reward_model_scoring, reward_model_weights
from hpc.runtime.errors import UserError
from hpc.toys.toy import build_tokenizer, qwen2_config

PAIRS = [("12+34=", "46"), ("7-2=", "5 and some more words"), ("100+1=", "101"),
         ("3*3=", "9"), ("5+5=", "10, surely")]


def reward_section(folder, **changes):
    values = dict(model=str(folder), head="score", batch_size=8, max_tokens=2048,
                  trust_remote_code=False)
    return types.SimpleNamespace(**dict(values, **changes))


def save_toy_reward_model(folder, num_labels: int = 1, seed: int = 0, chat: bool = False):
    """A random tiny Qwen2ForSequenceClassification on the toy character tokenizer."""
    tok = build_tokenizer()
    config = qwen2_config(len(tok), hidden=32, layers=2)
    config.num_labels, config.max_position_embeddings = num_labels, 256
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config).eval()
    if chat:
        tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                             "{% endfor %}")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def toy_rm(tmp_path_factory):
    return save_toy_reward_model(tmp_path_factory.mktemp("rm") / "toy-rm")


def direct_scores(folder, texts, last: int | None = None):
    """logits[0, 0] of each text alone (its last ``last`` tokens), straight from
    transformers (the folder's tokenizer and model)."""
    model = Qwen2ForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"][:, -(last or 10 ** 9):]
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_scores_are_the_models_forward_batched_or_not(toy_rm):
    prompts, completions = zip(*PAIRS)
    batched = load_reward_model(reward_section(toy_rm, batch_size=3), "float32", "cpu")
    alone = load_reward_model(reward_section(toy_rm, batch_size=1), "float32", "cpu")
    expected = direct_scores(toy_rm, [p + c for p, c in PAIRS])
    assert batched.score(list(prompts), list(completions)) == pytest.approx(expected, abs=1e-5)
    assert alone.score(list(prompts), list(completions)) == pytest.approx(expected, abs=1e-5)
    assert len(set(np.round(expected, 4))) == len(PAIRS), "the scores would prove nothing"


def test_longer_rows_keep_their_last_max_tokens(toy_rm):
    rm = load_reward_model(reward_section(toy_rm, batch_size=2, max_tokens=8), "float32", "cpu")
    texts = [p + c for p, c in PAIRS]
    assert rm.score(*map(list, zip(*PAIRS))) == pytest.approx(
        direct_scores(toy_rm, texts, last=8), abs=1e-5)
    assert direct_scores(toy_rm, texts[1:2], last=8) != pytest.approx(
        direct_scores(toy_rm, texts[1:2]), abs=1e-4)


def test_a_chat_template_renders_user_and_assistant(tmp_path):
    folder = save_toy_reward_model(tmp_path / "chat-rm", chat=True)
    rm = load_reward_model(reward_section(folder), "float32", "cpu")
    assert rm.texts(["1+1="], ["2"]) == ["user: 1+1=\nassistant: 2\n"]
    assert rm.score(["1+1="], ["2"]) == pytest.approx(
        direct_scores(folder, ["user: 1+1=\nassistant: 2\n"]), abs=1e-5)


class ArmoRMStyle(torch.nn.Module):
    """An in-memory model whose output has ArmoRM's ``.score`` (B, 1) and ``.rewards`` (B, 3):
    functions of each row's length, so a row's values are known."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, input_ids, attention_mask):
        length = attention_mask.sum(dim=1, keepdim=True).float()  # (B, 1)
        return types.SimpleNamespace(score=-length, rewards=length * self.w,
                                     logits=torch.zeros(len(length), 3))


def test_armorm_style_heads():
    tok = build_tokenizer()
    score = RewardModel(ArmoRMStyle(), tok, None, 2, 64, "armo")
    assert score.score(["ab", "c"], ["c", "de"]) == [-3.0, -3.0]
    second = RewardModel(ArmoRMStyle(), tok, 2, 2, 64, "armo")
    assert second.score(["ab", "c"], ["cd", ""]) == [12.0, 3.0]
    with pytest.raises(UserError, match=r"armo has 3 objectives \(objective:0 to objective:2\)"):
        RewardModel(ArmoRMStyle(), tok, 3, 2, 64, "armo")


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_refusals_name_what_is_supported(tmp_path, toy_rm):
    two = save_toy_reward_model(tmp_path / "two-labels", num_labels=2)
    with pytest.raises(UserError) as err:
        load_reward_model(reward_section(two), "float32", "cpu")
    assert "reward.head=score" in one_line(err) and "2 labels" in one_line(err)
    assert "objective:<i>" in one_line(err)
    with pytest.raises(UserError) as err:
        load_reward_model(reward_section(toy_rm, head="objective:0"), "float32", "cpu")
    assert "gives no .rewards" in one_line(err)
    with pytest.raises(UserError) as err:
        load_reward_model(reward_section(toy_rm, head="preference"), "float32", "cpu")
    assert one_line(err).startswith("reward.head='preference' is not one of 'score'")
    remote = tmp_path / "remote"
    shutil.copytree(toy_rm, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForSequenceClassification": "modeling.RM"}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        load_reward_model(reward_section(remote), "float32", "cpu")
    assert "set reward.trust_remote_code=true" in one_line(err)
    with pytest.raises(UserError) as err:
        load_reward_model(reward_section(tmp_path / "nowhere"), "float32", "cpu")
    assert one_line(err) == f"reward model folder not found: {tmp_path / 'nowhere'}"


def test_the_wrapped_task_scores_with_the_model_against_its_prompts(toy_rm):
    task = arith_task(20, 8, 2, "+", 0)
    section = reward_section(toy_rm, batch_size=4)
    assert with_reward_model(task, reward_section(""), "float32", "cpu") is task
    scored = with_reward_model(task, section, "float32", "cpu")
    assert scored.train.answers == task.train.prompts and scored.eval.answers == task.eval.prompts
    assert scored.eval.subset([3, 1]).answers == [task.eval.prompts[3], task.eval.prompts[1]]
    completions = [f" {i}" for i in range(len(task.eval))]
    rm = load_reward_model(section, "float32", "cpu")
    assert scored.rewards(completions, scored.eval.answers) == pytest.approx(
        rm.score(task.eval.prompts, completions), abs=1e-6)


def plan_config(folder, dtype="float32", **reward):
    return types.SimpleNamespace(model=types.SimpleNamespace(dtype=dtype),
                                 reward=reward_section(folder, **reward))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_weights_are_the_loaded_parameters(toy_rm, dtype):
    (label, planned), = reward_model_weights(plan_config(toy_rm, dtype))
    rm = load_reward_model(reward_section(toy_rm), dtype, "cpu")
    loaded = sum(p.numel() * p.element_size() for p in rm.model.parameters())
    assert planned == loaded and f"{dtype})" in label
    assert reward_model_weights(plan_config("")) == [] == reward_model_scoring(plan_config(""))


def test_planned_scoring_batch_bounds_torchs_tracker(toy_rm):
    """One scoring forward of 4 rows x 200 tokens on torch's tracker (live tensor bytes on
    CPU, the weights excluded) against the plan's term: within it, and at least half of it."""
    sys.path.insert(0, f"{REPO}/benchmarks")
    from memory_tracker import LiveBytesTracker

    rm = load_reward_model(reward_section(toy_rm, batch_size=4, max_tokens=200), "float32",
                           "cpu")
    (_, planned), = reward_model_scoring(plan_config(toy_rm, batch_size=4, max_tokens=200))
    weights = sum(p.numel() * p.element_size() for p in rm.model.parameters())
    tracker = LiveBytesTracker()
    with tracker:
        rm.score(["1+2=" * 50] * 4, ["3" * 10] * 4)
    measured = tracker.peaks["all"] - weights
    print(f"scoring batch: planned {planned:,} bytes, tracked {measured:,}")
    assert planned / 2 <= measured <= planned


def test_both_plans_charge_the_weights_in_every_phase_and_a_batch_where_they_decode(
        tmp_path, toy_rm):
    """The cluster config on Qwen2.5-1.5B's shape with the toy reward model: its weights in
    every phase of ESSA's and F-GRPO's plans, its scoring batch in the phases that score
    (ESSA's scoring, F-GRPO's rollout, both evaluations), not in F-GRPO's training."""
    from essa.plan import plan as essa_plan
    from fgrpo.plan import plan as fgrpo_plan
    from hpc.engine.shape import QWEN25, ModelShape
    from hpc.job.config import plan_job_class
    from hpc.runtime.config import load_config

    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        QWEN25["1.5B"], model_type="qwen2", architectures=["Qwen2ForCausalLM"])))
    cluster = f"{REPO}/configs/cluster/math.yaml"
    cfg = load_config(plan_job_class(), cluster, [f"model.path={folder}",
                                                  f"reward.model={toy_rm}"])
    (weights_label, weights), = reward_model_weights(cfg)
    (scoring_label, scoring), = reward_model_scoring(cfg)
    shape = ModelShape.from_folder(str(folder))
    for plan, scored in ((essa_plan(shape, cfg, 16), {"ESSA scoring", "evaluation"}),
                         (fgrpo_plan(shape, cfg, 8), {"rollout", "evaluation"})):
        for phase in plan.phases:
            labels = [label for label, _ in phase.parts]
            assert labels.count(weights_label) == 1, (plan.method, phase.name)
            assert labels.count(scoring_label) == (phase.name in scored), (plan.method,
                                                                           phase.name)
    plain = load_config(plan_job_class(), cluster, [f"model.path={folder}"])
    assert essa_plan(shape, cfg, 16).phase("ESSA scoring").peak == pytest.approx(
        essa_plan(shape, plain, 16).phase("ESSA scoring").peak + weights + scoring)


@pytest.fixture(scope="module")
def toy_lora(tmp_path_factory):
    """A LoRA adapter of the toy model with random B factors (ESSA's singular values)."""
    from transformers import AutoModelForCausalLM

    from hpc.models.loading import attach_lora, randomize_lora_b, save_adapter
    from hpc.toys.toy import toy_model_path

    model = AutoModelForCausalLM.from_pretrained(toy_model_path())
    peft_model = attach_lora(model, 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    randomize_lora_b(peft_model, 0.1, torch.Generator().manual_seed(1))
    out = str(tmp_path_factory.mktemp("toy-lora") / "adapter")
    save_adapter(peft_model, out)
    return out


def on_the_task_grid(values, rows: int) -> bool:
    """Whether every mean of ``rows`` 0/1 task rewards could give ``values``."""
    return bool(np.allclose(np.asarray(values) * rows, np.round(np.asarray(values) * rows)))


def run_job(ranks: int, method: str, out, toy_rm, *args):
    """``method`` on the toy model rewarded by ``toy_rm`` on ``ranks`` ranks: its run file."""
    from hpc.runtime.runstore import RunFile

    proc = run_mpi(ranks, ["-m", method, "model.path=toy", "task.n_train=64", "task.n_eval=8",
                           "eval.every=0", "eval.n_samples=2", "eval.batch_size=8",
                           "run.progress=false", f"reward.model={toy_rm}",
                           "reward.max_tokens=64", f"run.out={out}", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return RunFile(str(out / f"{method}.h5"))


@pytest.mark.mpi
@pytest.mark.toy
def test_essa_on_2_ranks_with_a_reward_model(toy_rm, toy_lora, tmp_path):
    """Fitness is each member's mean score (off the 0/1 task's grid), the same whether one rank
    scores all 4 members or two ranks 2 each."""
    args = (f"lora.adapter={toy_lora}", "essa.population=4", "essa.minibatch=8",
            "essa.generations=2")
    two = run_job(2, "essa", tmp_path / "two", toy_rm, *args)
    fitness = two.group("essa")["fitness"]  # (2, 4)
    assert fitness.shape == (2, 4) and np.isfinite(fitness).all()
    assert not on_the_task_grid(fitness, 8) and fitness.std() > 0
    assert sorted(set(two.group("essa")["evaluated_by"][0].tolist())) == [0, 1]
    avg = two.group("eval")["avg_at_n"]
    assert np.isfinite(avg).all() and not on_the_task_grid(avg, 16)
    one = run_job(1, "essa", tmp_path / "one", toy_rm, *args, "essa.generations=1")
    assert one.group("essa")["fitness"][0] == pytest.approx(fitness[0], rel=1e-5)


@pytest.mark.mpi
@pytest.mark.toy
def test_fgrpo_on_2_ranks_with_a_reward_model(toy_rm, tmp_path):
    """The step's mean reward is the score's (off the task's grid), the same on 1 and 2 ranks
    (F-GRPO's rollouts do not depend on the rank count)."""
    args = ("fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=4",
            "fgrpo.reward.success_threshold=0.0")
    reward = run_job(2, "fgrpo", tmp_path / "two", toy_rm, *args, "fgrpo.steps=2").group(
        "metrics")["reward_mean"]  # (2,)
    assert np.isfinite(reward).all() and not on_the_task_grid(reward, 16)
    one = run_job(1, "fgrpo", tmp_path / "one", toy_rm, *args, "fgrpo.steps=1")
    assert one.group("metrics")["reward_mean"][0] == pytest.approx(reward[0], rel=1e-5)


@pytest.mark.mpi
def test_a_missing_reward_model_ends_the_job_in_one_line(tiny_models, tmp_path):
    """Before torch is imported (hpc.job.inputs.check_inputs), on every rank."""
    from test_run_folder import BEFORE_TORCH, before_torch
    model_dir, adapter_dir, _ = tiny_models["small"]
    proc = run_mpi(2, ["-c", BEFORE_TORCH, f"model.path={model_dir}",
                       f"lora.adapter={adapter_dir}", f"reward.model={tmp_path / 'nowhere'}",
                       f"run.out={tmp_path / 'run'}"])
    lines = our_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].endswith(f"reward model folder not found: {tmp_path / 'nowhere'}")
    assert before_torch(proc)
    assert not (tmp_path / "run").exists()
