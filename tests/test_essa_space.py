"""ESSA search spaces on a tiny random Qwen2 with a rank-4 q/k/v/o LoRA adapter."""
import json
import os

import numpy as np
import peft
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hpc.models.adapter_space import LoraEntrySpace, SingularValueSpace, searched_count
from hpc.runtime.errors import UserError

LAYERS, RANK = 2, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
IDS = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 8]])


def base_model(dtype=torch.float32):
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, intermediate_size=64)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def lora_model(dtype=torch.float32, targets=TARGETS):
    """peft starts B at zero; random B makes the SVD of B (and the adapter) non-trivial."""
    model = peft.get_peft_model(base_model(dtype), peft.LoraConfig(r=RANK, lora_alpha=8,
                                                                   target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def lora_weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def random_vector(space, scale=0.1, seed=0, members=None):
    shape = (space.dim,) if members is None else (members, space.dim)
    return scale * np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("alpha, searched", [(1.0, 4), (0.5, 2), (0.3, 2)])
def test_dim_counts_searched_singular_values(alpha, searched):
    space = SingularValueSpace.from_peft(lora_model(), alpha=alpha)
    assert space.dim == LAYERS * len(TARGETS) * 2 * searched
    assert len(space.modules) == LAYERS * len(TARGETS)
    assert space.modules == sorted(space.modules)


def test_searched_count_ignores_float_noise():
    assert 0.14 * 50 > 7
    assert searched_count(0.14, 50) == 7
    assert searched_count(0.01, 4) == 1


@pytest.mark.parametrize("alpha", [0.0, 1.5])
def test_alpha_out_of_range(alpha):
    with pytest.raises(UserError, match="alpha"):
        SingularValueSpace.from_peft(lora_model(), alpha=alpha)


def test_singular_values_and_svd_reconstruction():
    model = lora_model()
    space = SingularValueSpace.from_peft(model)
    weights = [(m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach())
               for m in map(model.get_submodule, space.modules)]
    expected = torch.cat([torch.linalg.svdvals(w.double()) for pair in weights for w in pair])
    np.testing.assert_allclose(space.singular_values(), expected.numpy(), rtol=1e-12)
    s = space.singular_values()
    # x = s doubles every factor (W' = U diag(2 s) Vh = 2 W): float32 within 1e-6 relative
    for (a, b), (a2, b2) in zip(weights, space.factors(s).values()):
        torch.testing.assert_close(a2, 2 * a, rtol=1e-6, atol=1e-6 * a.abs().max().item())
        torch.testing.assert_close(b2, 2 * b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
    # x = -s zeroes every singular value: what is left is float64 round-off only
    for (a, b), (a0, b0) in zip(weights, space.factors(-s).values()):
        assert a0.abs().max() < 1e-6 * a.abs().max()
        assert b0.abs().max() < 1e-6 * b.abs().max()


@pytest.mark.parametrize("space_cls", [SingularValueSpace, LoraEntrySpace])
def test_zero_vector_is_the_sft_adapter_bitwise(space_cls):
    model = lora_model()
    original = lora_weights(model)
    space = space_cls.from_peft(model)
    for name, (a, b) in space.factors(np.zeros(space.dim)).items():
        module = model.get_submodule(name)
        assert torch.equal(a, module.lora_A["default"].weight)
        assert torch.equal(b, module.lora_B["default"].weight)
    space.apply(model, random_vector(space))
    assert not any(torch.equal(w, original[n]) for n, w in lora_weights(model).items())
    space.apply(model, np.zeros(space.dim))
    restored = lora_weights(model)
    assert all(torch.equal(restored[n], w) for n, w in original.items())
    assert np.array_equal(space.to_vector_of(model), np.zeros(space.dim))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("space_cls", [SingularValueSpace, LoraEntrySpace])
def test_factors_batch_matches_factors(space_cls, dtype, rtol):
    space = space_cls.from_peft(lora_model(dtype))
    xs = random_vector(space, members=5)
    batch = space.factors_batch(xs)
    for i, x in enumerate(xs):
        for name, (a, b) in space.factors(x).items():
            assert batch[name][0].shape == (5, *a.shape) and batch[name][0].dtype == dtype
            torch.testing.assert_close(batch[name][0][i], a, rtol=rtol, atol=0)
            torch.testing.assert_close(batch[name][1][i], b, rtol=rtol, atol=0)


@pytest.mark.parametrize("space_cls, kwargs", [(SingularValueSpace, {"alpha": 0.5}),
                                               (SingularValueSpace, {}), (LoraEntrySpace, {})])
def test_apply_to_vector_round_trip(space_cls, kwargs):
    model = lora_model()
    space = space_cls.from_peft(model, **kwargs)
    x = random_vector(space, scale=0.3)
    before = logits(model)
    space.apply(model, x)
    assert (logits(model) - before).abs().max() > 1e-4
    np.testing.assert_allclose(space.to_vector_of(model), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("space_cls", [SingularValueSpace, LoraEntrySpace])
def test_export_loads_in_plain_peft(space_cls, tmp_path):
    model = lora_model()
    space = space_cls.from_peft(model)
    original = lora_weights(model)
    out = tmp_path / "adapters" / "best"
    for seed in (0, 1):  # the second export replaces the first
        x = random_vector(space, scale=0.3, seed=seed)
        space.export_adapter(model, x, str(out))
        assert all(torch.equal(w, original[n]) for n, w in lora_weights(model).items())
        space.apply(model, x)
        expected = logits(model)
        space.apply(model, np.zeros(space.dim))
        loaded = peft.PeftModel.from_pretrained(base_model(), str(out)).eval()
        torch.testing.assert_close(logits(loaded), expected, rtol=1e-6, atol=1e-6)
    assert sorted(os.listdir(out.parent)) == ["best"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == RANK and sorted(config["target_modules"]) == sorted(TARGETS)
    assert (out / "adapter_model.safetensors").is_file()


def set_offsets(offsets, x) -> None:
    """Copy vector x (dim,) into the per-factor offset parameters, in vector order."""
    with torch.no_grad():
        for p, part in zip(offsets, torch.from_numpy(x).split([p.numel() for p in offsets])):
            p.copy_(part)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_parametrized_offsets_are_the_space(alpha, tmp_path):
    """fgrpo.space=sv: x = 0 is the SFT adapter bit for bit; for any x the model's factors are
    exactly space.factors(x); a gradient step moves only the offsets; the export is a plain
    peft adapter with the same logits."""
    model = lora_model()
    sft_logits = logits(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    space = SingularValueSpace.from_peft(model, alpha=alpha)
    offsets = space.parametrize(model)
    assert len(offsets) == 2 * len(space.modules)
    assert sum(p.numel() for p in offsets) == space.dim
    assert torch.equal(logits(model), sft_logits)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in offsets}
    x = random_vector(space, scale=0.3)
    set_offsets(offsets, x)
    for name, (a, b) in space.factors(x).items():
        module = model.get_submodule(name)
        assert torch.equal(module.lora_A["default"].weight, a)
        assert torch.equal(module.lora_B["default"].weight, b)
    model(input_ids=IDS).logits.square().mean().backward()
    torch.optim.SGD(offsets, lr=0.1).step()
    assert not np.allclose(space.to_vector_of(model), x)
    original = ".parametrizations.weight.original"
    after = {n.replace(original, ".weight"): p for n, p in model.named_parameters()
             if ".parametrizations.weight.0." not in n}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    expected = logits(model)
    space.save_parametrized(model, str(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(base_model(), str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logits(loaded), expected, rtol=1e-6, atol=1e-6)


def test_lora_entry_dim_counts_every_entry():
    space = LoraEntrySpace.from_peft(lora_model())
    hidden, kv = 32, 16  # q, o: 32 -> 32; k, v: 32 -> 2 kv heads x 8
    assert space.dim == LAYERS * RANK * (2 * (hidden + hidden) + 2 * (hidden + kv))


@pytest.mark.parametrize("space_cls", [SingularValueSpace, LoraEntrySpace])
def test_non_lora_model_is_refused(space_cls):
    with pytest.raises(UserError, match="is not a LoRA model"):
        space_cls.from_peft(base_model())


def test_missing_target_module_is_refused():
    model = lora_model(targets=["q_proj", "o_proj"])
    with pytest.raises(UserError, match="does not adapt k_proj, v_proj"):
        SingularValueSpace.from_peft(model, targets=TARGETS)
    assert SingularValueSpace.from_peft(model, targets=["q_proj"]).dim == LAYERS * 2 * 2 * RANK


def test_wrong_vector_shape_is_refused():
    space = SingularValueSpace.from_peft(lora_model())
    with pytest.raises(UserError, match="does not fit"):
        space.factors(np.zeros(space.dim + 1))
    with pytest.raises(UserError, match="does not fit"):
        space.factors_batch(np.zeros(space.dim))
    with pytest.raises(UserError, match="NaN"):
        space.factors(np.full(space.dim, np.nan))
