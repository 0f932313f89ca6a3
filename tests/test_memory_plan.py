"""The pre-flight memory plan against hand computations on the real Qwen2.5 shapes, against
transformers' own parameter count, and against ESSA's run-time rule for members per pass."""
import json
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import REPO, our_lines, run_cli
from essa.batched import members_that_fit
from hpc.models.memory_plan import (DTYPE_BYTES, GIB, ModelShape, check_job_memory, essa_plan, fgrpo_plan,
                                    main, plan_job_class)
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError

# config.json of Qwen2.5 (the -Instruct and -Math variants have the same shapes)
QWEN25 = {
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                 tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
               tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, intermediate_size=27648, vocab_size=152064,
                tie_word_embeddings=False),
}
PARAMETERS = {"1.5B": 1_543_714_304, "7B": 7_615_616_512, "32B": 32_763_876_352}
CLUSTER = f"{REPO}/configs/cluster/math.yaml"


def model_folder(tmp_path, size):
    folder = tmp_path / f"Qwen2.5-{size}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        dict(QWEN25[size], model_type="qwen2", architectures=["Qwen2ForCausalLM"],
             torch_dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1e6)))
    return str(folder)


def cluster_config(folder, *overrides):
    return load_config(plan_job_class(), CLUSTER, [f"model.path={folder}", *overrides])


@pytest.mark.parametrize("size", sorted(QWEN25))
def test_parameters_by_hand_and_by_transformers(size):
    shape = ModelShape.from_config(dict(QWEN25[size], model_type="qwen2"))
    h, L, a, g = (QWEN25[size][k] for k in ("hidden_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads"))
    I, V = QWEN25[size]["intermediate_size"], QWEN25[size]["vocab_size"]
    kv = g * h // a
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * I + 2 * h
    by_hand = V * h * (1 if QWEN25[size]["tie_word_embeddings"] else 2) + L * layer + h
    assert shape.parameters() == by_hand == PARAMETERS[size]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25[size]))
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[size]


def test_7b_figures_by_hand(tmp_path):
    """Qwen2.5-7B at the cluster config, 16 ranks: bf16, LoRA r=8 on q/k/v/o, 512 + 512 tokens,
    eval.batch_size 64, population 96; F-GRPO fits at the config's micro_batch 8, not at 16."""
    cfg = cluster_config(model_folder(tmp_path, "7B"))
    shape = ModelShape.from_folder(cfg.model.path)
    lora = 28 * 8 * ((3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584))
    assert shape.lora_parameters(8, cfg.lora.targets) == lora == 5_046_272
    essa = essa_plan(shape, cfg, cfg.essa, ranks=16)
    weights = 7_615_616_512 * 2
    kv_token = 2 * 28 * 4 * 128 * 2  # K and V, all layers, bf16: 57,344 bytes
    act_token = (4 * 3584 + 3 * 18944) * 2
    member_pass = 64 * (1024 * (kv_token + act_token) + 4 * 152064)
    assert [b for _, b in essa.parts] == [weights, 6 * lora * 4, member_pass]
    assert essa.fits and essa.peak == weights + 6 * lora * 4 + member_pass
    assert fgrpo_plan(shape, cfg, cfg.fgrpo, ranks=16).fits  # micro_batch 8
    cfg = cluster_config(cfg.model.path, "fgrpo.micro_batch=16")
    fgrpo = fgrpo_plan(shape, cfg, cfg.fgrpo, ranks=16)
    lora_inputs_fp32 = 4 * 3584 * 4  # q, k, v, o inputs, cast to the fp32 adapter
    train_token = 28 * ((6 * 3584 + 2 * 512 + 3 * 18944) * 2 + lora_inputs_fp32) + 152064 * 6
    assert [b for _, b in fgrpo.parts] == [weights, lora * 16, 16 * 1024 * train_token]
    assert not fgrpo.fits and "fgrpo.micro_batch=8" in fgrpo.advice
    room = 0.9 * 80 * GIB - weights - lora * 16
    assert 8 * 1024 * train_token <= room < 9 * 1024 * train_token


