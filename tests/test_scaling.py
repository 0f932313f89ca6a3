"""hpc-scaling: communication formulas, trends, measured costs, and the paper preset."""
import json
from pathlib import Path

import numpy as np
import pytest

from hpc.runtime.runstore import RunStore
from compare.gpu_check import GpuCheck
from compare.measured import Measured
from compare.model import Workload, essa_step, fgrpo_step, predict
from compare.network import (GPUS, LINKS, Link, Network, allgather, ring_allgather,
                             ring_allreduce)
from compare.options import parse_options
from compare.paper import PAPER_MINUTES, implied_fixed_cost
from compare.roofline import QWEN25_32B, Roofline
from compare.scaling import main
from compare.setting import planned_decoding
from compare.sharding import LoraFsdp, Sharding

GPU_CHECK = str(Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                "gpu_check-h200-2026-11-30.json")

NDR = Network(LINKS["infiniband-ndr"], LINKS["nvlink-h100"], 8)
PAPER_W = Workload(population=128, minibatch=256, fgrpo_batch=512, fgrpo_generations=8,
                   fgrpo_minibatch=64, essa_steps=100, fgrpo_steps=100, essa_update_s=2.0)


def paper_costs(**kw):
    return Roofline(QWEN25_32B, GPUS["h100"], 256, 512, 1024, False, **kw)


def test_ring_allreduce_and_allgather_formulas():
    link = Link(bandwidth=1e10, latency=1e-5)
    # 2 (N-1)/N * bytes / bw + 2 (N-1) * latency = 2*3/4*0.1 s + 6e-5 s
    assert ring_allreduce(1e9, 4, link) == pytest.approx(0.15006)
    assert ring_allreduce(1e9, 1, link) == 0.0
    assert allgather(1024, 4, link) == pytest.approx(3e-5 + 1024 / 1e10)
    assert allgather(1024, 1, link) == 0.0


def test_hierarchical_allreduce_beyond_one_node():
    nv, ib = LINKS["nvlink-h100"], LINKS["infiniband-ndr"]
    assert NDR.allreduce(1e9, 8) == pytest.approx(ring_allreduce(1e9, 8, nv))
    # 32 GPUs = 4 nodes: ring inside each node, then 8 concurrent rings of 4 on bytes/8
    expected = (2 * 7 / 8 * 1e9 / 450e9 + 14e-6) + (2 * 3 / 4 * 1.25e8 / 50e9 + 6 * 2e-6)
    assert NDR.allreduce(1e9, 32) == pytest.approx(expected)
    flat = Network(ib, None)
    assert NDR.allreduce(1e9, 32) < flat.allreduce(1e9, 32)
    assert NDR.allgather(1024, 4) == pytest.approx(3e-6 + 1024 / 450e9)  # inside a node
    assert NDR.allgather(1024, 16) == pytest.approx(15 * 2e-6 + 1024 / 50e9)


def test_qwen32b_description():
    assert QWEN25_32B.lora_params == 64 * 16 * 131072  # (4h + 2(h+kv) + 3(h+I)) per rank
    # the paper's count: 64 layers x 4 attention matrices (q, k, v, o) x 2 factors (A, B) x
    # rank 16
    assert QWEN25_32B.search_dim == 64 * 4 * 2 * 16 == 8192
    cost = paper_costs()
    assert cost.step_fixed == pytest.approx(65e9 / 3.35e12)
    assert 1 <= cost.max_batch < 64
    tps = [cost.tokens_per_s(b) for b in (1, 8, 64, 512)]
    assert all(a < b for a, b in zip(tps, tps[1:]))
    assert tps[-1] < 1 / cost.per_seq  # the per-sequence term bounds throughput
    calibrated = paper_costs(gen_tps=1200.0, gen_batch=32)
    assert calibrated.tokens_per_s(32) == pytest.approx(1200.0)
    assert calibrated.max_batch == 32  # measured concurrency overrides the KV estimate
    assert calibrated.generate(3200) == pytest.approx(3200 * 512 / 1200.0)


def test_generation_floor_and_granularity():
    cost = paper_costs()
    step = cost.step_fixed + cost.per_seq
    assert cost.generate(1) == pytest.approx(1024 * step)  # one sequence: max_new steps
    assert cost.generate(4096) == pytest.approx(
        4096 * 512 / cost.tokens_per_s(cost.max_batch))
    e16, e32 = essa_step(16, PAPER_W, cost, NDR), essa_step(32, PAPER_W, cost, NDR)
    assert e16["generate"] == pytest.approx(8 * cost.generate(256))
    assert e32["generate"] == pytest.approx(e16["generate"] / 2)
    big = essa_step(256, PAPER_W, cost, NDR)  # N > P: one member per GPU, no further gain
    assert big["generate"] == essa_step(128, PAPER_W, cost, NDR)["generate"]
    g = fgrpo_step(128, PAPER_W, cost, NDR)
    assert g["generate"] == pytest.approx(cost.generate(4 * 8))
    assert g["allreduce"] == pytest.approx(8 * NDR.allreduce(4 * QWEN25_32B.lora_params, 128))


