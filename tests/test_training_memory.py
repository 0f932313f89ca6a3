"""Activation checkpointing and chunked log-probs (hpc/models/logprobs.py) against the reference
paths: same values and gradients, and what each keeps alive, counted tensor by tensor."""
import json
import os
import sys

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from conftest import REPO, run_mpi

from hpc.models.loading import attach_lora, enable_activation_checkpointing, randomize_lora_b
from hpc.models.logprobs import masked_mean, sequence_logprobs
from hpc.job.config import plan_job_class
from hpc.plan.registry import activation_checkpointing
from hpc.toys.toy import qwen2_config
from hpc.runtime.config import load_config
from hpc.runtime.runstore import RunFile
from sft.trainer import completion_loss

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from training_memory import LiveTensorBytes  # noqa: E402 - the benchmark's tracker

TARGETS = ["q_proj", "v_proj", "up_proj"]


def tiny(vocab=50, lora=True, dropout=0.0, checkpointed=False, seed=0):
    """A random 2-layer Qwen2 (hidden 32) in training mode: LoRA with tied embeddings (as
    Qwen2.5-1.5B) or full fine-tuning with an untied LM head (as 7B and 32B)."""
    torch.manual_seed(seed)
    config = qwen2_config(vocab, hidden=32, layers=2, heads=4, kv_heads=2)
    config.tie_word_embeddings = lora
    model = Qwen2ForCausalLM(config)
    if lora:
        model = attach_lora(model, 4, 8.0, TARGETS, dropout, seed=seed)
        randomize_lora_b(model, 0.1, torch.Generator().manual_seed(seed))
    if checkpointed:
        enable_activation_checkpointing(model)
    return model.train()


def batch(vocab=50, rows=3, length=11, seed=1):
    """Random ids (rows, length) with left padding on row 1 (3 tokens) as rollouts have."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, length), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0
    ids[1, :3] = 0
    return ids, attn


def logprobs_and_grads(model, ids, attn, chunk, seed=5):
    """Log-probs, entropies (valid positions) and the gradients of a weighted sum of the
    log-probs, with torch's RNG seeded (dropout) as the trainer does."""
    torch.manual_seed(seed)
    logp, entropy = sequence_logprobs(model, ids, attn, chunk, with_entropy=True)
    valid = attn[:, 1:].bool()
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view(logp.shape)
    torch.where(valid, logp * weights, torch.zeros_like(logp)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return logp[valid].detach(), entropy[valid], grads


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])  # 7 does not divide the 30 positions
def test_chunked_logprobs_and_entropy_equal_the_full_logits(lora, chunk):
    ids, attn = batch()
    ref_logp, ref_entropy, ref_grads = logprobs_and_grads(tiny(lora=lora), ids, attn, 0)
    logp, entropy, grads = logprobs_and_grads(tiny(lora=lora), ids, attn, chunk)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    if not lora:  # the LM head trains through the chunks' recompute
        assert grads["lm_head.weight"].abs().sum() > 0
    for name, grad in grads.items():  # summed over the chunks in another order: a few ulps
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_no_grad_chunked_logprobs_equal_the_full_logits():
    ids, attn = batch()
    model = tiny().eval()
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, ids, attn, 0)
        logp, _ = sequence_logprobs(model, ids, attn, 4)
    valid = attn[:, 1:].bool()
    torch.testing.assert_close(logp[valid], ref[valid], rtol=0, atol=1e-6)
    assert masked_mean(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]])) == 1.0


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("chunk", [0, 8])
def test_checkpointed_gradients_equal_unchecked_ones(lora, chunk):
    """With LoRA dropout 0.3 the recompute must replay the forward's masks; torch's RNG ends
    where it ends without checkpointing, so the next step draws the same (resume stays
    bitwise)."""
    ids, attn = batch()
    results, rng_after = [], []
    for checkpointed in (False, True):
        model = tiny(lora=lora, dropout=0.3 if lora else 0.0, checkpointed=checkpointed)
        results.append(logprobs_and_grads(model, ids, attn, chunk))
        rng_after.append(torch.get_rng_state())
    (ref_logp, _, ref_grads), (logp, _, grads) = results
    assert torch.equal(logp, ref_logp)
    assert torch.equal(rng_after[0], rng_after[1])
    for name, grad in grads.items():  # summed over the chunks in another order: a few ulps
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)
    if lora:  # dropout really acted: another seed gives other gradients
        other = logprobs_and_grads(tiny(lora=lora, dropout=0.3, checkpointed=True), ids, attn,
                                   chunk, seed=6)[2]
        assert any(not torch.equal(other[n], ref_grads[n]) for n in ref_grads)


