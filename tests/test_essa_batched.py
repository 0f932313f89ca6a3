"""Batched members on the hf backend (hpc.engine.hf_backend, MemberLora): k members per generation give one-at-a-time fitness and
completions bit for bit (fp32, CPU), in one process and under mpirun -n 2."""
import copy
import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, run_cli, run_mpi
from essa.population import ScoringRequest, mean_reward, score_members
from hpc.engine.backend import make_backend
from hpc.engine.hf_backend import members_on_device, members_that_fit
from hpc.engine.shape import ModelShape
from hpc.models.member_lora import MemberLora
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import attach_lora, randomize_lora_b
from hpc.toys.toy import tiny_model
from hpc.runtime.timing import PhaseTimer
from mpi.batched_check import (BATCH, MAX_NEW, N_MEMBERS, N_PROMPTS, HashTask, build_case,
                               completions, score)

BENCHMARKS = os.path.join(REPO, "benchmarks")


@pytest.fixture(scope="module", autouse=True)
def threads():
    """One torch thread (as in an MPI rank): generation on a loaded 2-core machine then runs
    in seconds, not minutes. The logits tests set 1 and 2 threads themselves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def case():
    return build_case()


@pytest.fixture(scope="module")
def reference(case):
    """One-at-a-time fitness (N_MEMBERS,) and completions through peft's own LoRA path."""
    return score(case, case[3], 1), completions(case, case[3], 1)


def test_reference_is_not_trivial(case, reference):
    fitness, texts = reference
    assert len(texts) == N_MEMBERS and all(len(t) == N_PROMPTS for t in texts)
    assert len({tuple(t) for t in texts}) == N_MEMBERS  # every member completes differently
    assert len(set(fitness.tolist())) == N_MEMBERS
    assert all(0.0 <= f < 1.0 for f in fitness)
    assert len({len(p) for p in case[4][:16]}) > 1  # a padded chunk


@pytest.mark.parametrize("k", [2, 3, 4])
def test_batched_equals_one_at_a_time(case, reference, k):
    # 5 members: the last group is short for every k
    assert completions(case, case[3], k) == reference[1]
    assert np.array_equal(score(case, case[3], k), reference[0])


def test_one_member_a_pass_equals_peft(case, reference):
    """k = 1 on the hf backend decodes its member through MemberLora, not through peft's own
    adapter (which stays untouched): the same fitness bit for bit."""
    model, tok, space, members, prompts, answers = case
    before = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    fitness = score_members(model, tok, space, HashTask(),
                            ScoringRequest(members, prompts, answers, MAX_NEW, BATCH, 1),
                            decoder=make_backend("hf"),
                            timer=PhaseTimer(["rebuild", "generate", "reward"]))
    assert np.array_equal(fitness, reference[0])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def test_mean_reward_scores_each_pair_once():
    calls = []

    class Counting(HashTask):
        def rewards(self, completions, answers):
            calls.append(len(completions))
            return HashTask.rewards(completions, answers)

    cache = {}
    texts, answers = ["1", "2", "1", "3"], ["1", "2", "1", "1"]
    want = float(np.mean(HashTask.rewards(texts, answers)))
    assert mean_reward(Counting(), texts, answers, cache) == want
    assert mean_reward(Counting(), texts[::-1], answers[::-1], cache) == \
        float(np.mean(HashTask.rewards(texts[::-1], answers[::-1])))
    assert calls == [3]  # ("1", "1") once; the second call found every pair in the cache


@pytest.mark.parametrize("fused", [False, True])
def test_adapter_untouched_and_peft_layers_restored(case, fused):
    model, tok, space, members, _, _ = case
    before = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    peft_layers = [model.get_submodule(name) for name in space.modules]
    with MemberLora(model, space.factors_batch(members[:2]), fused=fused):
        swapped = [model.get_submodule(name) for name in space.modules]
        assert not any(s is p for s, p in zip(swapped, peft_layers))
    assert all(model.get_submodule(name) is p for name, p in zip(space.modules, peft_layers))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_" in n)


def _one_at_a_time(model, space, members, ids) -> torch.Tensor:
    """Logits (len(members) * rows, t, vocab) through peft's path, one member at a time."""
    out = []
    for x in members:
        space.apply(model, x)
        out.append(model(input_ids=ids).logits)
    return torch.cat(out)