def test_trends_with_gpu_count():
    rows = predict([16, 32, 64, 128], PAPER_W, paper_costs(), NDR)
    essa = [r["essa_step"] for r in rows]
    fgrpo = [r["fgrpo_step"] for r in rows]
    assert all(a > b for a, b in zip(essa, essa[1:]))
    assert all(a > b for a, b in zip(fgrpo, fgrpo[1:]))
    comm = [r["essa"]["communication"] for r in rows]
    allred = [r["fgrpo"]["allreduce"] for r in rows]
    assert all(a < b for a, b in zip(comm, comm[1:]))
    assert all(a < b for a, b in zip(allred, allred[1:]))
    assert comm[-1] < 1e-3 < allred[0]  # ESSA's traffic is tiny next to GRPO's
    assert rows[-1]["ratio"] > rows[0]["ratio"]  # ESSA gains on GRPO as N grows
    for r in rows:
        assert r["essa_ttt"] == pytest.approx(100 * r["essa_step"])
        assert r["ratio"] == pytest.approx(r["fgrpo_ttt"] / r["essa_ttt"])
    slow = predict([128], PAPER_W, paper_costs(), Network(LINKS["ethernet-100g"], None))
    assert slow[0]["fgrpo"]["allreduce"] > rows[-1]["fgrpo"]["allreduce"]


def test_paper_preset_prints_table_assumptions_and_figures(capsys):
    main(["--paper"])
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in table[2:]] == ["16", "32", "64", "128"]
    assert "assumptions:" in out and out.count("\n- ") >= 8
    assert "ring all-reduce 2 (N-1)/N bytes/bw + 2 (N-1) latency" in out
    assert "hierarchical" in out and "not taken from the paper" in out
    assert "2x faster than GRPO on 16 GPUs and 6-7.8x" in out
    # the paper's GRPO is the default: LoRA on an FSDP-sharded base, weight sync each step
    cost = paper_costs(decoding=planned_decoding(parse_options([]), 256))
    lora = LoraFsdp(QWEN25_32B.params, QWEN25_32B.lora_params)
    rows = predict([16, 128], PAPER_W, cost, NDR, lora)
    assert f"prediction: {rows[0]['ratio']:.2f}x at 16 GPUs, {rows[1]['ratio']:.2f}x at 128" in out
    assert "GRPO modelled: GRPO as the paper ran it (verl)" in out
    assert "where they differ" in out and "sensitivity: verl counts the batch in prompts" in out
    assert "ESSA searches 8192 singular values" in out
    assert "cannot come from per-step costs" in out
    side = out.split("ESSA's inference in bf16 (the paper's setting) and INT8")[1].splitlines()
    assert side[1].split()[1:] == ["bf16", "ESSA", "gen", "s", "bf16", "ESSA", "step", "s",
                                   "bf16", "GRPO/ESSA", "INT8", "ESSA", "gen", "s", "INT8",
                                   "ESSA", "step", "s", "INT8", "GRPO/ESSA"]
    assert [line.split()[0] for line in side[2:6]] == ["16", "32", "64", "128"]
    # ESSA's engine budget at bf16: 8 GiB of what the weights, the adapter and the search
    # space's float64 copies (0.5 GiB at LoRA rank 16) leave
    assert "- bf16: ESSA: 65.5 GB of weights a decode step (bf16), at most 18 concurrent" in out
    assert "- INT8: ESSA: 34.3 GB of weights a decode step (int8 decoder linears), at most 63 " \
        "concurrent sequences (hpc-plan's engine in its 22 GiB budget)" in out


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_model_concurrency_is_the_plans(quantize):
    """hpc-scaling's ESSA and F-GRPO concurrency and weight bytes are the memory plan's for
    the same config: the scoring and rollout engines' slots as hpc-plan prints them (their
    rows asked exceed what the budget holds), and the weights it counts."""
    from compare.plan_terms import model_shape, plan_config
    from essa.plan import plan as essa_plan
    from fgrpo.plan import plan as fgrpo_plan
    from hpc.plan.terms import weight_bytes

    args = parse_options(["--essa-quantize", quantize])
    cost = paper_costs(decoding=planned_decoding(args, 256))
    shape = model_shape(64, 5120, 27648, 1024)
    cfg = plan_config(None, lora_rank=16, prompt=256, max_new=1024, gpu_gb=80, minibatch=256,
                      essa_quantize=quantize, full=False, sharded=False, micro_batch=8)
    scoring = essa_plan(shape, cfg, 16).phase("ESSA scoring").parts[-2][0]
    slots = int(scoring.split(": ")[2].split(" slots")[0])
    assert "in waves" in scoring and cost.terms("essa")[1] == slots
    assert cost.terms("essa")[0] == weight_bytes(shape, cfg, quantized=True) / 3.35e12
    cfg.model.quantize = "none"
    cfg.fgrpo.batch_prompts = 4096  # a rollout asking more rows than the engine holds
    rollout = fgrpo_plan(shape, cfg, 16).phase("rollout").parts[-2][0]
    assert cost.terms("fgrpo")[1] == int(rollout.split(": ")[2].split(" slots")[0])
    assert cost.terms("fgrpo")[0] == weight_bytes(shape, cfg) / 3.35e12
    if quantize != "none":  # fewer weight bytes leave the engine more room
        assert cost.terms("essa")[1] > paper_costs(decoding=planned_decoding(
            parse_options([]), 256)).terms("essa")[1]