def saved_bytes_per_token(dtype, layers, shape, lora: bool, batch=2, tokens=32):
    """Bytes autograd keeps for backward per token (parameters excluded) in a forward pass of a
    random Qwen2 of ``shape`` (+ LoRA r=8 on q/k/v/o) and the F-GRPO log-probabilities."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = Qwen2Config(**dict(shape, num_hidden_layers=layers), attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).to(dtype)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj"]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, shape["vocab_size"], (batch, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits[:, :-1].float()
        logits.gather(-1, ids[:, 1:, None]) - torch.logsumexp(logits, -1, keepdim=True)
    return sum(saved.values()) / (batch * tokens)


@pytest.mark.parametrize("dtype,lora", [("float32", True), ("bfloat16", True),
                                        ("bfloat16", False), ("float32", False)])
def test_training_activations_match_autograd(dtype, lora):
    """The plan's per-layer activations against what autograd really keeps (one layer more
    minus one layer less, so embeddings and logits cancel): within 3%."""
    tiny = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=2,
                intermediate_size=2000, vocab_size=512, tie_word_embeddings=False)
    torch_dtype = getattr(torch, dtype)
    measured = (saved_bytes_per_token(torch_dtype, 3, tiny, lora)
                - saved_bytes_per_token(torch_dtype, 2, tiny, lora))
    shape = ModelShape.from_config(dict(tiny, num_hidden_layers=3, model_type="qwen2"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if lora else []
    planned = shape.training_layer_bytes(DTYPE_BYTES[dtype], targets, full=not lora)
    assert planned == pytest.approx(measured, rel=0.03)


def test_essa_members_per_pass_follows_the_run_time_rule(tmp_path):
    cfg = cluster_config(model_folder(tmp_path, "7B"), "essa.members_per_pass=8")
    shape = ModelShape.from_folder(cfg.model.path)
    plan = essa_plan(shape, cfg, cfg.essa, ranks=16)
    config = types.SimpleNamespace(num_attention_heads=28, num_key_value_heads=4,
                                   hidden_size=3584, num_hidden_layers=28,
                                   intermediate_size=18944, vocab_size=152064)
    lora_bytes = shape.lora_parameters(8, cfg.lora.targets) * 4
    free = int(0.9 * 80 * GIB) - 7_615_616_512 * 2
    k = members_that_fit(config, 2, lora_bytes, free, 6, 64, 1024)
    assert f"members that fit per pass: {k} " in plan.notes[0]
    assert plan.parts[2][0].startswith(f"{min(k, 6)} member(s) per pass")


def test_full_finetune_with_reference(tmp_path):
    cfg = cluster_config(model_folder(tmp_path, "1.5B"), "fgrpo.full_finetune=true",
                         "fgrpo.beta=0.04", "plan.gpu_memory_gib=141")
    plan = fgrpo_plan(ModelShape.from_folder(cfg.model.path), cfg, cfg.fgrpo, ranks=16)
    n = 1_543_714_304
    assert [b for _, b in plan.parts[:3]] == [2 * n, 3 * 2 * n, 2 * n]


def test_32b_does_not_fit_one_80gib_gpu_and_says_what_to_change(tmp_path):
    cfg = cluster_config(model_folder(tmp_path, "32B"))
    with pytest.raises(UserError, match=r"memory plan: ESSA needs .* usable of "
                                        r"plan\.gpu_memory_gib=80; to fit: lower eval\.batch_size"):
        check_job_memory(cfg, "essa", 16, "cuda")
    check_job_memory(cfg, "essa", 16, "cpu")  # no GPU: nothing to check
    check_job_memory(cfg, "sft", 16, "cuda")  # planned: ESSA and F-GRPO only
    check_job_memory(load_config(plan_job_class(), CLUSTER, ["model.path=toy"]), "essa", 16,
                     "cuda")  # no config.json folder: the loader reports it


def test_hpc_plan_prints_both_methods(tmp_path, capsys):
    main([CLUSTER, f"model.path={model_folder(tmp_path, '7B')}", "--ranks", "16"])
    out = capsys.readouterr().out
    assert "7,615,616,512 parameters" in out and "GPU memory assumed: 80 GiB" in out
    assert "ESSA per GPU" in out and "F-GRPO per GPU" in out
    assert out.count(": fits") == 2 and "DOES NOT FIT" not in out


def test_job_that_cannot_fit_ends_before_loading_weights(tmp_path):
    """The real start of an ESSA job, its device reported as CUDA: one line, exit 2, no run
    folder (the model folder has no weights, so loading them would fail differently)."""
    probe = ("import types, sys, hpc.runtime.job as job\n"
             "job.select_device = lambda world, requested: types.SimpleNamespace(type='cuda')\n"
             "from essa.trainer import main\nmain(sys.argv[1:])\n")
    proc = run_cli(["-c", probe, CLUSTER, f"model.path={model_folder(tmp_path, '32B')}",
                    "lora.adapter=unused", f"run.out={tmp_path / 'run'}"], timeout=120)
    lines = our_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: memory plan: ESSA needs")
    assert not (tmp_path / "run").exists()