def _logits(case, k: int, rows: int, fused=False) -> tuple:
    """(one member at a time, batched) logits of the first k members on ``rows`` prompts,
    one decoding step (t = 1), both (k * rows, 1, vocab)."""
    model, tok, space, members, _, _ = case
    ids = torch.arange(rows)[:, None] % 40 + 3  # (rows, 1)
    with torch.no_grad():
        single = _one_at_a_time(model, space, members[:k], ids)
        with MemberLora(model, space.factors_batch(members[:k]), fused=fused):
            batched = model(input_ids=ids.repeat(k, 1)).logits
    return single, batched


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("rows", [12, 16, 29])
def test_logits_bitwise_from_12_rows_per_member(case, rows, n_threads):
    torch.set_num_threads(n_threads)
    single, batched = _logits(case, 3, rows)
    torch.set_num_threads(1)
    assert torch.equal(single, batched)
    assert single[:rows].sub(single[rows:2 * rows]).abs().max() > 1e-3  # members differ


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_small_chunks_within_stated_tolerance(case, rows, fused):
    single, batched = _logits(case, 3, rows, fused)  # MKL's small-matrix kernels
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)


def test_fused_fp32_within_rounding_of_one_at_a_time(case):
    """Fused (shared q/k/v product, zero-padded B', in-place add) in fp32: the same sums in
    another order, so logits agree to rounding; members clearly differ."""
    single, batched = _logits(case, 3, 16, fused=True)
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    assert single[:16].sub(single[16:32]).abs().max() > 1e-3