def test_kv_reference_keeps_one_bf16_concurrency():
    args = parse_options(["--concurrency", "kv"])
    assert planned_decoding(args, 256) == {}
    cost = paper_costs()
    assert cost.terms("essa") == cost.terms("fgrpo") == (cost.step_fixed, cost.max_batch)


def test_ring_allgather_and_sharded_step_by_hand():
    link = Link(bandwidth=1e10, latency=1e-5)
    # (N-1)/N * bytes / bw + (N-1) * latency = 3/4 * 0.1 s + 3e-5 s
    assert ring_allgather(1e9, 4, link) == pytest.approx(0.07503)
    assert ring_allgather(1e9, 1, link) == 0.0
    nv, ib = LINKS["nvlink-h100"], LINKS["infiniband-ndr"]
    assert NDR.shard_collective(1e9, 8) == pytest.approx(7 / 8 * 1e9 / 450e9 + 7e-6)
    assert NDR.shard_collective(1e9, 16) == pytest.approx(15 / 16 * 1e9 / 50e9 + 15 * 2e-6)
    # Qwen2.5-32B, 16 GPUs: an update of 64 prompts is 4 prompts x G = 8 = 32 sequences a GPU,
    # 4 micro-batches of 8; 8 updates a step -> 32 micro-batches, each gathering 65 GB of bf16
    # weights twice and reduce-scattering 130 GB of fp32 gradients
    shard = Sharding(32.5e9, micro_batch=8)
    terms = shard.step(16, PAPER_W, NDR)
    gather = 15 / 16 * 65e9 / 50e9 + 15 * 2e-6
    assert terms["gather_forward"] == terms["gather_backward"] == pytest.approx(32 * gather)
    assert terms["reduce_scatter"] == pytest.approx(32 * (15 / 16 * 130e9 / 50e9 + 30e-6))
    assert terms["rollout_gather"] == pytest.approx(gather)
    # 128 GPUs: half a prompt a GPU rounds up to one (8 sequences, one micro-batch an update)
    assert shard.step(128, PAPER_W, NDR)["gather_forward"] == pytest.approx(
        8 * (127 / 128 * 65e9 / 50e9 + 127 * 2e-6))
    assert Sharding(32.5e9, grad_bytes=2.0).step(16, PAPER_W, NDR)["reduce_scatter"] == \
        pytest.approx(terms["reduce_scatter"] / 2, rel=1e-4)


