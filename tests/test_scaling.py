"""hpc-scaling: communication formulas, trends, measured costs, and the paper preset."""
import numpy as np
import pytest

from hpc.runtime.runstore import RunStore
from hpc.analysis.scaling import (GPUS, LINKS, QWEN25_32B, Link, Measured, Network, Roofline, Workload,
                         allgather, essa_step, grpo_step, main, predict, ring_allreduce)

NDR = Network(LINKS["infiniband-ndr"], LINKS["nvlink-h100"], 8)
PAPER_W = Workload(population=128, minibatch=256, grpo_batch=512, grpo_generations=8,
                   grpo_minibatch=64, essa_steps=100, grpo_steps=100, essa_update_s=2.0)


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
    assert QWEN25_32B.search_dim == 64 * 7 * 16
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
    g = grpo_step(128, PAPER_W, cost, NDR)
    assert g["generate"] == pytest.approx(cost.generate(4 * 8))
    assert g["allreduce"] == pytest.approx(8 * NDR.allreduce(4 * QWEN25_32B.lora_params, 128))


def test_trends_with_gpu_count():
    rows = predict([16, 32, 64, 128], PAPER_W, paper_costs(), NDR)
    essa = [r["essa_step"] for r in rows]
    grpo = [r["grpo_step"] for r in rows]
    assert all(a > b for a, b in zip(essa, essa[1:]))
    assert all(a > b for a, b in zip(grpo, grpo[1:]))
    comm = [r["essa"]["communication"] for r in rows]
    allred = [r["grpo"]["allreduce"] for r in rows]
    assert all(a < b for a, b in zip(comm, comm[1:]))
    assert all(a < b for a, b in zip(allred, allred[1:]))
    assert comm[-1] < 1e-3 < allred[0]  # ESSA's traffic is tiny next to GRPO's
    assert rows[-1]["ratio"] > rows[0]["ratio"]  # ESSA gains on GRPO as N grows
    for r in rows:
        assert r["essa_ttt"] == pytest.approx(100 * r["essa_step"])
        assert r["ratio"] == pytest.approx(r["grpo_ttt"] / r["essa_ttt"])
    slow = predict([128], PAPER_W, paper_costs(), Network(LINKS["ethernet-100g"], None))
    assert slow[0]["grpo"]["allreduce"] > rows[-1]["grpo"]["allreduce"]


def test_paper_preset_prints_table_assumptions_and_figures(capsys):
    main(["--paper"])
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in table[2:]] == ["16", "32", "64", "128"]
    assert "assumptions:" in out and out.count("\n- ") >= 8
    assert "ring all-reduce 2 (N-1)/N bytes/bw + 2 (N-1) latency" in out
    assert "hierarchical" in out and "not taken from the paper" in out
    assert "2x faster than GRPO on 16 GPUs and 6-7.8x" in out
    rows = predict([16, 128], PAPER_W, paper_costs(), NDR)
    assert f"prediction: {rows[0]['ratio']:.2f}x at 16 GPUs, {rows[1]['ratio']:.2f}x at 128" in out
    assert "where they differ" in out and "sensitivity" in out


def write_run(path, method, ranks, config, phases, heldout_key):
    store = RunStore(str(path), active=True, attrs={
        "method": method, "world_size": ranks, "config": config,
        "trainable_parameters": 1000})
    for step in range(1, 4):
        store.log_step(step, metrics={"wall_s": float(step)},
                       timings={p: np.full(ranks, s) for p, s in phases.items()},
                       nbytes={"grad_allreduce": 4000} if method == "fgrpo" else {"fitness": 32})
        store.write_row("heldout", step, wall_s=float(step), **{heldout_key: 0.2 * step})
    store.close()
    return str(path)


def test_measured_costs_from_run_files(tmp_path, capsys):
    essa = write_run(tmp_path / "essa.h5", "essa", 2,
                     "essa:\n  population: 8\n  minibatch: 10\n",
                     {"rebuild": 0.5, "generate": 3.0, "reward": 0.5, "update": 0.25,
                      "eval": 9.0}, "mean_accuracy")
    grpo = write_run(tmp_path / "fgrpo.h5", "fgrpo", 2,
                     "fgrpo:\n  batch_prompts: 4\n  num_generations: 4\n  num_iterations: 2\n",
                     {"generation": 1.0, "reward": 0.0, "forward_backward": 2.0,
                      "optimizer": 0.1}, "accuracy")
    cost = Measured(essa, grpo)
    assert cost.s_essa == pytest.approx(2 * 4.0 / 80)  # rank-seconds per scored completion
    assert cost.s_gen == pytest.approx(2 * 1.0 / 16)
    assert cost.s_train == pytest.approx(2 * 2.0 / 16)
    assert cost.essa_update_s == pytest.approx(0.25)
    assert cost.optimizer_s == pytest.approx(0.05) and cost.grad_bytes == 2000
    assert cost.steps_to_target(0.5) == (3, 3)
    w = Workload(**cost.workload_defaults(), essa_steps=3, grpo_steps=3)
    assert essa_step(4, w, cost, NDR)["generate"] == pytest.approx(2 * 10 * cost.s_essa)
    assert grpo_step(4, w, cost, NDR)["forward_backward"] == pytest.approx(4 * cost.s_train)
    main(["--runs", essa, grpo, "--target", "0.5", "--gpus", "1", "2", "4"])
    out = capsys.readouterr().out
    assert "costs measured in" in out and "first held-out accuracy >= 0.5" in out
    with pytest.raises(SystemExit) as err:
        main(["--runs", essa, grpo, "--target", "0.9"])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        main(["--runs", grpo, essa])
    assert err.value.code == 2


def test_user_errors_exit_2():
    for argv in (["--target", "0.5"], ["--gpus", "0"], ["--params", "1e12"],
                 ["--gen-tps", "1e7", "--gen-batch", "8"], ["--population", "0"],
                 ["--gen-tps", "0"], ["--essa-update-s", "-1"]):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2, argv