def test_fused_sibling_on_another_input_computes_its_own_product(case):
    """q/k/v share x @ A_cat only when called on the same tensor: k_proj called on another
    tensor right after q_proj gets its own delta, as in the exact path."""
    model, _, space, members, _, _ = case
    factors = space.factors_batch(members[:2])
    x1, x2 = torch.randn(2, 2 * 12, 1, 64, generator=torch.Generator().manual_seed(3))
    q_name = next(n for n in space.modules if n.endswith("q_proj"))
    names = [q_name, q_name.replace("q_proj", "k_proj")]
    outs = {}
    with torch.no_grad():
        for fused in (False, True):
            with MemberLora(model, factors, fused=fused):
                q, k = (model.get_submodule(n) for n in names)
                outs[fused] = [q(x1), k(x2), k(x1)]
    for want, got in zip(outs[False], outs[True]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_adds_12_host_ops_per_layer_exact_32(case):
    """Decoding at small batch is host-bound on a GPU, so host ops per step set the speed
    (benchmarks/host_ops.py): per q/k/v/o layer the fused path adds one bmm per input group,
    one in-place baddbmm per module and their views, 12 ops; peft's arithmetic adds 32. Exact
    aten op counts depend on torch's decompositions: these are torch 2.13's (constraints.txt).
    No product is held after the last reader of its group."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    from gpu_check import BaseOnly, host_ops_per_step

    model, _, space, members, _, _ = case
    ids = torch.randint(3, 40, (2 * 12, 4), generator=torch.Generator().manual_seed(0))
    factors = space.factors_batch(members[:2])
    with BaseOnly(model, space.modules):
        base = host_ops_per_step(model, ids)
    added = {}
    for fused in (True, False):
        with MemberLora(model, factors, fused=fused):
            added[fused] = host_ops_per_step(model, ids) - base
    layers = model.config.num_hidden_layers
    assert base > 50 * layers and added == {True: 12 * layers, False: 32 * layers}
    with MemberLora(model, factors, fused=True), torch.no_grad():
        model(input_ids=ids)
        held = [m.low_rank for n, m in model.named_modules() if hasattr(m, "low_rank")]
        assert len({id(g) for g in held}) == 2 * layers  # q/k/v shared, o alone
        assert all(g.x is None and g.xa is None for g in held)


def test_fused_bf16_as_accurate_as_peft_bf16():
    """The fused path in bf16 (bf16 factors) is as close to the fp32 model as peft's own bf16
    path (fp32 LoRA weights on a bf16 model)."""
    model, _ = tiny_model(hidden=64, layers=2)
    model.to(torch.bfloat16)
    peft16 = attach_lora(model, 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    gen = torch.Generator().manual_seed(1)
    assert all(p.dtype == torch.float32 for n, p in peft16.named_parameters() if "lora_B" in n)
    randomize_lora_b(peft16, 0.5, gen)
    peft32 = copy.deepcopy(peft16).float()  # the same weights, exactly, in fp32
    space = SingularValueSpace.from_peft(peft16)
    members = np.random.default_rng(0).normal(0.0, 0.5, (3, space.dim))
    ids = torch.randint(3, 40, (16, 5), generator=gen)
    with torch.no_grad():
        want = _one_at_a_time(peft32, space, members, ids).float()
        peft_err = (_one_at_a_time(peft16, space, members, ids).float() - want).abs().max()
        with MemberLora(peft16, space.factors_batch(members), fused=True):
            fused = peft16(input_ids=ids.repeat(3, 1)).logits.float()
    assert 0 < (fused - want).abs().max() <= 2 * peft_err


def test_rows_must_be_a_multiple_of_k(case):
    model, _, space, members, _, _ = case
    with MemberLora(model, space.factors_batch(members[:3])), torch.no_grad():
        with pytest.raises(ValueError, match="not a multiple of 3 members"):
            model(input_ids=torch.ones((4, 2), dtype=torch.long))


def test_members_on_device_reads_free_memory_and_the_adapter_size(case, monkeypatch):
    model = case[0]  # 2 layers, hidden 64, kv 32; r = 4 on q/k/v/o, fp32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 ** 30, 2 ** 31))
    lora = 2 * (4 * (4 * 64) + 2 * (64 * 4) + 2 * (32 * 4)) * 4  # A's, q/o B's, k/v B's
    assert lora == 14336
    fit = members_on_device(model, 10_000, 16, 20)  # 10k members' factors: 143 MB of 512 MiB
    shape = ModelShape.from_config(model.config)
    assert fit == members_that_fit(shape, 4, lora, 2 ** 30, 10_000, 16, 20)
    assert fit < members_that_fit(shape, 4, 0, 2 ** 30, 10_000, 16, 20)


def test_members_that_fit_a_qwen2_5_1_5b_in_bf16():
    config = ModelShape.qwen25("1.5B")
    lora = 2_179_072 * 4  # rank-8 q/k/v/o factors in fp32, bytes
    # per token (2*28*2*128 + 4*1536 + 3*8960) * 2 B = 94720 B; per member of 32 rows of
    # 128 tokens: 32 * (128 * 94720 + 4 * 151936) B = 407420928 B
    fit = members_that_fit(config, 2, lora, 100 * 2 ** 30, 96, 32, 128)
    assert fit == (50 * 2 ** 30 - 96 * lora) // 407_420_928 == 129
    assert members_that_fit(config, 2, lora, 2 * 2 ** 30, 96, 32, 128) == 1


@pytest.mark.mpi
def test_batched_equals_one_at_a_time_under_mpirun(tmp_path):
    out = tmp_path / "batched.json"
    proc = run_mpi(2, ["tests/mpi/batched_check.py", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["members"] for r in reports] == [3, 2]  # k = 2: rank 0 has a short last group
    for r in reports:
        assert r["bitwise"] and r["same_completions"], r
        assert r["batched"] == r["one_at_a_time"]
        assert r["distinct_completions"] == r["members"]


@pytest.mark.subprocess
def test_gpu_check_runs_on_cpu_without_cma_or_math_verify(tmp_path):
    """benchmarks/gpu_check.py (the GPU machine has no cma, math-verify, MPI or h5py) on the
    tiny shape; 12 prompts per member, so the exact variant must agree token for token."""
    code = ("import runpy, sys; "
            "sys.modules.update(dict.fromkeys(['cma', 'math_verify', 'mpi4py', 'h5py'])); "
            "sys.path.insert(0, 'benchmarks'); "
            f"sys.argv = ['gpu_check.py', {str(tmp_path)!r}, '--model', 'tiny', '--device', "
            "'cpu', '--ks', '1', '2', '--prompts', '12']; "
            "runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')")
    proc = run_cli(["-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    assert result["members_that_fit"] is None  # CPU: no memory cap
    one, two = result["members"]
    assert (one["k"], one["rows"], two["k"], two["rows"]) == (1, 12, 2, 24)
    for row in (one, two):
        for variant in ("lora_fused", "lora_exact", "base"):
            assert row[variant]["members_per_s"] == pytest.approx(row["k"] / row[variant]["s"])
        assert row["lora_fused_vs_base"] == pytest.approx(row["base"]["s"] /
                                                          row["lora_fused"]["s"])
    assert "peft" in one and "peft" not in two
    for row in (one, two):  # 2 layers: the fused path adds 12 host ops per layer, exact 32
        ops = row["host_ops_per_step"]
        assert (ops["lora_fused"] - ops["base"], ops["lora_exact"] - ops["base"]) == (24, 64)
    exact = two["agreement_with_one_at_a_time"]["lora_exact"]
    assert exact == {"rows_identical": 1.0, "tokens_before_first_difference": 1.0}
    step = result["fgrpo_step"]
    assert list(step["phases_s"]) == ["generation", "reward", "forward_backward", "waiting",
                                      "allreduce", "optimizer"]  # the trainer's own phases
    assert step["rows"] == 256 and step["total_s"] == pytest.approx(sum(step["phases_s"].values()))


@pytest.mark.subprocess
def test_host_ops_benchmark_prints_the_counts():
    proc = run_cli(["benchmarks/host_ops.py", "--model", "qwen2.5-1.5b", "--ks", "2",
                    "--prompts", "4", "--tokens", "2", "--repeats", "1"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = proc.stdout.splitlines()[-1].split()
    assert row[:4] == ["qwen2.5-1.5b", "28", "2", "8"]
    base, fused, exact = map(int, row[4:7])
    assert (fused - base, exact - base) == (12 * 28, 32 * 28)
    assert row[7:11] == ["12.0", "32.0", f"{base / fused:.3f}", f"{base / exact:.3f}"]