def test_sharded_32b_rows_exist_and_sum(capsys):
    cost = Roofline(QWEN25_32B, GPUS["h100"], 256, 512, 1024, True, decoding=planned_decoding(
        parse_options(["--sharded"]), 256))
    shard = Sharding(QWEN25_32B.params)
    rows = predict([16, 32, 64, 128], PAPER_W, cost, NDR, shard)
    for r in rows:
        g = r["fgrpo"]
        assert set(g) == {"generate", "forward_backward", "gather_forward", "gather_backward",
                          "reduce_scatter", "rollout_gather", "host_offload", "optimizer"}
        assert g["host_offload"] == 0  # none given
        assert r["fgrpo_step"] == pytest.approx(sum(g.values()))
        assert r["essa_step"] == pytest.approx(sum(r["essa"].values()))
        assert g["optimizer"] == pytest.approx(8 * cost.optimizer_s / r["gpus"])
    plain = predict([16], PAPER_W, cost, NDR)[0]
    assert rows[0]["fgrpo"]["generate"] == plain["fgrpo"]["generate"]
    main(["--paper", "--sharded"])
    out = capsys.readouterr().out
    assert "sharded full-parameter GRPO (FSDP2" in out
    assert f"prediction: {rows[0]['ratio']:.2f}x at 16 GPUs, {rows[-1]['ratio']:.2f}x at 128" in out
    breakdown = out.split("per-term breakdown:\n")[1]
    for term in ("weight all-gather (forward)", "gradient reduce-scatter",
                 "rollout weight gather", "forward+backward"):
        assert term in breakdown
    assert "at 128 GPUs the GRPO step is" in breakdown


def test_sharded_32b_moves_state_to_host_where_the_memory_plan_says(capsys):
    """At 16 H100s the gathered bf16 model leaves no room for the fp32 shards and moments
    during the rollout: the plan moves them (state, 12 bytes a parameter / 16), at 32 the
    moments (8 / 32), from 64 on nothing; each costs there and back at 20 GB/s."""
    main(["--paper", "--sharded"])
    out = capsys.readouterr().out
    assert ("16 GPUs: state (22.9 GiB); 32 GPUs: optimizer (7.6 GiB); 64 GPUs: none (0.0 GiB);"
            " 128 GPUs: none (0.0 GiB)") in out
    row = out.split("per-term breakdown:\n")[1].splitlines()
    line = next(r for r in row if r.startswith("state to host and back (fgrpo.parallel.offload)"))
    n = 32_763_876_352  # Qwen2.5-32B's parameters, as the plan counts them
    assert line.split()[-4:] == [f"{2 * (12 * n // 16) / 20e9:.3f}",
                                 f"{2 * (8 * n // 32) / 20e9:.3f}", "0", "0"]
    main(["--paper", "--sharded", "--gpu", "h200"])
    assert "16 GPUs: none (0.0 GiB)" in capsys.readouterr().out


def test_lora_fsdp_terms_by_hand():
    """The paper's GRPO (verl): the frozen bf16 base all-gathered per micro-batch for the
    forward and the backward, LoRA-sized fp32 gradients all-reduced per update, the rollout
    engine fed the whole bf16 model (or the adapter) once a step."""
    lora_params = QWEN25_32B.lora_params
    lora = LoraFsdp(32.5e9, lora_params, micro_batch=8)
    assert lora.gather_bytes == 65e9  # bf16 base, per micro-batch pass
    assert lora.lora_grad_bytes == 4 * lora_params  # fp32 LoRA gradients, per update
    assert lora.sync_bytes == 65e9  # model: the whole bf16 model into the engine
    adapter = LoraFsdp(32.5e9, lora_params, sync="adapter")
    assert adapter.sync_bytes == 2 * lora_params
    terms = lora.step(16, PAPER_W, NDR)
    assert set(terms) == {"gather_forward", "gather_backward", "allreduce", "weight_sync"}
    gather = 15 / 16 * 65e9 / 50e9 + 15 * 2e-6  # ring over InfiniBand beyond one node
    # 16 GPUs: 8 updates of 64 prompts = 4 prompts x 8 = 32 sequences a GPU, 4 micro-batches
    assert terms["gather_forward"] == terms["gather_backward"] == pytest.approx(32 * gather)
    assert terms["allreduce"] == pytest.approx(8 * NDR.allreduce(4 * lora_params, 16))
    assert terms["weight_sync"] == pytest.approx(gather + 2 * 65e9 / 3.35e12)
    assert adapter.step(16, PAPER_W, NDR)["weight_sync"] == pytest.approx(
        NDR.shard_collective(2 * lora_params, 16) + 4 * lora_params / 3.35e12)
    # no gradient reduce-scatter of the frozen base: far less traffic than full-parameter
    full = Sharding(32.5e9).step(16, PAPER_W, NDR)
    assert sum(terms.values()) < sum(full.values()) - full["reduce_scatter"] / 2
    cost = paper_costs()
    g = fgrpo_step(16, PAPER_W, cost, NDR, lora)
    assert g["optimizer"] == pytest.approx(8 * cost.optimizer_s / 16)
    fixed = fgrpo_step(16, Workload(**{**PAPER_W.__dict__, "fgrpo_fixed_s": 30.0}), cost,
                       NDR, lora)
    assert fixed["fixed"] == 30.0 and sum(fixed.values()) == pytest.approx(
        sum(g.values()) + 30.0)
    assert "fixed" not in g