@pytest.mark.parametrize("chunk", [5, 64])
def test_sft_chunked_loss_equals_transformers_loss(chunk):
    ids, attn = batch()
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :4] = -100  # the prompt
    losses, grads = [], []
    for c in (0, chunk):
        model = tiny()
        loss = completion_loss(model, ids, attn, labels, c)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def micro_batch_peak(vocab, chunk, rows=2, length=64, checkpointed=False):
    """Peak bytes allocated by one micro-batch's log-probs + entropy + backward (LoRA)."""
    model = tiny(vocab=vocab, checkpointed=checkpointed)
    ids, attn = batch(vocab, rows, length)
    with LiveTensorBytes(list(model.parameters()) + list(model.buffers())) as tracker:
        logp, entropy = sequence_logprobs(model, ids, attn, chunk, with_entropy=True)
        (logp * attn[:, 1:]).sum().backward()
        del logp, entropy
    return tracker.peak


def test_chunked_peak_grows_with_the_vocabulary_by_one_chunk_only():
    """Vocabulary 512 -> 2048 (4x), 2 x 63 positions: the full logits' peak grows by more
    than the micro-batch's fp32 logits; the chunked one (16 positions) only by one chunk's
    16 bytes per (position x vocabulary entry) (fp32 logits and their gradient temporaries),
    under four fp32 (chunk, V) tensors at the larger vocabulary. Checkpointing lowers it."""
    small, large, positions, chunk = 512, 2048, 2 * 63, 16
    full_growth = micro_batch_peak(large, 0) - micro_batch_peak(small, 0)
    chunked_growth = micro_batch_peak(large, chunk) - micro_batch_peak(small, chunk)
    assert full_growth > positions * (large - small) * 4
    assert 0 < chunked_growth < 4 * chunk * large * 4
    assert micro_batch_peak(large, chunk) < micro_batch_peak(large, 0) / 2
    assert micro_batch_peak(small, chunk, checkpointed=True) < micro_batch_peak(small, chunk)


def fgrpo_losses(args, out, *memory):
    proc = run_mpi(2, ["-m", "fgrpo", *args, "fgrpo.steps=2", "fgrpo.loss.beta=0.1",
                       "fgrpo.optim.num_iterations=2", "fgrpo.optim.micro_batch=8", "eval.every=0",
                       "eval.n_samples=2", "run.progress=false", f"run.out={out}", *memory])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunFile(str(out / "fgrpo.h5"))
    return run.group("metrics"), run.attrs["activation_checkpointing"]