def test_implied_fixed_cost_from_two_points():
    # (v1 + F) / (v2 + F) = t1 / t2: v 100 s at 16 GPUs, 12.5 s at 128 (8x), times 400 and
    # 150 minutes -> F = (150 * 100 - 400 * 12.5) / 250 = 40 s
    f = implied_fixed_cost({16: 100.0, 128: 12.5}, (16, 400.0), (128, 150.0))
    assert f == pytest.approx(40.0)
    assert (100 + f) / (12.5 + f) == pytest.approx(400 / 150)
    # a step that already shrinks less than the times: no positive fixed cost fits
    assert implied_fixed_cost({16: 100.0, 128: 50.0}, (16, 400.0), (128, 150.0)) < 0
    assert PAPER_MINUTES["fgrpo"] == ((16, 400.0), (128, 150.0))
    assert PAPER_MINUTES["essa"] == ((16, 200.0), (128, 20.0))


def test_paper_prints_the_implied_fixed_cost_and_its_prediction(capsys):
    main(["--paper"])
    out = capsys.readouterr().out
    cost = paper_costs(decoding=planned_decoding(parse_options([]), 256))
    lora = LoraFsdp(QWEN25_32B.params, QWEN25_32B.lora_params)
    a, b = predict([16, 128], PAPER_W, cost, NDR, lora)
    f = implied_fixed_cost({16: a["fgrpo_step"], 128: b["fgrpo_step"]}, (16, 400.0),
                           (128, 150.0))
    assert f > 0
    line = next(x for x in out.splitlines() if x.startswith("fixed cost implied"))
    assert f"{f:.1f} s a step (--grpo-fixed-s {f:.1f})" in line
    c, d = predict([16, 128], Workload(**{**PAPER_W.__dict__, "fgrpo_fixed_s": f}),
                   cost, NDR, lora)
    assert f"prediction with it: GRPO/ESSA {c['ratio']:.2f}x at 16 GPUs, {d['ratio']:.2f}x " \
        "at 128" in out
    # given back as the option, the fixed cost is a term of every GRPO step
    c, d = predict([16, 128], Workload(**{**PAPER_W.__dict__, "fgrpo_fixed_s": round(f, 1)}),
                   cost, NDR, lora)
    main(["--paper", "--grpo-fixed-s", f"{f:.1f}"])
    out = capsys.readouterr().out
    assert f"prediction: {c['ratio']:.2f}x at 16 GPUs, {d['ratio']:.2f}x at 128" in out
    assert "fixed per-step cost (--grpo-fixed-s)" in out.split("per-term breakdown:")[1]


@pytest.mark.parametrize("argv,mode", [
    (["--paper"], "LoRA on an FSDP-sharded frozen base"),
    (["--paper", "--grpo", "full"], "sharded full-parameter GRPO (FSDP2"),
    (["--paper", "--sharded"], "sharded full-parameter GRPO (FSDP2"),
    (["--paper", "--grpo", "replica"], "generates in-process, no weight sync"),
    ([], "generates in-process, no weight sync"),
])
def test_fgrpo_layouts(argv, mode, capsys):
    main(argv)
    assert mode in capsys.readouterr().out


def test_fgrpo_layout_contradictions_exit_2(seeds, capsys):
    assert "contradicts --grpo lora-fsdp" in one_error_line(
        ["--sharded", "--grpo", "lora-fsdp"], capsys)
    assert "contradicts --grpo full" in one_error_line(
        ["--full-finetune", "--grpo", "full"], capsys)
    assert "--fgrpo-fixed-s: -1 is below the minimum 0" in one_error_line(
        ["--grpo-fixed-s", "-1"], capsys)
    essa, fgrpo = seeds
    assert "measured ones" in one_error_line(
        ["--runs", *essa, *fgrpo, "--grpo", "lora-fsdp"], capsys)


def write_run(path, method, ranks, config, phases, heldout_key, accuracy=(0.2, 0.4, 0.6),
              attrs=None):
    """A run file of len(accuracy) steps, each with these phase seconds on every rank and a
    held-out evaluation of accuracy[step - 1] in column ``heldout_key``."""
    store = RunStore(str(path), active=True, attrs={
        "method": method, "world_size": ranks, "config": config,
        "trainable_parameters": 1000, **(attrs or {})})
    for step, acc in enumerate(accuracy, start=1):
        store.log_step(step, metrics={"wall_s": float(step)},
                       timings={p: np.full(ranks, s) for p, s in phases.items()},
                       nbytes={"grad_allreduce": 4000} if method == "fgrpo" else {"fitness": 32})
        store.write_row("heldout", step, wall_s=float(step), **{heldout_key: acc})
    store.close()
    return str(path)


def test_measured_costs_from_run_files(tmp_path, capsys):
    essa = write_run(tmp_path / "essa.h5", "essa", 2,
                     "essa:\n  population: 8\n  minibatch: 10\n",
                     {"rebuild": 0.5, "generate": 3.0, "reward": 0.5, "update": 0.25,
                      "eval": 9.0}, "mean_accuracy")
    fgrpo = write_run(tmp_path / "fgrpo.h5", "fgrpo", 2,
                     "fgrpo:\n  batch_prompts: 4\n  num_generations: 4\n  num_iterations: 2\n",
                     {"generation": 1.0, "reward": 0.0, "forward_backward": 2.0,
                      "optimizer": 0.1}, "accuracy")
    cost = Measured([essa, fgrpo])
    assert cost.s_essa == pytest.approx(2 * 4.0 / 80)  # rank-seconds per scored completion
    assert cost.s_gen == pytest.approx(2 * 1.0 / 16)
    assert cost.s_train == pytest.approx(2 * 2.0 / 16)
    assert cost.essa_update_s == pytest.approx(0.25)
    assert cost.optimizer_s == pytest.approx(0.05) and cost.grad_bytes == 2000
    assert cost.steps_to_target(0.5)[:3] == (3, 3, 0.5)
    w = Workload(**cost.workload_defaults(), essa_steps=3, fgrpo_steps=3)
    assert essa_step(4, w, cost, NDR)["generate"] == pytest.approx(2 * 10 * cost.s_essa)
    assert fgrpo_step(4, w, cost, NDR)["forward_backward"] == pytest.approx(4 * cost.s_train)
    main(["--runs", essa, fgrpo, "--target", "0.5", "--gpus", "1", "2", "4"])
    out = capsys.readouterr().out
    assert "costs measured in" in out and "held-out accuracy 0.5 (as given by --target" in out
    with pytest.raises(SystemExit) as err:
        main(["--runs", essa, fgrpo, "--target", "0.9"])
    assert err.value.code == 2
    main(["--runs", fgrpo, essa])  # sorted by the files' method attribute, not their order
    assert "costs measured in 1 ESSA run(s) (" + essa in capsys.readouterr().out


def test_options_out_of_their_declared_range_end_in_one_line(capsys):
    """Every number is checked against its declaration (compare.options.ScalingOptions): one
    line naming the flag, exit 2; dynamic sampling's share takes fgrpo.sampling's range."""
    assert one_error_line(["--population", "0"], capsys) == \
        "error: --population: 0 is below the minimum 1"
    assert one_error_line(["--gpus", "16", "0"], capsys) == \
        "error: --gpus: 0 is below the minimum 1"
    assert one_error_line(["--decode-mfu", "0"], capsys) == \
        "error: --decode-mfu: 0 must be greater than 0"
    assert one_error_line(["--filtered-share", "0.995"], capsys) == \
        "error: --filtered-share: 0.995 is above the maximum 0.99"
    assert "invalid choice: 'x100'" in one_error_line(["--gpu", "x100"], capsys)


def test_fgrpo_flags_keep_their_grpo_spelling(capsys):
    main(["--fgrpo", "replica", "--fgrpo-batch", "256", "--fgrpo-fixed-s", "5", "--gpus", "16"])
    new = capsys.readouterr().out
    main(["--grpo", "replica", "--grpo-batch", "256", "--grpo-fixed-s", "5", "--gpus", "16"])
    assert capsys.readouterr().out == new and "GRPO: 256 prompts" in new


def test_user_errors_exit_2():
    for argv in (["--target", "0.5"], ["--gpus", "0"], ["--params", "1e12"],
                 ["--gen-tps", "1e7", "--gen-batch", "8"], ["--population", "0"],
                 ["--gen-tps", "0"], ["--essa-update-s", "-1"]):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2, argv


ESSA_CONFIG = "essa:\n  population: 8\n  minibatch: 10\n"
GRPO_CONFIG = "fgrpo:\n  batch_prompts: 4\n  num_generations: 4\n  num_iterations: 2\n"
ESSA_PHASES = {"rebuild": 0.5, "reward": 0.5, "update": 0.25}
GRPO_PHASES = {"generation": 1.0, "reward": 0.0, "forward_backward": 2.0, "optimizer": 0.1}