@pytest.mark.parametrize("setup", ["lora", "full"])
@pytest.mark.mpi
@pytest.mark.toy
def test_fgrpo_checkpointed_and_chunked_equals_the_reference_path(setup, request, tmp_path):
    """F-GRPO on the toy under mpirun -n 2 (KL to the reference and mu = 2, so the frozen
    log-probs go through the chunks too), LoRA from the SFT adapter and full fine-tuning of
    the base: checkpointing on with 7-position chunks logs the losses, KL and entropy of
    checkpointing off with full logits, within 1e-6."""
    args = ["model.path=toy", "task.n_train=1000", "task.n_eval=8", "fgrpo.batch_prompts=8",
            "fgrpo.sampling.num_generations=4"]
    args += ([f"lora.adapter={request.getfixturevalue('toy_adapter')}"] if setup == "lora"
             else ["fgrpo.full_finetune=true", "fgrpo.optim.learning_rate=1e-4"])
    ref, ref_on = fgrpo_losses(args, tmp_path / "ref", "model.activation_checkpointing=off",
                               "model.logprob_chunk=0")
    new, new_on = fgrpo_losses(args, tmp_path / "new", "model.activation_checkpointing=on",
                               "model.logprob_chunk=7")
    assert (ref_on, new_on) == (False, True)
    assert ref["step"].tolist() == new["step"].tolist() == [1, 2]
    assert ref["kl"][-1] > 0  # the policy moved away from its reference
    for key in ("loss", "kl", "entropy", "ratio_mean", "reward_mean"):
        # the chunks and the recompute sum in another order: float32 rounding, relative 3e-6
        np.testing.assert_allclose(new[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_sft_demo_steps_checkpointed_and_chunked_equal_the_reference_path(tmp_path):
    """SFT's 10 demo steps (configs/demo/sft.yaml) under mpirun -n 2: checkpointing on with
    7-position chunks logs the loss of checkpointing off with transformers' full logits within
    3e-7 absolute at every step (the loss is a mean of terms of order 1: float32 rounding;
    1.3e-7 measured)."""
    losses = []
    for name, memory in (("ref", ["model.activation_checkpointing=off", "model.logprob_chunk=0"]),
                         ("new", ["model.activation_checkpointing=on", "model.logprob_chunk=7"])):
        out = tmp_path / name
        proc = run_mpi(2, ["-m", "sft", "configs/demo/sft.yaml", "task.n_eval=8",
                           "eval.n_samples=2", "eval.every=0", "run.progress=false",
                           f"run.out={out}", *memory])
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = RunFile(str(out / "sft.h5"))
        assert run.attrs["activation_checkpointing"] == (name == "new")
        losses.append(run.group("metrics")["loss"])
    ref, new = losses
    assert len(ref) == len(new) == 10 and ref[-1] < ref[0]
    print(f"SFT loss, largest difference over 10 steps: {np.max(np.abs(new - ref)):.2e}")
    np.testing.assert_allclose(new, ref, rtol=0, atol=3e-7)


def test_auto_turns_checkpointing_on_where_the_plan_needs_it(tmp_path):
    """Qwen2.5-7B at the cluster config (bf16, 512 + 512 tokens, 80 GB, 8 ranks): micro_batch 6
    fits without checkpointing, 8 does not (the F-GRPO plan beside the rollout's engine); on/off
    (YAML 1.1 reads them as booleans) are taken as given, and nothing is planned off CUDA."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
        tie_word_embeddings=False)))

    def on(*overrides, device="cuda", method="fgrpo"):
        cfg = load_config(plan_job_class(), os.path.join(REPO, "configs/cluster/math.yaml"),
                          [f"model.path={tmp_path}", *overrides])
        return activation_checkpointing(cfg, method, 8, device)

    assert not on("fgrpo.optim.micro_batch=6") and on("fgrpo.optim.micro_batch=8")
    assert not on("fgrpo.optim.micro_batch=16", device="cpu")
    assert not on("fgrpo.optim.micro_batch=16", "plan.gpu_memory_gib=0")
    assert on("fgrpo.optim.micro_batch=1", "model.activation_checkpointing=on", device="cpu")
    assert not on("fgrpo.optim.micro_batch=16", "model.activation_checkpointing=off")
    assert on("fgrpo.optim.micro_batch=8", "fgrpo.full_finetune=true")  # 4 x 14.2 GiB of state


@pytest.mark.parametrize("overrides", [
    ["fgrpo.optim.num_iterations=2", "fgrpo.loss.beta=0.1", "fgrpo.optim.mini_batch_prompts=2"],
    ["fgrpo.loss.beta=0.1"], []])
def test_the_held_rollouts_term_is_what_the_step_holds(overrides):
    """fgrpo.plan.held_rollout_parts against the tracker: the step's rollouts, the frozen
    log-probs fgrpo.step computes (the sampling policy's only where an update is off-policy,
    the reference's where beta > 0: the adapter disabled) and an update's copy of its rows."""
    from fgrpo.config import FGRPOJobConfig
    from fgrpo.plan import held_rollout_parts
    from fgrpo.rollout import Rollouts
    from fgrpo.step import frozen_logprobs, mini_batches, reference_model, updates_per_epoch

    cfg = load_config(FGRPOJobConfig, None, [
        "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=3", "task.max_new_tokens=6",
        "plan.max_prompt_tokens=10", "fgrpo.optim.micro_batch=5", *overrides])
    f, ranks, T = cfg.fgrpo, 2, 16
    n = f.batch_prompts // ranks
    model = tiny()
    with torch.no_grad(), LiveTensorBytes(list(model.parameters())) as tracker:
        ids = torch.randint(0, 50, (n * 3, T))
        rollouts = Rollouts(ids, torch.ones_like(ids), torch.ones(n * 3, T),
                            torch.zeros(n, 3), torch.zeros(n, 3),
                            torch.full((n * 3,), 6), torch.zeros(n * 3, dtype=torch.bool))
        U = updates_per_epoch(f)
        frozen = []
        if f.optim.num_iterations > 1 or U > 1:
            frozen.append(frozen_logprobs(model, rollouts, f.optim.micro_batch, 0))
        if f.loss.beta > 0:
            with reference_model(model, None) as ref:
                frozen.append(frozen_logprobs(ref, rollouts, f.optim.micro_batch, 0))
        keep = mini_batches(None, n, U)[0]
        if keep is not None:  # an update's part: its rows of the rollouts and log-probs
            rows = keep.repeat_interleave(3)
            part = rollouts.groups(keep)
            copies = [x[rows] for x in frozen]
        # the per-group and per-row values and masks (a few bytes a row) are not in the term
        measured = tracker.now - sum(t.nbytes for r in [rollouts] + (
            [part] if keep is not None else []) for t in (
            r.rewards, r.penalty, r.completion_lengths, r.truncated)) - (
            rows.nbytes + keep.nbytes if keep is not None else 0)
    assert measured == sum(b for _, b in held_rollout_parts(cfg, ranks))
    assert keep is None or all(c.shape == (n * 3 // U, T - 1) for c in copies)