@pytest.fixture
def seeds(tmp_path):
    """Three ESSA seeds and two F-GRPO seeds (one naming its held-out column ``score``).
    Best accuracies 0.7, 0.6, 0.8 and 0.9, 0.65: every run reaches 0.6."""
    essa = [write_run(tmp_path / f"essa{i}.h5", "essa", 2, ESSA_CONFIG,
                      dict(ESSA_PHASES, generate=gen), "mean_accuracy", acc,
                      {"heldout_accuracy": "mean_accuracy"})
            for i, (gen, acc) in enumerate([(3.0, (0.1, 0.3, 0.5, 0.7)),
                                            (5.0, (0.2, 0.5, 0.6, 0.6)),
                                            (4.0, (0.5, 0.5, 0.55, 0.8))])]
    fgrpo = [write_run(tmp_path / "fgrpo0.h5", "fgrpo", 2, GRPO_CONFIG, GRPO_PHASES,
                      "accuracy", (0.3, 0.6, 0.9), {"heldout_accuracy": "accuracy"}),
            write_run(tmp_path / "fgrpo1.h5", "fgrpo", 2, GRPO_CONFIG,
                      dict(GRPO_PHASES, generation=3.0), "score", (0.1, 0.2, 0.65),
                      {"heldout_accuracy": "score"})]
    return essa, fgrpo


def test_several_seeds_and_automatic_target(seeds, capsys):
    essa, fgrpo = seeds
    cost = Measured([fgrpo[0], essa[0], essa[1], fgrpo[1], essa[2]])  # any order
    assert cost.s_essa == pytest.approx(2 * (1.0 + 4.0) / 80)  # generate 3, 5, 4 -> mean 4
    assert cost.s_gen == pytest.approx(2 * 2.0 / 16)  # generation 1 and 3 -> mean 2
    assert cost.s_train == pytest.approx(2 * 2.0 / 16)
    essa_steps, fgrpo_steps, target, lines = cost.steps_to_target()
    assert target == pytest.approx(0.6)  # the lowest of the runs' best accuracies
    assert (essa_steps, fgrpo_steps) == (4, 2.5)  # medians of (4, 3, 4) and (2, 3)
    assert f"{essa[1]} 3" in lines[1] and f"{fgrpo[1]} 3" in lines[2]
    assert cost.steps_to_target(0.3)[:2] == (2, 2)  # medians of (2, 2, 1) and (1, 3)
    main(["--runs", *essa, *fgrpo, "--gpus", "1", "2", "--paper"])
    out = capsys.readouterr().out
    assert "chosen automatically" in out and "3 ESSA run(s)" in out
    assert "ESSA 4 generations, GRPO 2.5 steps" in out
    assert "(the paper comparison needs 16 and 128 in --gpus)" in out
    main(["--runs", *essa, *fgrpo, "--paper"])
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.split("\n\n")[0].splitlines()[2:]] == \
        ["16", "32", "64", "128"]
    assert "2x faster than GRPO on 16 GPUs and 6-7.8x" in out and "prediction: " in out


def one_error_line(argv, capsys) -> str:
    """The single stderr line of ``main(argv)``, which must exit with code 2."""
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_target_never_reached_names_the_run(seeds, capsys):
    essa, fgrpo = seeds
    line = one_error_line(["--runs", *essa, *fgrpo, "--target", "0.62"], capsys)
    assert line.startswith("error: never reached held-out accuracy 0.62: ")
    assert f"{essa[1]} (its best: 0.6)" in line and all(p not in line for p in
                                                        (essa[0], essa[2], *fgrpo))
    line = one_error_line(["--runs", *essa, *fgrpo, "--target", "0.7"], capsys)
    assert f"{essa[1]} (its best: 0.6), {fgrpo[1]} (its best: 0.65)" in line


def test_costs_from_the_gpu_check_json(seeds, capsys):
    with open(GPU_CHECK) as fh:
        report = json.load(fh)
    first, second = report["results"][:2]
    cost = GpuCheck(GPU_CHECK)
    assert cost.name == first["model"]
    step = first["fgrpo_step"]["phases_s"]
    assert cost.s_gen == pytest.approx((step["generation"] + step["reward"]) / 256)
    assert cost.s_train == pytest.approx(step["forward_backward"] / 256)
    assert cost.optimizer_s == step["optimizer"]
    best = max(m[v]["tokens_per_s"] for m in first["members"]
               for v in ("lora_fused", "lora_exact", "peft") if v in m)
    assert best < max(m["base"]["tokens_per_s"] for m in first["members"])  # base: no LoRA
    assert cost.s_essa == pytest.approx(first["new_tokens"] / best)
    # r = 8 on q, k, v, o of 28 layers: 8 x (2 x (1536 + 1536) + 2 x (1536 + 256)) each
    assert cost.grad_bytes == 4 * 28 * 8 * (2 * 3072 + 2 * 1792)
    by_rows = {m["rows"]: m for m in first["members"]}
    fastest = {r: min(m[v]["s"] for v in ("lora_fused", "lora_exact", "peft") if v in m)
               for r, m in by_rows.items()}
    assert cost.call_seconds(32) == cost.call_seconds(8) == pytest.approx(fastest[32])
    assert cost.call_seconds(96) == pytest.approx((fastest[64] + fastest[128]) / 2)
    assert cost.call_seconds(1024) == pytest.approx(2 * fastest[512])  # two passes of 512
    assert cost.call_seconds(256, adapter=False) == by_rows[256]["base"]["s"]
    assert GpuCheck(GPU_CHECK, second["model"]).s_train == pytest.approx(
        second["fgrpo_step"]["phases_s"]["forward_backward"] / 256)
    essa, fgrpo = seeds
    main(["--runs", *essa, *fgrpo, "--gpu-check", GPU_CHECK, "--gpu-check-model",
          second["model"], "--paper"])
    out = capsys.readouterr().out
    assert f"per-step costs from the GPU check {GPU_CHECK}" in out and second["model"] in out
    assert "measured workload: prompts of 64 random tokens, exactly 64 new tokens" in out
    assert "chosen automatically" in out and "ESSA 4 generations, GRPO 2.5 steps" in out
    assert "from the runs' configs" in out and "costs measured in" not in out
    assert "rows a GPU holds: 16 GPUs: ESSA 10, F-GRPO 4; 128 GPUs: ESSA 10, F-GRPO 4" in out
    assert "not in the table, the decode batch effect" in out
    rows = out.split("\n\n")[0].splitlines()[2:]
    w = Workload(population=8, minibatch=10, fgrpo_batch=4, fgrpo_generations=4,
                 fgrpo_minibatch=2, essa_steps=4, fgrpo_steps=2.5, essa_update_s=0.25)
    expected = predict([16], w, GpuCheck(GPU_CHECK, second["model"]), NDR)[0]
    assert rows[0].split()[3] == f"{expected['essa_step']:.3f}"
    main(["--gpu-check", GPU_CHECK, "--essa-steps", "50", "--grpo-steps", "200"])
    out = capsys.readouterr().out
    assert "ESSA 50 generations, GRPO 200 steps" in out and "population 128" in out


def test_bad_inputs_exit_2_with_one_line(seeds, tmp_path, capsys):
    essa, fgrpo = seeds
    assert "at least one F-GRPO run" in one_error_line(["--runs", *essa], capsys)
    assert "at least one ESSA run" in one_error_line(["--runs", fgrpo[0]], capsys)
    other = write_run(tmp_path / "other.h5", "essa", 2, ESSA_CONFIG.replace("8", "16"),
                      dict(ESSA_PHASES, generate=1.0), "mean_accuracy")
    assert "differ in essa.population" in one_error_line(["--runs", *essa, other, *fgrpo],
                                                         capsys)
    sft = write_run(tmp_path / "sft.h5", "sft", 1, "", {"forward_backward": 1.0}, "accuracy")
    assert "neither an ESSA nor an F-GRPO" in one_error_line(["--runs", sft, *fgrpo], capsys)
    assert "not found" in one_error_line(["--runs", str(tmp_path / "no.h5"), *fgrpo], capsys)
    assert "more than once" in one_error_line(["--runs", essa[0], essa[0], *fgrpo], capsys)
    assert "--gpu-check-model" in one_error_line(["--gpu-check-model", "x"], capsys)
    assert "calibrate the roofline" in one_error_line(
        ["--gpu-check", GPU_CHECK, "--gen-tps", "1000"], capsys)
    assert "no results for model 'x'" in one_error_line(
        ["--gpu-check", GPU_CHECK, "--gpu-check-model", "x"], capsys)
    assert "not found" in one_error_line(["--gpu-check", str(tmp_path / "no.json")], capsys)
    (tmp_path / "bad.json").write_text("{not json")
    assert "cannot read" in one_error_line(["--gpu-check", str(tmp_path / "bad.json")], capsys)
    skipped = tmp_path / "skipped.json"
    skipped.write_text(json.dumps({"results": [{"model": "qwen2.5-7b",
                                                "skipped": "time budget"}]}))
    assert "was not measured (time budget)" in one_error_line(["--gpu-check", str(skipped)],
                                                              capsys)
